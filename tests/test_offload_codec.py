"""The host-state codec against torchao: int8 codes equal to its `quantize_8bit_with_qmap`,
bf16 stochastic rounding by the rule of its `_fp32_to_bf16_sr` (torchao/optim/quant_utils.py);
fp16's rounding against the neighbours torch's own cast and nextafter give; and the host
memory traffic the time model charges for it, counted on the codec's passes."""

from __future__ import annotations

import re
from concurrent.futures import Future

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


def _fp16_neighbours(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp16 values just below and just above each fp32 value (both the value where fp16
    holds it), by torch's own cast and nextafter."""
    near = values.to(torch.float16)
    toward = torch.where(near.float() > values, -torch.inf, torch.inf).to(torch.float16)
    other = torch.where(near.float() == values, near, torch.nextafter(near, toward)).float()
    return torch.minimum(near.float(), other), torch.maximum(near.float(), other)


def _anchored(values: torch.Tensor) -> torch.Tensor:
    """`values` in blocks whose first element is +-2^15, so every block's scale is 1 and the
    stored codes are the fp16 rounding of the values themselves."""
    blocks = values.view(-1, INT8_BLOCK - 1)
    signs = torch.where(torch.arange(blocks.shape[0]) % 2 == 0, 1.0, -1.0).view(-1, 1)
    return torch.cat([signs * codec.FP16_TOP, blocks], dim=1).view(-1)


def _fp16_codes(values: torch.Tensor, seed: int) -> torch.Tensor:
    state = StoredState(values.numel(), "fp16", "exp_avg")
    state.encode(values, seed)
    assert bool((state.scales == 1).all())
    return state.codes


def test_fp16_rounding_lands_on_a_neighbour():
    """Over values spread across 60 binades, fp16's subnormals among them, both zeros, values
    fp16 holds (and the fp32 values next to them) and +-2^15, across several chunks: each
    value rounds to one of its two fp16 neighbours, and a value fp16 holds to itself, bit for
    bit (the sign of zero included)."""
    generator = torch.Generator().manual_seed(11)
    count = 5 * CODEC_CHUNK // 2
    sign = torch.where(torch.rand(count, generator=generator) < 0.5, -1.0, 1.0)
    spread = sign * 2.0 ** (torch.rand(count, generator=generator) * 60 - 45)
    patterns = torch.randint(-(1 << 15), 1 << 15, (count,), generator=generator, dtype=torch.int32)
    held = patterns.to(torch.int16).view(torch.float16).float()
    held = held[held.isfinite() & (held.abs() <= codec.FP16_TOP)]
    beside = torch.cat([torch.nextafter(held, torch.tensor(end)) for end in (torch.inf, -torch.inf)])
    edges = torch.tensor([0.0, -0.0, codec.FP16_TOP, -codec.FP16_TOP, 2.0**-14, -(2.0**-24), 2.0**-25, 65504 / 2])
    values = torch.cat([spread, held, beside.clamp(-codec.FP16_TOP, codec.FP16_TOP), edges.repeat(1000)])
    values = _anchored(values[:values.numel() // (INT8_BLOCK - 1) * (INT8_BLOCK - 1)])
    assert values.numel() > 4 * CODEC_CHUNK and bool(((values.abs() < 2.0**-14) & (values != 0)).any())
    rounded = _fp16_codes(values, seed=3)
    low, high = _fp16_neighbours(values)
    assert bool(((rounded.float() == low) | (rounded.float() == high)).all())
    exact = values.to(torch.float16).float() == values
    assert torch.equal(rounded[exact].view(torch.int16), values[exact].to(torch.float16).view(torch.int16))


@pytest.mark.parametrize("value", [
    1 + 2.0**-12, -1000.35, 30014.4, -0.7, 2.0**-14 + 0.5 * 2.0**-24,  # fp16 normals
    3.3 * 2.0**-24, -700.6 * 2.0**-24, 2.0**-14 - 0.25 * 2.0**-24, 0.1 * 2.0**-24, -0.9 * 2.0**-24,  # subnormals
])
def test_fp16_rounding_is_unbiased(value):
    """Over 100k draws of one value, normal or subnormal in fp16 (below its smallest
    subnormal too): it rounds up with probability (x - low) / (high - low) and its mean is x,
    each within five standard errors."""
    x = torch.tensor(value, dtype=torch.float32)
    draws = 400 * (INT8_BLOCK - 1)
    rounded = _fp16_codes(_anchored(x.repeat(draws)), seed=21).view(-1, INT8_BLOCK)[:, 1:].double()
    low, high = (bound.double() for bound in _fp16_neighbours(x.view(1)))
    chance = float((x.double() - low) / (high - low))
    assert 0 < chance < 1
    spread = (chance * (1 - chance) / draws) ** 0.5
    assert bool(((rounded == low) | (rounded == high)).all())
    assert abs(float((rounded == high).double().mean()) - chance) < 5 * spread
    assert abs(float(rounded.mean() - x.double())) < 5 * spread * float(high - low)


def test_fp16_rounding_is_the_seeds_whatever_the_threads():
    """Random bits come from one generator per chunk, seeded from (seed, chunk), its
    subnormals' draws included: the same seed rounds alike with three threads (the ring of
    random bits reused) or one, another seed differently; the process RNG is left as it was."""
    generator = torch.Generator().manual_seed(2)
    numel = 4 * CODEC_CHUNK + 2 * INT8_BLOCK
    values = torch.randn(numel, generator=generator) * 2.0 ** (torch.randint(-50, 0, (numel,), generator=generator))
    threads = torch.get_num_threads()
    state = torch.random.get_rng_state()
    stored = []
    try:
        for count, seed in ((3, 9), (1, 9), (3, 10)):
            torch.set_num_threads(count)
            store = StoredState(numel, "fp16", "exp_avg")
            store.encode(values, seed)
            stored.append(store)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(stored[0].codes.view(torch.int16), stored[1].codes.view(torch.int16))
    assert torch.equal(stored[0].scales, stored[1].scales)
    assert not torch.equal(stored[0].codes, stored[2].codes)
    assert torch.equal(torch.random.get_rng_state(), state)


def test_fp16_state_round_trips():
    """Decoded values lie within one fp16 step (scaled) of the values stored, an all-zero
    block decodes to zeros; with power-of-two scales (here 1) decode-then-encode gives back
    the codes bit for bit, subnormals and the sign of zero included."""
    generator = torch.Generator().manual_seed(4)
    numel = 2 * CODEC_CHUNK + 3 * INT8_BLOCK
    values = torch.randn(numel, generator=generator) * 10 ** (-6 * torch.rand(numel, generator=generator))
    values[:INT8_BLOCK] = 0
    state = StoredState(numel, "fp16", "exp_avg_sq")
    state.encode(values, seed=5)
    out = torch.empty(numel)
    state.decode(out)
    scale = state.scales.repeat_interleave(INT8_BLOCK)
    assert bool(((out - values).abs() <= (2.0**-10 * values.abs() + 2.0**-24 * scale) * (1 + 2.0**-8)).all())
    assert not bool(out[:INT8_BLOCK].any())
    held = _anchored(torch.cat([values[INT8_BLOCK:], torch.tensor([0.0, -0.0] * 255)])[:(INT8_BLOCK - 1) * 8200])
    first, again = (StoredState(held.numel(), "fp16", "exp_avg") for _ in range(2))
    first.encode(held, seed=6)
    out = torch.empty(held.numel())
    first.decode(out)
    again.encode(out, seed=7)
    assert torch.equal(again.codes.view(torch.int16), first.codes.view(torch.int16))
    assert torch.equal(again.scales, first.scales)


class _Traffic(TorchDispatchMode):
    """Bytes each operation reads (its tensor inputs) and writes (its tensor outputs); views
    and allocations move nothing, and an operation that only overwrites its first argument, or
    the tensor given as `out`, does not read it."""

    MOVES_NOTHING = re.compile(r"view|slice|detach|alias|select|expand|squeeze|as_strided|lift_fresh|aten\.t\.|"
                               r"aten\.empty")
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
            given = {key: value for key, value in (kwargs or {}).items() if key != "out"}
            self.bytes += self.size(tree_flatten((read, given))[0]) + self.size(tree_flatten(out)[0])
        return out


class _InThisThread:
    def map(self, fn, *iterables):
        return map(fn, *iterables)

    def submit(self, fn, *args):
        done = Future()
        done.set_result(fn(*args))
        return done


@pytest.mark.parametrize("compression", ["bf16", "fp16", "int8"])
def test_the_time_models_codec_bytes_are_the_codes_passes(compression, monkeypatch):
    """core/time_plan.py COMPRESSION_STEP_BYTES is what decoding and encoding both moments
    read and write per element, counted here operation by operation on the codec itself
    (bf16's and fp16's random bits drawn in this thread, so they count too), in a step after the first."""
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
