"""The host-state codec against torchao: int8 codes equal to its `quantize_8bit_with_qmap`,
bf16 stochastic rounding by the rule of its `_fp32_to_bf16_sr` (torchao/optim/quant_utils.py);
and the host memory traffic the time model charges for it, counted on the codec's passes."""

from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchao")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

from shardplan.core.offload import CODEC_CHUNK, INT8_BLOCK  # noqa: E402
from shardplan.core.time_plan import COMPRESSION_STEP_BYTES  # noqa: E402
from shardplan.runtime import offload_codec as codec  # noqa: E402
from shardplan.runtime.offload_codec import StoredState, _qmap, _torchao, bf16_stochastic, code_table  # noqa: E402


@pytest.mark.parametrize("signed", [True, False])
def test_int8_codes_equal_torchaos(signed):
    """Every code equals torchao's `quantize_8bit_with_qmap` on random values of the map's
    range, on values spread over eight decades below 1 (where the dynamic map's entries are
    dense), on the map's own entries, the midpoints between them and the floats next to those
    midpoints, where rounding decides, and on both zeros."""
    qmap = _qmap(signed)
    low = -1.0 if signed else 0.0
    middles = (qmap[1:] + qmap[:-1]) / 2
    generator = torch.Generator().manual_seed(0)
    sign = torch.where(torch.rand(300_000, generator=generator) < 0.5, -1.0, 1.0) if signed else 1.0
    decades = sign * 10 ** (-8 * torch.rand(300_000, generator=generator))
    values = torch.cat([
        torch.rand(300_000, generator=generator) * (1.0 - low) + low, decades,
        qmap, middles,
        torch.nextafter(middles, torch.tensor(2.0)), torch.nextafter(middles, torch.tensor(-2.0)),
        torch.tensor([low, 1.0, 0.0, -0.0]),
    ]).clamp(low, 1.0)
    expected = _torchao().quantize_8bit_with_qmap(values, qmap)
    assert torch.equal(code_table(signed).codes(values), expected)


def test_int8_state_round_trip_is_torchaos():
    """A stored int8 state over several chunks decodes to what torchao's own quantise and
    dequantise give (the store's scales are its `scale_tensor`'s)."""
    ao = _torchao()
    numel = 2 * CODEC_CHUNK + 3 * 256
    values = torch.randn(numel, generator=torch.Generator().manual_seed(1)) * 1e-3
    state = StoredState(numel, "int8", "exp_avg")
    state.encode(values, seed=0)
    out = torch.empty(numel)
    state.decode(out)
    scaled, scales = ao.scale_tensor(values, 256)
    expected = ao.dequant_with_qmap(ao.quantize_8bit_with_qmap(scaled, _qmap(True)), _qmap(True), scales)
    assert torch.equal(out, expected)


def test_bf16_rounding_takes_torchaos_chances():
    """Each value rounds to one of its two bf16 neighbours, away from zero with probability
    (low 16 bits of its fp32 pattern) / 2^16, as `_fp32_to_bf16_sr` rounds (checked against
    that function's own frequencies); a value bf16 holds stays; the mean is the value."""
    base = torch.tensor([1.0, -3.0, 2.0**-66, -917504.0], dtype=torch.float32)  # bf16 holds each
    for fraction in (0x1000, 0x8000, 0xF000):  # 1/16, 1/2, 15/16 of the way to the next
        pattern = base.view(torch.int32) + fraction
        values = pattern.view(torch.float32).repeat_interleave(200_000)
        out = torch.empty(values.numel(), dtype=torch.bfloat16)
        bf16_stochastic(values, out, seed=5)
        toward = (pattern & -(1 << 16)).view(torch.float32).repeat_interleave(200_000)
        away = ((pattern & -(1 << 16)) + (1 << 16)).view(torch.float32).repeat_interleave(200_000)
        rounded = out.float()
        assert bool(((rounded == toward) | (rounded == away)).all())
        torch.manual_seed(5)
        theirs = _torchao()._fp32_to_bf16_sr(values).float() == away
        for mine, their in zip((rounded == away).view(4, -1).float().mean(1), theirs.view(4, -1).float().mean(1)):
            assert abs(mine - fraction / 2**16) < 0.005 and abs(mine - their) < 0.007
    exact = torch.tensor([1.0, -2.5, 0.0, 2.0**127], dtype=torch.float32).repeat(1000)
    out = torch.empty(exact.numel(), dtype=torch.bfloat16)
    bf16_stochastic(exact, out, seed=1)
    assert torch.equal(out.float(), exact)


def test_bf16_rounding_is_the_seeds_whatever_the_threads():
    """The random bits come from one generator per chunk, seeded from (seed, chunk): the same
    seed rounds alike with one thread or several, another seed differently; the process RNG is
    left where it was."""
    values = torch.randn(3 * CODEC_CHUNK + 5, generator=torch.Generator().manual_seed(2))
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    rounded = []
    try:
        for count, seed in ((threads, 9), (1, 9), (threads, 10)):
            torch.set_num_threads(count)
            out = torch.empty(values.numel(), dtype=torch.bfloat16)
            bf16_stochastic(values, out, seed)
            rounded.append(out)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(rounded[0], rounded[1]) and not torch.equal(rounded[0], rounded[2])
    assert torch.equal(torch.random.get_rng_state(), state)


class _Traffic(TorchDispatchMode):
    """Bytes each operation reads (its tensor inputs) and writes (its tensor outputs); views
    move nothing, and an operation that only overwrites its first argument does not read it."""

    MOVES_NOTHING = re.compile(r"view|slice|detach|alias|select|expand|squeeze|as_strided|lift_fresh|aten\.t\.")
    ONLY_WRITES = re.compile(r"aten\.(copy_|random_|fill_|zero_|uniform_)\.")

    def __init__(self):
        super().__init__()
        self.bytes = 0

    @staticmethod
    def size(tensors) -> int:
        unique = {(t.data_ptr(), t.numel(), t.dtype): t for t in tensors if isinstance(t, torch.Tensor)}
        return sum(t.numel() * t.element_size() for t in unique.values() if t.numel() > INT8_BLOCK)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self.MOVES_NOTHING.search(str(func)):
            read = args[1:] if self.ONLY_WRITES.search(str(func)) else args
            self.bytes += self.size(tree_flatten((read, kwargs or {}))[0]) + self.size(tree_flatten(out)[0])
        return out


class _InThisThread:
    def map(self, fn, *iterables):
        return map(fn, *iterables)


@pytest.mark.parametrize("compression", ["bf16", "fp16", "int8"])
def test_the_time_models_codec_bytes_are_the_codes_passes(compression, monkeypatch):
    """core/time_plan.py COMPRESSION_STEP_BYTES is what decoding and encoding both moments
    read and write per element, counted here operation by operation on the codec itself
    (bf16's random bits drawn in this thread, so they count too), in a step after the first."""
    monkeypatch.setattr(codec, "_pool", lambda: _InThisThread())
    numel = 2 * CODEC_CHUNK
    values = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * 1e-3
    out = torch.empty(numel)
    bits = codec.rounding_bits(numel)  # kept by the engine (runtime/offload.py)
    moved = 0
    for name in ("exp_avg", "exp_avg_sq"):
        state = StoredState(numel, compression, name)
        moment = values.abs() if name == "exp_avg_sq" else values
        state.encode(moment, seed=3, bits=bits)  # once before counting: the tables kept between steps
        with _Traffic() as traffic:
            state.encode(moment, seed=4, bits=bits)
            state.decode(out)
        moved += traffic.bytes
    assert moved / numel == pytest.approx(COMPRESSION_STEP_BYTES[compression], rel=0.02)
