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


# Llama-3 70B, ZeRO-3 over one DGX A100 80GB node (2 TiB of RAM), as DeepSpeed's ZeRO-Infinity
# offload runs it: with the optimizer offloaded the peak is still over the 80 GB.
DGX_70B = ("estimate", "--set", "model.preset=llama-3-70b", "--dp", "8", "--zero", "3", "--set",
           "cluster.preset=a100-80gb", "--framework", "deepspeed", "--json")


def test_the_strategy_offloads_every_parameter_as_deepspeed_does():
    """DeepSpeed's offload_param moves every parameter partition to the host: its config
    (DeepSpeedZeroOffloadParamConfig, deepspeed/runtime/zero/offload_config.py) has a device,
    NVMe and pinning settings and no budget of layers kept on the GPU. The balanced strategy's
    parameter step is that one step, and its plan is the plan that asks for it: the same peak,
    host bytes and step time as `offload.params` and `offload.optimizer` written in the job.
    (It searched layer counts as for fsdp2, which DeepSpeed's accounting does not read, and
    ended with "offloading layers would take more CPU memory" on a node with 0.2 TiB to spare.)"""
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadParamConfig

    assert set(DeepSpeedZeroOffloadParamConfig.model_fields) == {
        "device", "nvme_path", "buffer_count", "buffer_size", "max_in_cpu", "pin_memory"}
    decided = run_cli(*DGX_70B)
    asked = run_cli(*DGX_70B, "--set", "offload.params=true", "--set", "offload.optimizer=true")
    assert decided.code == asked.code == 0, decided.err
    doc, plan = decided.json, asked.json
    assert doc["decisions"][1].startswith("offload optimizer states")
    assert doc["decisions"][-1].startswith("offload parameters (every layer's")
    assert doc["fits"] is True and doc["peak_gpu_bytes"] <= 80 * 10**9
    assert doc["assumptions"]["offload"]["resident_layers"] == plan["assumptions"]["offload"]["resident_layers"] == [0]
    for key in ("peak_gpu_bytes", "cpu_bytes_per_node", "time"):
        assert doc[key] == plan[key], key


@pytest.mark.parametrize("ram, why", [
    ("2TiB", None),  # a 1.80 TiB budget: the parameters' 1.57 TiB fits
    ("1650GiB", "not offloading parameters: a node would need 1.57 TiB"),  # 1.45 TiB: the optimizer's 1.32 only
    ("1400GiB", "not offloading optimizer states: a node would need 1.32 TiB"),  # 1.23 TiB: neither
])
def test_parameter_offload_over_the_host_limit_is_not_taken(ram, why):
    """The one parameter step is taken only within the node's CPU limit (the budget: 90% of the
    RAM); over it the plan stays as the last step within the limit left it, and says so."""
    result = run_cli(*DGX_70B, "--set", f"cluster.cpu_memory_per_node={ram}")
    doc = result.json
    if why is None:
        assert result.code == 0 and doc["fits"] is True
        return
    assert result.code == 1 and doc["fits"] is False
    assert doc["decisions"][-1].startswith(why)
    assert doc["assumptions"]["offload"]["params"] is False


def test_a_parameter_step_back_within_the_host_limit_ends_the_strategy():
    """The strategy goes past a step over the CPU limit when a later one needs less (core/memory.py
    `decide_offload`). With figures where the optimizer step needs 150 GiB of a 100 GiB limit
    (peak 82 GiB) and the parameter step 90 GiB (peak 85 GiB), the plan ends at the parameter
    step, within the limit: its peak above the optimizer step's does not send it back to the
    plan with nothing offloaded (200 GiB)."""
    from shardplan.core.estimate_inputs import inputs_from_job
    from shardplan.core.memory import decide_offload
    from shardplan.io.job import load_job

    resolved = load_job(None, [("model.preset", "llama-3-8b"), ("parallel.dp", 8), ("zero.stage", 3),
                               ("zero.framework", "deepspeed"), ("cluster.gpu_memory", "80GiB"),
                               ("cluster.cpu_memory_per_node", "111GiB")], env={})
    inputs = inputs_from_job(resolved.job, resolved.shape, True)
    GiB = 2**30
    figures = {(False, False): (200 * GiB, 10 * GiB), (True, False): (82 * GiB, 150 * GiB),
               (True, True): (85 * GiB, 90 * GiB), (False, True): (120 * GiB, 60 * GiB)}

    def measure(plan):
        peak, host = figures[(plan.offload_optimizer, plan.offload_params)]
        return peak, host, 32, 0

    decided, decisions = decide_offload(inputs, measure)
    assert (decided.offload_optimizer, decided.offload_params) == (True, True), decisions
    assert decisions[-2].startswith("offload parameters (every layer's")
    assert decisions[-1] == "still over the threshold with every parameter offloaded"
    # Over the limit at the parameter step too: back to the last plan within it.
    figures[(True, True)] = (70 * GiB, 120 * GiB)
    decided, decisions = decide_offload(inputs, measure)
    assert (decided.offload_optimizer, decided.offload_params) == (False, False)
    assert decisions[-1].startswith("not offloading optimizer states: a node would need 150.00 GiB")


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


# llama-3-8b's tensors in module order: the embedding (525,336,576), 32 layers of attn_norm
# 4,096, q 16,777,216, k and v 4,194,304, o 16,777,216, mlp_norm 4,096, gate, up and down
# 58,720,256 (218,112,000 a layer), the final norm 4,096 and the head 525,336,576.
LAYER = 218_112_000
DOWN = 58_720_256
MATRICES_BUCKET = 2 * (LAYER - 2 * 4_096) + DOWN  # 494,927,872


@pytest.mark.parametrize("stage, dp, in_backward, expected", [
    # ZeRO-3 (stage3.py line 1583: a gradient that would pass reduce_bucket_size = 5e8 first
    # reduces the bucket): backward reduces the head alone, one tensor divisible by 8 that
    # reduce_scatter_coalesced views (coalesced_collectives.py line 102); then the final norm,
    # layers 31 and 30 and layer 29's down projection, concatenated (line 122). Later buckets
    # hold at most as much (494,944,256 and 494,948,352 again).
    (3, 8, True, 4_096 + 2 * LAYER + DOWN),
    (3, 1, True, 4_096 + 2 * LAYER + DOWN),
    # ZeRO-1/2 on one rank: every slice goes to partition 0 and merges into one (stage_1_and_2.py
    # line 1676), which flatten views.
    (2, 1, True, 0),
    (1, 1, False, 0),
    # ZeRO-2 on 8 ranks: the head, reduced alone, lies inside the last partition of the
    # matrices' flat buffer (8,029,995,008 elements, 1,003,749,376 a rank: the head starts at
    # 7,504,658,432, partition 7 at 7,026,245,632), one slice, viewed. Buckets of several
    # gradients do cross partition boundaries, which one depends on autograd's order inside a
    # layer: the largest, the same final norm + 2 layers + down projection, stands for it.
    (2, 8, True, 4_096 + 2 * LAYER + DOWN),
    # ZeRO-1 without overlap_comm reduces after backward, the matrices' group in module order
    # (stage_1_and_2.py lines 958-978): the crossing bucket is exact, a down projection and the
    # next two layers' matrices (the norms are in the other group; the next q projection would
    # pass 5e8).
    (1, 8, False, MATRICES_BUCKET),
    # No ZeRO (engine.py lines 3828-3838, in module order, a list flushed once it passes 5e8):
    # the embedding alone is viewed; every 5 layers make two lists; the last, layers 30 and 31,
    # the final norm and the head, is the largest.
    (0, 8, False, 2 * LAYER + 4_096 + 525_336_576),
])
def test_reduction_copy_follows_deepspeeds_bucketing(stage, dp, in_backward, expected):
    from shardplan.core.deepspeed import reduction_copy
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    rp = rank_params(load_job(None, [("model.preset", "llama-3-8b")], env={}).shape, 1, 1, 0, 1, 0)
    assert reduction_copy(rp, stage, dp, 500_000_000, in_backward) == expected


@pytest.mark.parametrize("stage, overlap, moment", [(2, None, "backward"), (1, True, "backward"),
                                                    (1, None, "backward end"), (3, None, "backward")])
def test_reduction_copy_lives_where_deepspeed_reduces(stage, overlap, moment):
    """Hooks reduce during backward (stage 2, stage 1 with overlap_comm, stage 3); stage 1
    without overlap_comm reduces after backward (`reduce_gradients`), its bucket still held
    until the epilogue releases it (stage_1_and_2.py line 1061)."""
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    rp = rank_params(load_job(None, [("model.preset", "llama-3-8b")], env={}).shape, 1, 1, 0, 1, 0)
    plan = DeepSpeedPlan(stage=stage, degree=DP, index=0, precision="bf16-mixed", optimizer="adamw",
                         overlap_comm=overlap)
    memory = deepspeed_memory(rp, plan)
    copies = {m: [t.bytes for t in terms if "bucket being" in t.label] for m, terms in memory.buffers_at.items()}
    assert {m: c for m, c in copies.items() if c} == {moment: [2 * (4_096 + 2 * LAYER + DOWN) if stage != 1 or overlap
                                                                else 2 * MATRICES_BUCKET]}
    if moment == "backward end":
        assert any(t.label.startswith("IPG bucket") for t in memory.buffers_at[moment])


@pytest.mark.parametrize("preset, stage, overlap, expected", [
    # llama-3-8b's untied head, 525,336,576 elements (128,256 x 4,096), whole in param.grad
    # before the hook copies it to the bucket (stage_1_and_2.py lines 1455-1461) or, larger
    # than the bucket, reduces it from there (line 1449): in `loss`.
    ("llama-3-8b", 2, None, {"loss": 525_336_576}),
    ("llama-3-8b", 3, None, {"loss": 525_336_576}),
    ("llama-3-8b", 1, True, {"loss": 525_336_576}),
    # Stage 1 without overlap_comm holds every gradient to the boundary: counted among them.
    ("llama-3-8b", 1, None, {}),
    # gpt2-xl ties its head to the embedding (50,257 x 1,600 = 80,411,200): autograd sums both
    # uses' gradients before the embedding's hook runs, at the end of backward.
    ("gpt2-xl", 3, None, {"loss": 80_411_200, "backward": 80_411_200}),
    ("gpt2-xl", 2, None, {"loss": 80_411_200, "backward": 80_411_200}),
])
def test_the_head_gradient_before_its_hook(preset, stage, overlap, expected):
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    rp = rank_params(load_job(None, [("model.preset", preset)], env={}).shape, 1, 1, 0, 1, 0)
    plan = DeepSpeedPlan(stage=stage, degree=DP, index=0, precision="bf16-mixed", optimizer="adamw",
                         overlap_comm=overlap)
    held = {m: sum(t.bytes for t in terms if "head's gradient" in t.label or t.label.startswith("tied embedding"))
            for m, terms in deepspeed_memory(rp, plan).buffers_at.items()}
    assert {m: b // 2 for m, b in held.items() if b} == expected


# -- Stage 0, bf16, pipeline parallelism: BF16_Optimizer ----------------------------------------
#
# deepspeed/runtime/engine.py lines 2313-2320 (`_do_optimizer_sanity_check`): without ZeRO, a bf16
# model whose grad_accum_dtype is the model dtype (its default, lines 1806-1807) under a
# PipelineModule steps with BF16_Optimizer (runtime/bf16_optimizer.py). llama-3-8b at pp 2, rank
# 0: the embedding (525,336,576) and 16 layers of 218,103,808 matrix and 8,192 norm elements.
# Both weight-decay groups are multiples of 2*dp at dp 4 and 8, so no padding
# (`align_dense_tensors`, runtime/utils.py lines 994-1005).
LLAMA_PP0_MATRICES = 525_336_576 + 16 * 218_103_808  # 4,014,997,504
LLAMA_PP0_VECTORS = 16 * 8_192
LLAMA_PP0 = LLAMA_PP0_MATRICES + LLAMA_PP0_VECTORS


def _llama_pp2_rank0():
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    return rank_params(load_job(None, [("model.preset", "llama-3-8b")], env={}).shape, 2, 1, 0, 1, 0)


def _stage0(rp, dp: int, precision: str = "bf16-mixed", pipeline: bool = True, accumulating: bool = True):
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory

    return deepspeed_memory(rp, DeepSpeedPlan(stage=0, degree=dp, index=0, precision=precision, optimizer="adamw",
                                              accumulating=accumulating, pipeline=pipeline))


def _by_label(terms) -> dict[str, int]:
    return {t.label: t.bytes for t in terms}


@pytest.mark.parametrize("dp, step_label, step_elements", [
    # dp 8: the partition (501,891,072) is smaller than the embedding, whose gradient the global
    # norm casts to fp32 alone (runtime/utils.py line 950, `tensor.detach().float().norm()`).
    (8, "fp32 copy of the largest gradient (the global norm's .float())", 525_336_576),
    # dp 4: the partition (1,003,782,144) cast to fp32 for the step (bf16_optimizer.py 414-418).
    (4, "fp32 gradient partition (grad_partition.to(float32))", LLAMA_PP0 // 4),
])
def test_bf16_optimizer_at_stage_0_with_pipeline_parallelism(dp, step_label, step_elements):
    rp = _llama_pp2_rank0()
    assert rp.numel == LLAMA_PP0
    memory = _stage0(rp, dp)
    partition = LLAMA_PP0 // dp
    assert _by_label(memory.gpu["params"]) == {"flat bf16 parameters (bf16_groups_flat)": 2 * LLAMA_PP0}  # 165-171
    assert _by_label(memory.gpu["optimizer"]) == {
        "fp32 master partition (fp32_groups_flat_partition)": 4 * partition,  # lines 181-183
        "Adam moments": 8 * partition,  # AdamW over the partition (line 225)
    }
    assert _by_label(memory.gpu["grads"]) == {
        "gradient accumulation buffer (fp32_groups_gradients_flat, bf16)": 2 * LLAMA_PP0,  # line 191, bf16
        "bf16 gradients of the parameters (param.grad)": 2 * LLAMA_PP0,  # freed by zero_grad (625-627)
    }
    assert _by_label(memory.buffers_at["step"]) == {step_label: 4 * step_elements}
    # The engine all-reduces [matrices, vectors]: the first passes 5e8 elements alone, a view.
    assert memory.buffers_at["backward end"] == []
    # 6 + 12 / dp bytes per element held through the step, where FP16_Optimizer holds 16.
    states = sum(t.bytes for kind in ("params", "grads", "optimizer") for t in memory.gpu[kind])
    assert states == 6 * LLAMA_PP0 + 12 * partition


def test_bf16_optimizer_gradients_by_moment():
    """The accumulation buffer exists from start (line 191, only zeroed after the step: lines
    605-610); the parameters' bf16 gradients from the first backward to the step (no hook frees
    them while immediate_grad_update is false, precision_config.py line 51; `zero_grad` sets them
    to None after the step): in forward only when microbatches accumulate."""
    rp = _llama_pp2_rank0()
    buffer = "gradient accumulation buffer (fp32_groups_gradients_flat, bf16)"
    lp = "bf16 gradients of the parameters (param.grad)"
    for accumulating in (False, True):
        grads = {m: [t.label for t in terms] for m, terms in _stage0(rp, 8, accumulating=accumulating).grads_at.items()}
        assert grads["forward"] == ([buffer, lp] if accumulating else [buffer])
        for moment in ("loss", "backward", "backward end", "step"):
            assert grads[moment] == [buffer, lp]


def test_bf16_optimizer_flattens_small_groups_to_all_reduce():
    """`allreduce_no_retain` (engine.py lines 3828-3838) closes a list once it passes 5e8
    elements; a list of two flat buffers is flattened into a new one (line 3796). ODD-sized
    models keep both groups in one list: 2 B * (matrices + vectors), each padded to 2*dp."""
    from shardplan.core.stages import rank_params
    from shardplan.spec.model import resolve_shape

    shape, problems = resolve_shape(dict(family="gpt2", num_layers=4, hidden_size=99, num_heads=3, vocab_size=101,
                                         max_seq_len=33))
    assert not problems
    rp = rank_params(shape, 2, 1, 0, 1, 0)
    memory = _stage0(rp, 2)
    # Rank 0 of 2: matrices 248,490 -> 248,492 and vectors 2,574 -> 2,576 (multiples of 4).
    assert _by_label(memory.buffers_at["backward end"]) == {
        "flattened gradient buffers being all-reduced (allreduce_bucket)": 2 * (248_492 + 2_576)}


@pytest.mark.parametrize("precision, pipeline", [("bf16-mixed", False), ("fp16-mixed", True)])
def test_fp16_optimizer_elsewhere_at_stage_0(precision, pipeline):
    """Without a PipelineModule bf16 takes DDP_BFLOAT16 (FP16_Optimizer), and fp16 always takes
    FP16_Optimizer (engine.py line 2321): whole fp32 copies."""
    memory = _stage0(_llama_pp2_rank0(), 8, precision=precision, pipeline=pipeline)
    assert _by_label(memory.gpu["optimizer"]) == {"fp32 master copy": 4 * LLAMA_PP0, "Adam moments": 8 * LLAMA_PP0}


def test_bf16_optimizer_is_not_taken_at_stage_1():
    """ZeRO-1 takes BF16_Optimizer only with grad_accum_dtype fp32 (engine.py lines 2303-2310),
    which no key of a job sets: stage 1 at pp 2 stays DeepSpeedZeroOptimizer."""
    from shardplan.core.deepspeed import DeepSpeedPlan, deepspeed_memory

    plan = DeepSpeedPlan(stage=1, degree=8, index=0, precision="bf16-mixed", optimizer="adamw", pipeline=True)
    assert not plan.bf16_optimizer
    assert "flat 16-bit parameters" in _by_label(deepspeed_memory(_llama_pp2_rank0(), plan).gpu["params"])


def test_bloom_176b_fits_as_bigscience_ran_it():
    """BLOOM-176B as BigScience trained it (tests/time_references.py `bloom_176b`: DeepSpeed's
    pipeline engine, ZeRO 0, bf16, dp 8 x tp 4 x pp 12) fits an 80 GB A100, and its estimated
    peak is at most the 60 GB per GPU BigScience reports it ran with ("using 60 GB of memory on
    each GPU", bigscience.notion.site, the BigScience-176B-Model page), a figure read from
    nvidia-smi that includes what the caching allocator keeps."""
    from shardplan.core.estimate_inputs import default_cpu_budget
    from shardplan.core.memory import estimate_memory
    from time_references import bloom_176b

    gib = 1 << 30
    estimate = estimate_memory(bloom_176b().with_(gpu_memory=80 * gib, cpu_memory_per_node=512 * gib,
                                                  cpu_memory_budget=default_cpu_budget(512 * gib)))
    assert estimate.fits
    assert estimate.peak_gpu_bytes <= 60 * 10 ** 9


@pytest.mark.parametrize("precision, elements", [
    # BF16_Optimizer: the largest fp32_groups_flat_partition (bf16_optimizer.py lines 181-183):
    # BLOOM's first stage at tp 4 holds its embedding (62,720 x 14,336 = 899,153,920) and 5 layers
    # of 12 * 14,336^2 / 4 = 616,562,688 matrix elements: 3,981,967,360, a multiple of 2 * 8, / 8.
    ("bf16-mixed", 3_981_967_360 // 8),
    # FP16_Optimizer: the matrices' whole fp32_groups_flat (runtime/fp16/fused_optimizer.py 94-103).
    ("fp16-mixed", 3_981_967_360),
])
def test_checkpoint_staging_at_stage_0_is_the_largest_fp32_group(precision, elements):
    """Writing a checkpoint stages one state tensor at a time on the host (core/host.py
    `checkpoint_staging`): at stage 0 the largest fp32 master tensor, 1/dp of a group under
    BF16_Optimizer, a whole group under FP16_Optimizer."""
    from shardplan.core.host import checkpoint_staging
    from shardplan.core.stages import rank_params
    from time_references import bloom_176b

    inputs = bloom_176b().with_(checkpointing=True, precision=precision)
    rp = rank_params(inputs.shape, 12, 1, 0, 4, 0, (5, 5))
    assert [t.bytes for t in checkpoint_staging(inputs, rp, 8)] == [4 * elements]
