"""Bytes of NF4 weights and 8-bit AdamW states against what torchao really allocates."""

from __future__ import annotations

import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from shardplan.core.quantized import adamw8bit_bytes, adamw8bit_quantized, nf4_bytes, nf4_dequant_bytes  # noqa: E402
from shardplan.runtime.lora import inner_tensors  # noqa: E402
from shardplan.runtime.measure import unique_storage_bytes  # noqa: E402

# Weights of the shapes the estimate meets: the smallest torchao accepts (64 * 256 elements),
# rectangular ones both ways, and a Llama-3 8B k_proj slice (1024 x 4096 / 4).
NF4_SHAPES = [(128, 128), (256, 128), (128, 512), (1024, 1024)]


def to_nf4(weight):
    from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4 as quantize

    return quantize(weight)


@pytest.mark.parametrize("shape", NF4_SHAPES)
def test_nf4_bytes_equal_torchao_storages(shape):
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    allocated = sum(t.untyped_storage().nbytes() for t in inner_tensors(weight))
    assert nf4_bytes(shape[0] * shape[1]) == allocated
    assert unique_storage_bytes([weight]) == {"cpu": allocated}  # what `run` measures


class NewAllocations(TorchDispatchMode):
    """Peak bytes of the storages operators create while the mode is on (views of existing
    storages are not new), each counted until it is freed."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing, self.live, self.current, self.peak = existing, set(), 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_flatten(out)[0]:
            if type(tensor) is not torch.Tensor:
                continue
            storage = tensor.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.existing or key in self.live or size == 0:
                continue
            self.live.add(key)
            self.current += size
            self.peak = max(self.peak, self.current)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key: int, size: int) -> None:
        self.live.discard(key)
        self.current -= size


@pytest.mark.parametrize("shape", NF4_SHAPES)
def test_dequantization_working_set(shape):
    """What F.linear on an NF4 weight allocates to dequantize it (torchao's LinearNF4 calls
    `weight.to(input.dtype)`), at its peak."""
    weight = to_nf4(torch.randn(*shape, dtype=torch.bfloat16))
    existing = {t.untyped_storage().data_ptr() for t in inner_tensors(weight)}
    mode = NewAllocations(existing)
    with mode:
        dense = weight.to(torch.bfloat16)
    assert dense.shape == shape
    assert mode.peak == nf4_dequant_bytes(shape[0] * shape[1])


# Tensors below 4,096 elements, not a multiple of the 256-element block, and quantized ones,
# in fp32 and bf16 (plain moments take the parameter's dtype).
STATE_SHAPES = [(64,), (100, 50), (64, 64), (128, 256), (96, 96)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_adamw8bit_bytes_equal_torchao_states(dtype):
    """The moments AdamW8bit creates for each tensor (`_new_buffer`, which its step calls for
    a tensor's first update), and the fp32 step beside them."""
    from torchao.optim import AdamW8bit

    params = [torch.nn.Parameter(torch.randn(*shape, dtype=dtype)) for shape in STATE_SHAPES]
    optimizer = AdamW8bit(params, lr=1e-3)
    kinds = set()
    for p in params:
        state = [optimizer._new_buffer(p, True), optimizer._new_buffer(p, False), torch.tensor(0.0)]
        allocated = sum(unique_storage_bytes(state).values())
        assert allocated == adamw8bit_bytes(p.numel(), p.element_size()), tuple(p.shape)
        kinds.add(adamw8bit_quantized(p.numel()))
    assert kinds == {True, False}  # both of torchao's layouts were met


def test_adamw8bit_step_keeps_those_states():
    """A real step (torch.compile'd on its first call: one shape keeps it short) leaves
    exactly those bytes, and its moments are 8-bit."""
    from torchao.optim import AdamW8bit

    param = torch.nn.Parameter(torch.randn(128, 256))
    optimizer = AdamW8bit([param], lr=1e-3)
    param.grad = torch.randn_like(param)
    optimizer.step()
    state = optimizer.state[param]
    assert type(state["exp_avg"]).__name__ == "OptimState8bit"
    assert sum(unique_storage_bytes(state.values()).values()) == adamw8bit_bytes(param.numel(), 4)
