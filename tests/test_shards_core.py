"""Shard ranges and block ownership: exhaustive over small sizes, hypothesis beyond, and the
frameworks' own partitioning code transcribed as references.

References (each transcribed below with its source, not derived from shardplan's code):
- DeepSpeed ZeRO-1/2, deepspeedai/DeepSpeed deepspeed/runtime/zero/stage_1_and_2.py:
  `flatten_dense_tensors_aligned(tensors, nccl_start_alignment_factor * dp_world_size)` with
  `self.nccl_start_alignment_factor = 2  # 4-byte alignment/sizeof(fp16) = 2`, then
  `get_data_parallel_partitions` (base = total // dp, the first total % dp one more), and
  deepspeed/runtime/utils.py `align_dense_tensors` (pad the total to a multiple of alignment).
- DeepSpeed ZeRO-3, deepspeed/runtime/zero/partition_parameters.py: `_padding_size` =
  (world - numel % world) if numel % world else 0; partition_size = aligned_size // world;
  rank r holds [r * partition_size, (r + 1) * partition_size) of the padded tensor.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.core.shards import (
    CHUNK_STYLES, STYLES, assign_blocks, chunk_rows, chunk_size, ownership, padded_numel, shard_ranges,
)
from shardplan.spec.errors import PlanError


def deepspeed_zero12(numel: int, world: int) -> list[tuple[int, int]]:
    """(real elements, padding) per rank, following stage_1_and_2.py step by step."""
    alignment = 2 * world  # nccl_start_alignment_factor * dist.get_world_size(group)
    remaining = numel % alignment
    total = numel + (alignment - remaining if remaining else 0)  # align_dense_tensors
    base, extra = total // world, total % world  # get_data_parallel_partitions
    out, left = [], 0
    for rank in range(world):
        size = base + (1 if rank < extra else 0)
        real = max(0, min(numel, left + size) - left)
        out.append((real, size - real))  # groups_padding: the part past the real elements
        left += size
    return out


def deepspeed_zero3(numel: int, world: int) -> list[tuple[int, int]]:
    remainder = numel % world
    aligned = numel + ((world - remainder) if remainder else 0)  # _aligned_size
    partition = aligned // world
    out = []
    for rank in range(world):
        start = rank * partition
        real = max(0, min(numel, start + partition) - start)
        out.append((real, partition - real))
    return out


def check_shards(numel: int, world: int, style: str) -> None:
    shards = shard_ranges(numel, world, style)
    assert [s.rank for s in shards] == list(range(world))
    position = 0
    for shard in shards:
        assert shard.padding >= 0 and shard.start <= shard.end
        if shard.numel == 0:
            assert shard.start == shard.end == numel or (shard.start == position and style == "even")
        else:
            assert shard.start == position  # disjoint, in rank order, no gaps
        position = max(position, shard.end)
    assert position == numel  # together they cover [0, numel)
    stored = [s.stored for s in shards]
    assert sum(stored) == padded_numel(numel, world, style)
    if style == "even":
        assert all(s.padding == 0 for s in shards)
        assert [s.numel for s in shards] == sorted((s.numel for s in shards), reverse=True)
        assert max(stored) - min(stored) <= 1
    else:
        assert len(set(stored)) == 1 and stored[0] == chunk_size(numel, world, style)  # equal shards
    if style in CHUNK_STYLES:
        assert [(s.numel, s.padding) for s in shards] == deepspeed_zero3(numel, world)
    if style == "zero12":
        assert [(s.numel, s.padding) for s in shards] == deepspeed_zero12(numel, world)


def test_exhaustive_small():
    for style in STYLES:
        for world in range(1, 33):
            for numel in range(0, 70):
                check_shards(numel, world, style)


@settings(max_examples=200, deadline=None)
@given(
    numel=st.integers(0, 10**13),
    world=st.integers(1, 4096),
    style=st.sampled_from(STYLES),
)
def test_large(numel, world, style):
    check_shards(numel, world, style)


def test_contract_examples():
    """CONTRACT: even gives the first numel % world ranks one more; fsdp chunks are
    ceil(numel / world) with trailing padding; zero12 pads to a multiple of 2 * world."""
    assert [(s.start, s.end, s.padding) for s in shard_ranges(10, 4, "even")] == [(0, 3, 0), (3, 6, 0), (6, 8, 0), (8, 10, 0)]
    assert [(s.start, s.end, s.padding) for s in shard_ranges(10, 4, "fsdp2")] == [(0, 3, 0), (3, 6, 0), (6, 9, 0), (9, 10, 2)]
    # torch.chunk semantics: 4 elements over 3 ranks -> chunks of 2, the last rank empty.
    assert [(s.start, s.end, s.padding) for s in shard_ranges(4, 3, "fsdp1")] == [(0, 2, 0), (2, 4, 0), (4, 4, 2)]
    assert [(s.start, s.end, s.padding) for s in shard_ranges(10, 4, "zero12")] == [(0, 4, 0), (4, 8, 0), (8, 10, 2), (10, 10, 4)]
    assert padded_numel(10, 4, "zero12") == 16 and padded_numel(16, 4, "zero12") == 16


def test_chunk_rows_is_torch_chunk():
    """torch.chunk: pieces of ceil(size / parts), the last ones smaller or missing."""
    assert chunk_rows(10, 4) == [3, 3, 3, 1]
    assert chunk_rows(4, 3) == [2, 2, 0]
    assert chunk_rows(2, 3) == [1, 1, 0]
    assert chunk_rows(5, 4) == [2, 2, 1, 0]
    for size in range(0, 40):
        for parts in range(1, 12):
            pieces = chunk_rows(size, parts)
            assert sum(pieces) == size and len(pieces) == parts


@pytest.mark.parametrize("numel, world, style, message", [
    (-1, 4, "even", "numel must be a non-negative integer"),
    (10, 0, "even", "world must be a positive integer"),
    (10, 4, "fsdp3", "unknown style 'fsdp3'"),
])
def test_bad_input(numel, world, style, message):
    with pytest.raises(PlanError, match=message):
        shard_ranges(numel, world, style)


def test_blocks_contiguous_and_round_robin():
    assert assign_blocks(10, 4, "contiguous") == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert assign_blocks(10, 4, "round-robin") == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1]
    assert assign_blocks(2, 4, "contiguous") == [0, 1]
    with pytest.raises(PlanError, match="unknown assignment 'random'"):
        assign_blocks(3, 2, "random")


@settings(max_examples=100, deadline=None)
@given(num_blocks=st.integers(0, 5000), world=st.integers(1, 300), assign=st.sampled_from(["contiguous", "round-robin"]))
def test_blocks_properties(num_blocks, world, assign):
    owners = assign_blocks(num_blocks, world, assign)
    assert len(owners) == num_blocks and all(0 <= o < world for o in owners)
    counts = [owners.count(r) for r in range(world)]
    assert max(counts, default=0) - min(counts, default=0) <= 1
    assert counts == sorted(counts, reverse=True)  # the first num_blocks % world ranks get one more
    if assign == "contiguous":
        assert owners == sorted(owners)
    else:
        assert owners == [i % world for i in range(num_blocks)]
    shares = ownership(owners, [1] * num_blocks, world)
    assert [s.num_blocks for s in shares] == counts
    if num_blocks:
        assert abs(sum(s.fraction for s in shares) - 1) < 1e-9


def test_ownership_is_bytes_weighted():
    shares = ownership([0, 1, 0], [100, 50, 50], 2)
    assert [(s.num_blocks, s.weight, s.fraction) for s in shares] == [(2, 150, 0.75), (1, 50, 0.25)]
