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
  scale per block the same way), then rounded stochastically, written here (torchao has no
  fp16 rounding): towards the upper neighbour with probability (x - lower) / (upper - lower).

Every codec works `CHUNK` elements at a time, so its temporaries are a few MiB that stay in
the processor's caches and are reused, not fresh gigabytes per state and step.

Stochastic rounding draws from generators of its own, seeded from (seed, rank, step, group,
chunk): runs are reproducible and the training RNG is left untouched.
A value already representable in 16 bits rounds to itself, so decode-then-encode keeps bf16
and fp16 states bit-exact; int8 codes need not survive it, so checkpoints also keep the
compressed store itself (runtime/checkpoint.py).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import torch

from ..core.offload import CODEC_CHUNK as CHUNK
from ..core.offload import INT8_BLOCK, ROUNDING_CHUNKS

SIGNED = {"exp_avg": True, "exp_avg_sq": False}  # the second moment is never negative


FP16_TOP = 2.0**15  # where a block's absmax lands in fp16: a power of two, so scaling is exact
TINY = 1e-30  # absmax floor of an all-zero block (its values encode to 0)
KEEP_BF16 = -(1 << 16)  # 0xFFFF0000 as int32: the sign, exponent and 7 mantissa bits bf16 keeps


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
        if self.compression not in BLOCKWISE:
            self.codes.copy_(values)
            return
        for start in range(0, values.numel(), CHUNK):
            stop = min(values.numel(), start + CHUNK)
            codes, scales = self._blocks(start, stop)
            chunk = values[start:stop]
            if self.compression == "int8":
                scaled, found = _torchao().scale_tensor(chunk, INT8_BLOCK)
                codes.copy_(code_table(self.signed).codes(scaled))
            else:
                blocked = chunk.view(-1, INT8_BLOCK)
                found = blocked.abs().amax(dim=1).clamp(min=TINY) / FP16_TOP
                generator = torch.Generator().manual_seed(chunk_seed(seed, start // CHUNK))
                codes.view(-1, INT8_BLOCK).copy_(fp16_stochastic(blocked / found.view(-1, 1), generator))
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
    return torch.empty(min(numel, ROUNDING_CHUNKS * CHUNK), dtype=torch.int32)


def bf16_stochastic(values: torch.Tensor, out: torch.Tensor, seed: int, bits: torch.Tensor | None = None) -> None:
    """Round the fp32 `values` stochastically into the bf16 `out` (module docstring), a round
    of `ROUNDING_CHUNKS` chunks at a time: their random bits drawn in parallel into `bits`
    (`rounding_bits`; a new one when not given), the carry and the truncation in torch's own
    parallel kernels."""
    numel = values.numel()
    width = min(numel, ROUNDING_CHUNKS * CHUNK)
    bits = (bits if bits is not None else rounding_bits(numel))[:width]

    def fill(start: int, base: int) -> None:
        generator = torch.Generator().manual_seed(chunk_seed(seed, start // CHUNK))
        bits[start - base:min(numel, start + CHUNK) - base].random_(0, 1 << 16, generator=generator)

    for base in range(0, numel, width):
        stop = min(numel, base + width)
        list(_pool().map(fill, range(base, stop, CHUNK), [base] * -(-(stop - base) // CHUNK)))
        carried = bits[:stop - base].add_(values[base:stop].view(torch.int32)).bitwise_and_(KEEP_BF16)
        out[base:stop].copy_(carried.view(torch.float32))  # exact: the dropped bits are zero


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
