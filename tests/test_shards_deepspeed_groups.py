"""`shards` of a DeepSpeed ZeRO-1/2 job: one flat buffer per optimizer parameter group, each
padded on its own, checked against the rule of DeepSpeed 0.19.8's
deepspeed/runtime/zero/stage_1_and_2.py, restated here so that DeepSpeed need not be installed:

- line 387: `nccl_start_alignment_factor = 2`;
- line 423: `for i, param_group in enumerate(self.optimizer.param_groups)`: every group is
  flattened into a buffer of its own (`bit16_groups_flat[i]`);
- lines 440-446: `orig_group_numel = sum(param.numel() ...)`, `alignment =
  nccl_start_alignment_factor * world_size`, `aligned_numel = ceil((orig_group_numel +
  max_param_padding) / alignment) * alignment`, with `max_param_padding` 0 under the default
  `parameter_alignment = False` (line 444; zero/config.py line 317);
- line 586: `partition_size = len(bit16_groups_flat[i]) // world_size`, this rank's
  `single_partition_of_fp32_groups[i]` (line 577), rank r's part starting at r * partition_size
  (`get_data_parallel_partitions`, lines 2559-2577, an even split of the padded buffer).

The groups are the ones shardplan's accounting and `run` use (core/deepspeed.py
`weight_decay_groups`; tests/dist/deepspeed_zero.py builds the same for real DeepSpeed):
matrices in module order, then vectors (biases, norms) in module order.
"""

from __future__ import annotations

from math import prod

import pytest

from conftest import run_cli
from shardplan.core.deepspeed import flat_groups
from shardplan.core.shards_model import model_shards, placed_params
from shardplan.core.stages import rank_params
from shardplan.spec.model import resolve_shape

NCCL_START_ALIGNMENT_FACTOR = 2  # stage_1_and_2.py line 387

# Odd sizes: h 99, 3 heads, vocab 101, 33 positions, tied head (tests/test_deepspeed_real.py's
# ODD at fewer layers). At 3 layers the matrices are 366,102 elements (2 mod 4, 0 mod 6) and the
# vectors 4,059 (3 mod 4, 3 mod 6): padded at dp 2 (to 366,104 and 4,060) and at dp 3 (the
# vectors, to 4,062). At 2 layers, 248,490 and 2,772: padded at dp 2 only.
ODD = {"family": "gpt2", "hidden_size": 99, "num_heads": 3, "vocab_size": 101, "max_seq_len": 33}


def _shape(num_layers: int):
    shape, problems = resolve_shape({**ODD, "num_layers": num_layers})
    assert not problems, problems
    return shape


def _deepspeed_groups(placed) -> list[list[int]]:
    """The numels of each optimizer group's parameters, as the job's optimizer groups them:
    matrices, then vectors, each in module order; empty groups dropped."""
    numels = [(len(p.local_shape) >= 2, prod(p.local_shape)) for p in placed]
    groups = [[n for matrix, n in numels if matrix], [n for matrix, n in numels if not matrix]]
    return [g for g in groups if g]


def _aligned_numel(group_numel: int, dp: int) -> int:
    """stage_1_and_2.py lines 441-446 (max_param_padding 0: parameter_alignment off)."""
    alignment = NCCL_START_ALIGNMENT_FACTOR * dp
    return -(-group_numel // alignment) * alignment


@pytest.mark.parametrize("num_layers", [2, 3])
@pytest.mark.parametrize("dp", [2, 3])
def test_each_group_padded_to_twice_dp_and_partitioned(num_layers, dp):
    shape = _shape(num_layers)
    placed = placed_params(shape)
    plan = model_shards(placed, dp, "zero12", element_bytes=2)
    groups = _deepspeed_groups(placed)
    assert len(groups) == 2 and [b.group for b in plan.buffers] == [0, 1]
    partitions = []
    for buffer, numels in zip(plan.buffers, groups):
        numel = sum(numels)
        aligned = _aligned_numel(numel, dp)
        partition = aligned // dp  # line 586
        partitions.append(partition)
        assert (buffer.numel, buffer.num_params) == (numel, len(numels))
        assert sum(s.stored for s in buffer.shards) == aligned
        assert sum(s.padding for s in buffer.shards) == aligned - numel < NCCL_START_ALIGNMENT_FACTOR * dp
        for rank, shard in enumerate(buffer.shards):
            # get_data_parallel_partitions: rank r's part is [r * partition, (r + 1) * partition)
            # of the padded buffer; what lies past the group's real elements is padding.
            start = min(rank * partition, numel)
            end = min((rank + 1) * partition, numel)
            assert (shard.rank, shard.start, shard.end, shard.stored) == (rank, start, end, partition)
    for total in plan.totals:  # single_partition_of_fp32_groups, summed over the groups
        assert total.numel + total.padding == sum(partitions)
        assert total.stored_bytes == 2 * sum(partitions)
    # The same groups, padding and partitions as the estimate's DeepSpeed accounting.
    rp = rank_params(shape, 1, 1, 0, 1, 0)
    ours = [(sum(s.stored for s in b.shards), b.numel) for b in plan.buffers]
    assert ours == [(g.padded, g.numel) for g in flat_groups(rp, dp, 0)]
    assert partitions == [g.partition for g in flat_groups(rp, dp, 0)]


def test_the_odd_model_is_padded_at_both_dp():
    """The cases above are not vacuous: at 3 layers a group needs padding at dp 2 and at dp 3."""
    for dp in (2, 3):
        remainders = [sum(numels) % (NCCL_START_ALIGNMENT_FACTOR * dp)
                      for numels in _deepspeed_groups(placed_params(_shape(3)))]
        assert any(remainders), dp


@pytest.mark.parametrize("dp", [2, 3])
def test_cli_lists_one_padded_buffer_per_group(write, dp):
    """`shards --json` of a deepspeed ZeRO-2 job: `flat_buffers` per group with its
    `padded_numel`; each parameter names its buffer (`unit`) and group; per-rank totals."""
    job = write("job.toml", "[model]\nname = \"odd\"\nfamily = \"gpt2\"\nnum_layers = 3\nhidden_size = 99\n"
                "num_heads = 3\nvocab_size = 101\nmax_seq_len = 33\n"
                f"[parallel]\ndp = {dp}\n[zero]\nstage = 2\nframework = \"deepspeed\"\n"
                "[train]\nprecision = \"bf16-mixed\"\n")
    result = run_cli("shards", job, "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert doc["style"] == "zero12" and doc["world"] == dp
    groups = _deepspeed_groups(placed_params(_shape(3)))
    expected = [_aligned_numel(sum(numels), dp) for numels in groups]
    assert expected == {2: [366_104, 4_060], 3: [366_102, 4_062]}[dp]  # lines 441-446 by hand
    assert [b["padded_numel"] for b in doc["flat_buffers"]] == expected
    assert [(b["name"], b["group"], b["numel"]) for b in doc["flat_buffers"]] == [
        ("flat.group0", 0, sum(groups[0])), ("flat.group1", 1, sum(groups[1])),
    ]
    for p in doc["params"]:
        assert p["group"] == (0 if len(p["local_shape"]) >= 2 else 1)
        assert p["unit"] == f"flat.group{p['group']}"
    assert [r["numel"] + r["padding"] for r in doc["ranks"]] == [sum(expected) // dp] * dp
    text = run_cli("shards", job).out
    assert "flat buffer flat.group0" in text and "(optimizer group 1: vectors, no weight decay)" in text
