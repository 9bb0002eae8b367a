"""How the offload engine stores optimizer states in host memory: fp32, or compressed.

- `int8`: block-wise dynamic quantisation as 8-bit optimizers store their states (Dettmers et
  al. 2022, "8-bit Optimizers via Block-wise Quantization"): one byte per element indexing a
  256-entry dynamic map, one fp32 absmax scale per block of `core.offload.INT8_BLOCK` (256,
  torchao's AdamW8bit default) elements; the first moment uses the signed map, the second
  the unsigned one. torchao's functions do the work (torchao/optim/quant_utils.py:
  `create_dynamic_map`, `scale_tensor`, `dequant_with_qmap`); the codes are those of its
  `quantize_8bit_with_qmap`, found in one pass (`quantize_with_qmap` below).
  Each tensor's codes are padded to whole blocks, so blocks never span two tensors.
- `bf16`: stochastic rounding of the fp32 state to bf16 (torchao's `_fp32_to_bf16_sr`, the
  rounding its bf16 AdamW uses);
- `fp16`: fp16 covers too few decades for Adam's second moment (squared gradients of 1e-3
  are 1e-9 after the first step's (1 - beta2) = 1e-3, below fp16's smallest subnormal, 6e-8,
  and a zero there turns the update m / (sqrt(v) + eps) into m / 1e-8): it is stored per
  block like int8, scaled so the block's absmax is 2^15 (torchao's fp8 optimizer states
  scale per block the same way), then rounded stochastically, written here (torchao has no
  fp16 rounding): towards the upper neighbour with probability (x - lower) / (upper - lower).

Stochastic rounding draws from the process RNG inside `torch.random.fork_rng`, seeded from
(seed, rank, step, group): runs are reproducible and the training RNG is left untouched.
A value already representable in 16 bits rounds to itself, so decode-then-encode keeps bf16
and fp16 states bit-exact; int8 codes need not survive it, so checkpoints also keep the
compressed store itself (runtime/checkpoint.py).
"""

from __future__ import annotations

import logging
from functools import lru_cache

import torch

from ..core.offload import INT8_BLOCK

SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the second moment is never negative


FP16_TOP = 2.0**15  # where a block's absmax lands in fp16: a power of two, so scaling is exact
TINY = 1e-30  # absmax floor of an all-zero block (its values encode to 0)


def padded(numel: int, compression: str) -> int:
    """Elements a tensor of `numel` takes in the store: block-wise codes fill whole blocks."""
    return -(-numel // INT8_BLOCK) * INT8_BLOCK if compression in BLOCKWISE else numel


BLOCKWISE = ("int8", "fp16")


@lru_cache(maxsize=1)
def _torchao():
    """torchao's quantisation helpers, imported on first use (it takes seconds to import).
    Its import logs that its CUDA kernels cannot load on a CPU-only build: not an error here."""
    for name in ("torchao", "torch.utils._pytree"):
        logging.getLogger(name).setLevel(logging.ERROR)
    from torchao.optim import quant_utils

    return quant_utils


@lru_cache(maxsize=2)
def _qmap(signed: bool) -> torch.Tensor:
    return torch.tensor(_torchao().create_dynamic_map(signed=signed), dtype=torch.float32)


def quantize_with_qmap(values: torch.Tensor, qmap: torch.Tensor) -> torch.Tensor:
    """The code of each value in the sorted map `qmap`, as torchao's `quantize_8bit_with_qmap`
    gives it (torchao/optim/quant_utils.py): the last entry at or below the value, moved up one
    where the value is at least halfway to the next entry. torchao finds the entry by eight
    rounds of a branchless binary search over the whole tensor, written for torch.compile;
    eager on the host, one `searchsorted` does the same in a pass (2.6x faster on 20M values;
    the codes of finite values are equal, tests/test_offload_codec.py)."""
    last = qmap.numel() - 1
    codes = torch.searchsorted(qmap, values, right=True).sub_(1).clamp_(0, last)
    below = qmap[codes]
    half_gap = qmap[(codes + 1).clamp_(max=last)].sub_(below).mul_(0.5)
    residual = torch.sub(values, below, out=below)
    # In place, so the temporaries stay within core/host.py's INT8_TEMPORARY (32 B/element):
    # at most the int64 codes, one int64 index, two fp32 values and the caller's input.
    return codes.add_(residual >= half_gap).clamp_(max=last).to(torch.uint8)


class StoredState:
    """One optimizer state of a group of tensors, as kept in host memory."""

    def __init__(self, numel: int, compression: str, name: str):
        self.compression = compression
        self.signed = SIGNED.get(name, True)
        if compression in BLOCKWISE:
            self.codes = torch.zeros(numel, dtype=torch.uint8 if compression == "int8" else torch.float16)
            self.scales = torch.zeros(numel // INT8_BLOCK, dtype=torch.float32)  # zero scales decode to 0
        elif compression == "bf16":
            self.codes = torch.zeros(numel, dtype=torch.bfloat16)
        else:
            self.codes = torch.zeros(numel, dtype=torch.float32)

    def tensors(self) -> list[torch.Tensor]:
        return [self.codes, self.scales] if self.compression in BLOCKWISE else [self.codes]

    def decode(self, out: torch.Tensor) -> None:
        """Write the fp32 values into `out` (same number of elements)."""
        if self.compression == "int8":
            qmap = _qmap(self.signed)
            out.copy_(_torchao().dequant_with_qmap(self.codes, qmap, self.scales))
        elif self.compression == "fp16":
            out.view(-1, INT8_BLOCK).copy_(self.codes.view(-1, INT8_BLOCK).float() * self.scales.view(-1, 1))
        else:
            out.copy_(self.codes)

    def encode(self, values: torch.Tensor, seed: int) -> None:
        """Store the fp32 `values` (same number of elements)."""
        if self.compression == "int8":
            ao = _torchao()
            scaled, scales = ao.scale_tensor(values, INT8_BLOCK)
            self.codes.copy_(quantize_with_qmap(scaled, _qmap(self.signed)))
            self.scales.copy_(scales)
        elif self.compression == "bf16":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                self.codes.copy_(_torchao()._fp32_to_bf16_sr(values))
        elif self.compression == "fp16":
            blocked = values.view(-1, INT8_BLOCK)
            scales = blocked.abs().amax(dim=1).clamp(min=TINY) / FP16_TOP
            generator = torch.Generator().manual_seed(seed)
            self.codes.view(-1, INT8_BLOCK).copy_(fp16_stochastic(blocked / scales.view(-1, 1), generator))
            self.scales.copy_(scales)
        else:
            self.codes.copy_(values)


def fp16_stochastic(values: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """fp32 -> fp16 rounding to either neighbour with probability proportional to nearness
    (unbiased: E[round(x)] = x within fp16's range); values beyond it saturate."""
    limit = torch.finfo(torch.float16).max
    values = values.clamp(-limit, limit)
    nearest = values.to(torch.float16)
    above = nearest.float() >= values
    toward = torch.where(above, torch.full_like(nearest, -torch.inf), torch.full_like(nearest, torch.inf))
    other = torch.nextafter(nearest, toward)
    low = torch.where(above, other, nearest).float()
    high = torch.where(above, nearest, other).float()
    gap = high - low
    chance_high = torch.where(gap > 0, (values - low) / gap, torch.zeros_like(values))
    draw = torch.rand(values.shape, generator=generator)
    exact = nearest.float() == values
    chosen = torch.where(draw < chance_high, high, low)
    return torch.where(exact, nearest.float(), chosen).to(torch.float16)
