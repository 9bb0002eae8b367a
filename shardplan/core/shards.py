"""Who owns which elements of a flat tensor, as each framework cuts it; who owns which block.

Every style gives each rank one contiguous range `[start, end)` of real data and `padding`
extra elements it stores. A rank with no real data has start = end = numel. Sources:

- `even`: the balanced split, first `numel % world` ranks one more element; no padding.
  DeepSpeed's `get_data_parallel_partitions` (stage_1_and_2.py) splits this way.
- `fsdp1`, `fsdp2`, `zero3`: chunk = ceil(numel / world) with torch.chunk semantics: rank r
  holds [r*chunk, (r+1)*chunk) clipped to numel, and pads to a whole chunk, so later ranks
  may hold nothing and store a whole chunk of padding.
  FSDP1: `FlatParamHandle._get_unpadded_shard` takes `flatten(flat_param).chunk(world)[rank]`
  (an empty chunk when there are fewer chunks than ranks) and pads it to `chunks[0].numel()`
  (torch/distributed/fsdp/_flat_param.py; with the default use_orig_params=False, no
  per-parameter alignment padding).
  FSDP2: `_chunk_with_empty` then `padded_sharded_size = chunks[0].size()`
  (torch/distributed/fsdp/_fully_shard/_fsdp_param.py), per tensor along dim 0.
  ZeRO-3: `_padding_size` pads numel to a multiple of the world and `partition_size =
  aligned_size // num_partitions` (deepspeed/runtime/zero/partition_parameters.py).
- `zero12`: DeepSpeed ZeRO stage 1/2 flattens a parameter group with
  `flatten_dense_tensors_aligned(..., nccl_start_alignment_factor * dp_world_size)` and
  splits it evenly (deepspeed/runtime/zero/stage_1_and_2.py): the buffer is padded to a
  multiple of 2 * world, every partition has padded / world elements.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from functools import lru_cache

from ..spec.errors import PlanError
from .stages import chunk_size as torch_chunk  # one piece of torch.chunk

STYLES = ("even", "fsdp1", "fsdp2", "zero3", "zero12")
CHUNK_STYLES = ("fsdp1", "fsdp2", "zero3")

# DeepSpeed stage 1/2: "align nccl all-gather send buffers to 4-byte boundary";
# 4 bytes / sizeof(fp16) = 2 elements (stage_1_and_2.py, nccl_start_alignment_factor).
NCCL_START_ALIGNMENT_FACTOR = 2

ASSIGNMENTS = ("contiguous", "round-robin", "zero-optimizer")


@dataclass(frozen=True)
class Shard:
    """What one rank holds of a tensor: real elements [start, end) plus `padding` more."""

    rank: int
    start: int
    end: int
    padding: int

    @property
    def numel(self) -> int:
        return self.end - self.start

    @property
    def stored(self) -> int:
        """Elements the rank allocates: real data plus padding."""
        return self.end - self.start + self.padding


def _check(numel: int, world: int, style: str) -> None:
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise PlanError(f"numel must be a non-negative integer (got {numel!r})")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise PlanError(f"world must be a positive integer (got {world!r})")
    if style not in STYLES:
        raise PlanError(f"unknown style {style!r} (styles: {', '.join(STYLES)})")


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def chunk_size(numel: int, world: int, style: str) -> int:
    """Elements every rank stores (real + padding); for `even` the largest share."""
    _check(numel, world, style)
    if style == "zero12":
        alignment = NCCL_START_ALIGNMENT_FACTOR * world
        return ceil_div(numel, alignment) * alignment // world
    return ceil_div(numel, world)


def padded_numel(numel: int, world: int, style: str) -> int:
    """Elements stored over all ranks: numel plus every rank's padding."""
    if style == "even":
        _check(numel, world, style)
        return numel
    return chunk_size(numel, world, style) * world


def shard_ranges(numel: int, world: int, style: str) -> list[Shard]:
    """The shard of every rank, rank order. O(world)."""
    chunk = chunk_size(numel, world, style)
    if style == "even":
        base, extra = divmod(numel, world)
        shards, start = [], 0
        for rank in range(world):
            end = start + base + (1 if rank < extra else 0)
            shards.append(Shard(rank, start, end, 0))
            start = end
        return shards
    shards = []
    for rank in range(world):
        start = min(rank * chunk, numel)
        end = min(start + chunk, numel)
        shards.append(Shard(rank, start, end, chunk - (end - start)))
    return shards


def chunk_rows(size: int, parts: int) -> list[int]:
    """torch.chunk along one dimension, padded with empty pieces to `parts` pieces: the
    length each piece gets (FSDP2's `_chunk_with_empty`, DTensor's Shard(dim))."""
    if parts < 1:
        raise PlanError(f"cannot split into {parts} pieces")
    return [torch_chunk(size, parts, k) for k in range(parts)]


# -- ownership of whole blocks (optimizer-state sharding by block) -----------------------
def zero_optimizer_partition(numels: list[int], world: int) -> list[int]:
    """The rank torch's ZeroRedundancyOptimizer gives each parameter (in module order):
    parameters sorted by size, largest first (a stable sort), each to the rank holding the
    fewest elements so far, the lowest such rank on ties
    (torch/distributed/optim/zero_redundancy_optimizer.py, `_partition_parameters`)."""
    return list(_zero_partition(tuple(numels), world))


@lru_cache(maxsize=1024)
def _zero_partition(numels: tuple[int, ...], world: int) -> tuple[int, ...]:
    loads = [(0, rank) for rank in range(world)]  # a heap: the least loaded, lowest rank first
    owners = [0] * len(numels)
    for position in sorted(range(len(numels)), key=lambda i: -numels[i]):
        size, rank = heapq.heappop(loads)
        owners[position] = rank
        heapq.heappush(loads, (size + numels[position], rank))
    return tuple(owners)


def assign_blocks(num_blocks: int, world: int, assign: str, sizes: list[int] | None = None) -> list[int]:
    """Owner rank of each block. `contiguous`: runs as even as possible, the first
    num_blocks % world ranks one block more; `round-robin`: block i -> rank i mod world;
    `zero-optimizer`: torch's ZeroRedundancyOptimizer over the blocks' `sizes`
    (`zero_optimizer_partition`; equal blocks, the default, go round-robin)."""
    if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 0:
        raise PlanError(f"the number of blocks must be a non-negative integer (got {num_blocks!r})")
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise PlanError(f"world must be a positive integer (got {world!r})")
    if assign == "round-robin":
        return [block % world for block in range(num_blocks)]
    if assign == "contiguous":
        return [s.rank for s in shard_ranges(num_blocks, world, "even") for _ in range(s.numel)]
    if assign == "zero-optimizer":
        return zero_optimizer_partition(sizes or [1] * num_blocks, world)
    raise PlanError(f"unknown assignment {assign!r} (one of {', '.join(ASSIGNMENTS)})")


@dataclass(frozen=True)
class RankShare:
    """What one rank owns under a block assignment."""

    rank: int
    num_blocks: int
    weight: int  # sum of the owned blocks' sizes (bytes, or blocks when sizes are equal)
    fraction: float  # weight / total weight (0 when there is nothing)


def ownership(owners: list[int], sizes: list[int], world: int) -> list[RankShare]:
    """Per rank: blocks owned and their share of the total size (bytes-weighted)."""
    counts, weights = [0] * world, [0] * world
    for owner, size in zip(owners, sizes):
        counts[owner] += 1
        weights[owner] += size
    total = sum(weights)
    return [
        RankShare(rank, counts[rank], weights[rank], weights[rank] / total if total else 0.0)
        for rank in range(world)
    ]
