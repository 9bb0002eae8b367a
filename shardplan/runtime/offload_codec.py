"""How the offload engine stores optimizer states in host memory: fp32, or compressed.

- `int8`: block-wise dynamic quantisation as 8-bit optimizers store their states (Dettmers et
  al. 2022, "8-bit Optimizers via Block-wise Quantization"): one byte per element indexing a
  256-entry dynamic map, one fp32 absmax scale per block of `core.offload.INT8_BLOCK` (256,
  torchao's AdamW8bit default) elements; the first moment uses the signed map, the second
  the unsigned one. torchao's functions make the map and scale and decode
  (torchao/optim/quant_utils.py: `create_dynamic_map`, `scale_tensor`, `dequant_with_qmap`);
  the codes are those of its `quantize_8bit_with_qmap` (the last map entry at or below the
  value, moved up one where the value is at least halfway to the next), found by a table
  (`CodeTable` below) instead of its eight rounds of binary search over the whole tensor.
  Each tensor's codes are padded to whole blocks, so blocks never span two tensors.
- `bf16`: stochastic rounding of the fp32 state to bf16 by the rule of torchao's
  `_fp32_to_bf16_sr` (torchao/optim/quant_utils.py, the rounding its bf16 AdamW uses): away
  from zero with probability (low 16 bits of the fp32 pattern) / 2^16, computed as that
  function's own comment offers, (bits + r) & 0xFFFF0000 with r uniform in [0, 2^16). Written
  here rather than called: torchao draws r from the process generator, which on the CPU is
  one serial stream, so a step of a large model waited on one core for its random bits
  (docs/validation.md, the CUDA offload runs). Here each chunk of `CHUNK` elements has its own
  generator, seeded from (seed, chunk), and a pool of threads fills them at once: the bits do
  not depend on how many threads there are;
- `fp16`: fp16 covers too few decades for Adam's second moment (squared gradients of 1e-3
  are 1e-9 after the first step's (1 - beta2) = 1e-3, below fp16's smallest subnormal, 6e-8,
  and a zero there turns the update m / (sqrt(v) + eps) into m / 1e-8): it is stored per
  block like int8, scaled so the block's absmax is 2^15 (torchao's fp8 optimizer states
  scale per block the same way; no value then exceeds fp16's range), then rounded
  stochastically by the rule of `_fp32_to_bf16_sr` at fp16's width (torchao has no fp16
  rounding): where fp16 is normal (|x| >= 2^-14) it keeps 10 of fp32's 23 mantissa bits, so
  (bits + r) & 0xFFFFE000 with r uniform in [0, 2^13) rounds away from zero with probability
  (the 13 dropped bits) / 2^13, that is up with probability (x - lower) / (upper - lower)
  whatever the sign, to an fp32 value fp16 holds exactly. fp16's subnormals are 2^-24 apart
  whatever x's exponent, so the few values below 2^-14 (found by one minimum over the chunk)
  round again on that grid. The random bits come per chunk as bf16's, two elements' 13 bits
  from one 31-bit draw, the pool drawing the next chunks' while the current one is rounded.

Every codec works `CHUNK` elements at a time, so its temporaries are a few MiB that stay in
the processor's caches and are reused, not fresh gigabytes per state and step (fp16 also
holds a half-chunk of random bits per thread).

Stochastic rounding draws from generators of its own, seeded from (seed, rank, step, group,
chunk): runs are reproducible and the training RNG is left untouched.
A value already representable in 16 bits rounds to itself, so decode-then-encode keeps bf16
states bit-exact, and fp16 states whose scales are powers of two. Other fp16 codes need not
survive it (a decoded value divided by its scale can come back an fp32 ulp off its code, which
then rounds away with probability 2^-13), nor int8 codes, so checkpoints also keep the
compressed store itself (runtime/checkpoint.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from ..core.offload import CODEC_CHUNK as CHUNK
from ..core.offload import INT8_BLOCK, ROUNDING_CHUNKS, rounding_elements

SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the second moment is never negative


FP16_TOP = 2.0**15  # where a block's absmax lands in fp16: a power of two, so scaling is exact
TINY = 1e-30  # absmax floor of an all-zero block (its values encode to 0)
KEEP_BF16 = -(1 << 16)  # 0xFFFF0000 as int32: the sign, exponent and 7 mantissa bits bf16 keeps
FP16_DROPPED = (1 << 13) - 1  # the 13 low mantissa bits of fp32 that fp16 drops (23 - 10)
KEEP_FP16 = ~FP16_DROPPED  # 0xFFFFE000 as int32: sign, exponent and the 10 mantissa bits fp16 keeps
SUBNORMAL_KEY = 0x38800000 - 1  # the fp32 pattern of 2^-14, fp16's smallest normal, less one


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


def ordered(values: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 keys in the floats' order (-0.0 and 0.0 alike): the bit pattern for
    positive floats, its magnitude negated for negative ones."""
    bits = values.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def from_ordered(keys: torch.Tensor) -> torch.Tensor:
    return torch.where(keys < 0, (-keys) | -(1 << 31), keys).to(torch.int32).view(torch.float32)


class CodeTable:
    """The int8 codes of torchao's `quantize_8bit_with_qmap` by lookup.

    torchao rounds a value x between map entries q[c] <= x < q[c+1] up to c + 1 where
    fl(x - q[c]) >= fl((q[c+1] - q[c]) * 0.5) in float32. That holds from one float on, the
    threshold t[c]; the code of x is then the number of thresholds at or below x. The
    thresholds are found exactly by bisection over the floats between the two entries.

    Every float32 falls in a bucket by its top 16 bits (sign, exponent, 7 mantissa bits: 1/128
    of a binade). Where a bucket holds at most one threshold (every bucket of both of
    torchao's maps; checked when the table is built), its code is `low[bucket] + (x >= cut[bucket])`: a shift, two gathers and a
    comparison per element, where a search over 256 entries takes eight dependent steps."""

    def __init__(self, qmap: torch.Tensor):
        below, above = qmap[:-1], qmap[1:]
        half = (above - below) * 0.5
        lo, hi = ordered(below), ordered(above)  # predicate false at q[c], true at q[c+1]
        while bool((hi - lo > 1).any()):
            mid = (lo + hi) // 2
            up = (from_ordered(mid) - below) >= half
            hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
        self.thresholds = from_ordered(hi)
        keys = torch.arange(1 << 16, dtype=torch.int64) - (1 << 15)
        ends = [((keys << 16) | tail).to(torch.int32).view(torch.float32) for tail in (0, 0xFFFF)]
        first, last = torch.minimum(*ends), torch.maximum(*ends)
        low = torch.searchsorted(self.thresholds, first, right=True)
        span = torch.searchsorted(self.thresholds, last, right=True) - low
        finite = ~(first.isnan() | last.isnan())
        if int(span[finite].max()) > 1:
            raise RuntimeError("an int8 map with two thresholds in one 1/128 of a binade: no code table")
        self.low = low.to(torch.uint8)
        cut = self.thresholds[low.clamp(max=self.thresholds.numel() - 1)]
        self.cut = torch.where(span > 0, cut, torch.full_like(cut, torch.inf))

    def codes(self, values: torch.Tensor) -> torch.Tensor:
        bucket = (values.view(torch.int32) >> 16).add_(1 << 15)
        return self.low[bucket].add_(values >= self.cut[bucket])


@lru_cache(maxsize=2)
def code_table(signed: bool) -> CodeTable:
    return CodeTable(_qmap(signed))


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

    def _blocks(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.codes[start:stop], self.scales[start // INT8_BLOCK:stop // INT8_BLOCK]

    def decode(self, out: torch.Tensor) -> None:
        """Write the fp32 values into `out` (same number of elements)."""
        if self.compression not in BLOCKWISE:
            out.copy_(self.codes)  # one pass already; nothing to keep small
            return
        for start in range(0, out.numel(), CHUNK):
            stop = min(out.numel(), start + CHUNK)
            codes, scales = self._blocks(start, stop)
            if self.compression == "int8":
                out[start:stop].copy_(_torchao().dequant_with_qmap(codes, _qmap(self.signed), scales))
            else:
                out[start:stop].view(-1, INT8_BLOCK).copy_(codes.view(-1, INT8_BLOCK).float() * scales.view(-1, 1))

    def encode(self, values: torch.Tensor, seed: int, bits: torch.Tensor | None = None) -> None:
        """Store the fp32 `values` (same number of elements); `bits`: bf16's round buffer
        (`rounding_bits`), kept by the caller."""
        if self.compression == "bf16":
            bf16_stochastic(values, self.codes, seed, bits)
            return
        if self.compression == "fp16":
            fp16_stochastic(values, self.codes, self.scales, seed)
            return
        if self.compression not in BLOCKWISE:
            self.codes.copy_(values)
            return
        for start in range(0, values.numel(), CHUNK):
            stop = min(values.numel(), start + CHUNK)
            codes, scales = self._blocks(start, stop)
            scaled, found = _torchao().scale_tensor(values[start:stop], INT8_BLOCK)
            codes.copy_(code_table(self.signed).codes(scaled))
            scales.copy_(found)


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of one chunk's generator: distinct for each (seed, chunk), within 63 bits."""
    return (seed * 1_000_003 + chunk) % (1 << 63)


@lru_cache(maxsize=1)
def _pool() -> ThreadPoolExecutor:
    """Threads that fill a round's random bits at once, as many as torch computes with."""
    return ThreadPoolExecutor(max_workers=torch.get_num_threads(), thread_name_prefix="shardplan-rounding")


def rounding_bits(numel: int) -> torch.Tensor:
    """The int32 buffer of one round's random bits for tensors of up to `numel` elements. The
    offload engine keeps one (core/host.py counts it): a fresh one per state and group costs
    the kernel a page fault per 4 KiB, a quarter of the rounding's time on a 2-core host."""
    return torch.empty(rounding_elements(numel), dtype=torch.int32)


def bf16_stochastic(values: torch.Tensor, out: torch.Tensor, seed: int, bits: torch.Tensor | None = None) -> None:
    """Round the fp32 `values` stochastically into the bf16 `out` (module docstring), a round
    of `ROUNDING_CHUNKS` chunks at a time: their random bits drawn in parallel into `bits`
    (`rounding_bits`; a new one when not given), the carry and the truncation in torch's own
    parallel kernels."""
    numel = values.numel()
    width = rounding_elements(numel)
    bits = (bits if bits is not None else rounding_bits(numel))[:width]

    def fill(start: int, base: int) -> None:
        generator = torch.Generator().manual_seed(chunk_seed(seed, start // CHUNK))
        bits[start - base:min(numel, start + CHUNK) - base].random_(0, 1 << 16, generator=generator)

    for base in range(0, numel, width):
        stop = min(numel, base + width)
        list(_pool().map(fill, range(base, stop, CHUNK), [base] * -(-(stop - base) // CHUNK)))
        carried = bits[:stop - base].add_(values[base:stop].view(torch.int32)).bitwise_and_(KEEP_BF16)
        out[base:stop].copy_(carried.view(torch.float32))  # exact: the dropped bits are zero


def fp16_stochastic(values: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, seed: int) -> None:
    """Store the fp32 `values` as fp16 `codes` and one fp32 scale per block in `scales`
    (module docstring), a chunk at a time. Each chunk's random bits come from its own
    generator, which the pool runs as many chunks ahead as torch has threads, at most
    `ROUNDING_CHUNKS` as bf16's rounds (a ring of half-chunk buffers), while this thread scales
    and rounds: a 31-bit word gives two elements their 13 bits (bits 0-12 and 18-30)."""
    numel = values.numel()
    starts = range(0, numel, CHUNK)
    width = min(numel, CHUNK)
    ahead = min(len(starts), torch.get_num_threads(), ROUNDING_CHUNKS)
    words = torch.empty(ahead, width // 2, dtype=torch.int32)
    magnitude, scaled = torch.empty(width), torch.empty(width)
    carried = torch.empty(width, dtype=torch.int32)

    def fill(chunk: int) -> torch.Generator:
        generator = torch.Generator().manual_seed(chunk_seed(seed, chunk))
        half = (min(numel, starts[chunk] + CHUNK) - starts[chunk]) // 2
        words[chunk % ahead, :half].random_(generator=generator)  # int32: 32 random bits mod 2^31
        return generator

    drawn = {chunk: _pool().submit(fill, chunk) for chunk in range(ahead)}
    for chunk, start in enumerate(starts):
        stop = min(numel, start + CHUNK)
        size, half = stop - start, (stop - start) // 2
        generator = drawn.pop(chunk).result()
        word = words[chunk % ahead, :half]
        torch.bitwise_and(word, FP16_DROPPED, out=carried[:half])
        torch.bitwise_right_shift(word, 31 - 13, out=carried[half:size])
        if chunk + ahead < len(starts):  # this slot's words are read: it takes a later chunk's
            drawn[chunk + ahead] = _pool().submit(fill, chunk + ahead)
        blocked = values[start:stop].view(-1, INT8_BLOCK)
        found = torch.abs(blocked, out=magnitude[:size].view(-1, INT8_BLOCK)).amax(dim=1)
        found = found.clamp_(min=TINY).div_(FP16_TOP)
        torch.div(blocked, found.view(-1, 1), out=scaled[:size].view(-1, INT8_BLOCK))
        pattern = scaled[:size].view(torch.int32)
        rounded = carried[:size].add_(pattern).bitwise_and_(KEEP_FP16)
        codes[start:stop].copy_(rounded.view(torch.float32))  # exact where |x| >= 2^-14
        # The key, x's pattern less one with the sign bit cleared: |x|'s pattern less one where
        # x != 0, the top for zeros (-0.0's pattern, the lowest int32, wraps there; were it
        # kept, fp16_subnormals would round it to -0.0 all the same).
        key = torch.sub(pattern, 1, out=magnitude[:size].view(torch.int32)).bitwise_and_(0x7FFFFFFF)
        if int(key.amin()) < SUBNORMAL_KEY:
            fp16_subnormals(scaled[:size], codes[start:stop], key, generator)
        scales[start // INT8_BLOCK:stop // INT8_BLOCK].copy_(found)


def fp16_subnormals(scaled: torch.Tensor, codes: torch.Tensor, key: torch.Tensor, generator: torch.Generator) -> None:
    """Round again the `scaled` values fp16 holds as subnormals (0 < |x| < 2^-14: `key` below
    SUBNORMAL_KEY), 2^-24 apart where the carry assumed fp32's finer spacing: |x| * 2^24
    (exact) to an integer, up with probability its fraction, then back by 2^-24 (exact) with
    x's sign. The chunk's generator draws on, torch.rand's multiples of 2^-24: exact chances
    from |x| >= 2^-24 on (the fraction is a multiple of 2^-23 there); below, the chance is
    rounded up to a multiple of 2^-24."""
    where = (key < SUBNORMAL_KEY).nonzero().squeeze(1)
    value = scaled[where]
    units = value.abs().mul_(2.0**24)
    whole = units.floor()
    up = torch.rand(units.shape, generator=generator) < units.sub_(whole)
    codes[where] = whole.add_(up).mul_(2.0**-24).copysign_(value).to(torch.float16)
