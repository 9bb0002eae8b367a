"""The `deepspeed` accounting against DeepSpeed 0.19.8's own code (deepspeed/runtime/zero/
stage_1_and_2.py and stage3.py, the release the `interop` extra installs): when gradients are
held whole, when two accumulation buffers coexist, and how stage 3 offload allocates its host
buffers. Each expected figure is derived from the cited lines and llama-3-8b's tensors
(transformers LlamaConfig: 32 layers, hidden 4,096, 8 KV heads of 128, MLP 14,336, vocabulary
128,256, untied embedding and head)."""

from __future__ import annotations

import pytest

from conftest import run_cli

NUMEL = 8_030_261_248  # llama-3-8b (transformers' parameter count)
DP = 8


def _estimate(*flags: str) -> dict:
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--dp", str(DP), "--framework", "deepspeed",
                     "--set", "train.precision=bf16-mixed", "--json", "--explain", *flags)
    assert result.code in (0, 1), result.err
    return result.json


def _labels(doc: dict, kind: str) -> dict[str, int]:
    return {t["label"]: t["bytes"] for t in doc["devices"][0]["terms"][kind]}


FULL = "gradients of every parameter (stage 1: reduced at the boundary)"


@pytest.mark.parametrize("flags, whole", [
    # process_gradients (line 2290) reduces during backward only under partition_gradients
    # (stage 2) or overlap_comm; reduce_ready_partitions_and_remove_grads (line 2294) then only
    # at the accumulation boundary. Stage 1's default is overlap_comm false (zero/config.py).
    ((), True),
    (("--set", "zero.overlap_comm=true"), False),
    (("--set", "zero.overlap_comm=true", "--set", "parallel.num_microbatches=4"), True),
    # ZeRO-Offload copies gradients to the host only as it reduces them (copy_grads_in_partition,
    # lines 2164-2176): at stage 1 that is at the boundary, so the GPU holds them all until then.
    (("--set", "offload.optimizer=true"), True),
    (("--set", "offload.optimizer=true", "--set", "zero.overlap_comm=true"), False),
])
def test_stage_1_holds_every_gradient_until_it_reduces(flags, whole):
    doc = _estimate("--zero", "1", *flags)
    grads = _labels(doc, "gpu.grads")
    assert (grads.get(FULL) == 2 * NUMEL) is whole, grads
    if whole:
        assert doc["devices"][0]["moments"]["loss"] >= 2 * NUMEL + 2 * NUMEL  # parameters and gradients


def test_stage_2_accumulation_keeps_two_gradient_buffers_in_backward():
    """The epilogue keeps the accumulated gradients (`all_grad_tensors`, views of
    grads_in_partition, lines 1036-1045) and drops its own reference (line 930); the next
    backward allocates another grads_in_partition (line 2192): backward holds both."""
    one = _estimate("--zero", "2")
    four = _estimate("--zero", "2", "--set", "parallel.num_microbatches=4")
    in_partition = _labels(one, "gpu.grads")["gradients overlapping the partition (grads_in_partition)"]
    # Rank 0's part of the matrices' flat buffer starts with the embedding (525,336,576
    # elements), which overlaps it whole, and ends inside layer 3.
    assert in_partition % 2 == 0 and in_partition > 2 * NUMEL // DP
    backward_one = one["devices"][0]["moments"]["backward"]
    backward_four = four["devices"][0]["moments"]["backward"]
    allowance = one["assumptions"]["fragmentation_allowance"]  # each moment carries it (docs/estimate.md)
    assert backward_four - backward_one == pytest.approx(in_partition * (1 + allowance), abs=1)
    assert four["devices"][0]["moments"]["loss"] == one["devices"][0]["moments"]["loss"]  # one buffer then


def test_stage_3_offload_host_buffers_follow_stage3():
    """Stage 3 with offload_optimizer: the fp32 master is a plain clone on the host
    (`converted.clone().detach()`, stage3.py lines 1157-1160), the fp32 gradient buffer of each
    sub-group is pinned (lines 1337-1340), and sub-groups are cut per optimizer parameter group
    at tensor boundaries once they reach sub_group_size = 1e9 (`_create_fp16_sub_groups`, lines
    1209-1232). With offload_param the 16-bit partitions live in one pinned buffer per parameter
    group, pinned whatever pin_memory says (lines 839-862)."""
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory, pinned_bytes
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    rp = rank_params(load_job(None, [("model.preset", "llama-3-8b")], env={}).shape, 1, 1, 0, 1, 0)
    memory = deepspeed_memory(rp, DeepSpeedPlan(stage=3, degree=DP, index=0, precision="bf16-mixed",
                                                optimizer="adamw", offload_optimizer=True, offload_params=True,
                                                pin=False))
    host = {}
    for term in memory.host:
        host.setdefault(term.label, []).append(term.bytes)
    # Matrices: every linear and the two embeddings; vectors: the 65 RMSNorm weights.
    vectors = 65 * (4096 // DP)
    matrices = NUMEL // DP - vectors
    assert matrices > 1_000_000_000  # more than one sub-group's worth, so it is cut
    assert host["fp32 master partition"] == [4 * NUMEL // DP]  # unpinned: exact bytes
    # The matrices' group closes its first sub-group only at its last tensor (the head):
    # before it, 32 layers and the embedding hold 1,003,749,376 - 65,667,072 < 1e9.
    assert host["fp32 gradient sub-group"] == [4 * matrices, 4 * vectors]  # pin=False: exact
    assert host["16-bit parameter partitions (pinned)"] == [pinned_bytes(2 * matrices), pinned_bytes(2 * vectors)]


@pytest.mark.parametrize("preset", ["llama-3-8b", "gpt2", "mixtral-8x7b"])
@pytest.mark.parametrize("dp", [2, 3, 8, 64])
def test_the_fullest_zero12_rank_is_the_one_with_most_gradients(preset, dp):
    """grads_in_partition holds the full numel of every parameter overlapping a rank's part
    (stage_1_and_2.py lines 2185-2194): the rank whose part cuts into a large tensor holds
    more than rank 0 (measured with DeepSpeed itself in tests/test_deepspeed_real.py). The
    one-pass `fullest_flat_index` finds the same rank as trying every rank."""
    from shardplan.core.deepspeed import flat_groups, fullest_flat_index
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    rp = rank_params(load_job(None, [("model.preset", preset)], env={}).shape, 1, 1, 0, 1, 0)
    held = [sum(g.in_partition for g in flat_groups(rp, dp, index)) for index in range(dp)]
    assert fullest_flat_index(rp, dp) == held.index(max(held))
