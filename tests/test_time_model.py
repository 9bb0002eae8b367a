"""Properties of the whole step: more of any hardware resource never slows a plan down, the
breakdown adds up, and the narrow function equals what `estimate` prints."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.memory import estimate_memory
from shardplan.core.step_time import step_time
from shardplan.core.time_plan import LoraShape
from shardplan.io.hardware import hardware_of
from shardplan.io.job import load_job
from conftest import run_cli

SHAPE = load_job(None, [("model.preset", "llama-3-8b")], env={}).shape
H100 = hardware_of(load_job(None, [("cluster.gpu", "h100-sxm")], env={}).job.cluster)
# The simulated pipeline rounds its costs to 1/1024 of the largest action (pipeline_time.py):
# a makespan may move by that much either way.
ROUNDING = 2e-3

plans = st.builds(
    lambda tp, pp, dp, cp, stage, recompute, schedule, micro, extra, sp, offload: EstimateInputs(
        shape=SHAPE, params=None, degrees=Degrees(dp=dp, tp=tp, pp=pp, cp=cp), zero_stage=stage,
        seq_len=4096, micro_batch=micro, num_microbatches=pp * extra,
        schedule=schedule if pp > 1 else "1f1b", recompute=recompute, sequence_parallel=sp,
        offload_optimizer=offload, gpus_per_node=8,
    ),
    tp=st.sampled_from([1, 2, 4, 8]), pp=st.sampled_from([1, 2, 4]), dp=st.sampled_from([1, 2, 4, 16]),
    cp=st.sampled_from([1, 2]), stage=st.sampled_from([0, 1, 2, 3]),
    recompute=st.sampled_from(["none", "selective", "op", "full"]),
    schedule=st.sampled_from(["1f1b", "gpipe", "zero-bubble"]), micro=st.sampled_from([1, 2]),
    extra=st.sampled_from([1, 2, 4]), sp=st.booleans(), offload=st.booleans(),
)
FIGURES = ["peak_flops", "memory_bandwidth", "intra_node_bandwidth", "inter_node_bandwidth", "host_bandwidth",
           "host_memory_bandwidth", "matmul_efficiency", "memory_efficiency", "intra_node_efficiency",
           "inter_node_efficiency"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans, figure=st.sampled_from(FIGURES), factor=st.sampled_from([1.1, 1.5, 4.0]))
def test_more_hardware_is_never_slower(plan, figure, factor):
    faster = getattr(H100, figure) * factor
    if figure.endswith("efficiency"):
        faster = min(1.0, faster)
    better = dataclasses.replace(H100, **{figure: faster})
    assert step_time(plan, better).step_seconds <= step_time(plan, H100).step_seconds * (1 + ROUNDING)


def test_a_faster_gpu_never_slows_a_split_backward():
    """A zero-bubble step whose backward gathers ZeRO-3 parameters: on a GPU 4x faster, the
    backward action's exposed gather grows while its weight part shrinks. Charged against a
    window that held the weight part too, the exposure landed on the pipeline's dependency
    chain and the step ran 0.6% slower on the faster GPU; the window is now the backward
    action's own compute (core/stage_time.py `stage_cost`)."""
    plan = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=1, tp=8, pp=2, cp=2), zero_stage=3,
                          seq_len=4096, micro_batch=1, num_microbatches=2, schedule="zero-bubble", gpus_per_node=8)
    better = dataclasses.replace(H100, peak_flops=H100.peak_flops * 4)
    assert step_time(plan, better).step_seconds <= step_time(plan, H100).step_seconds


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=plans)
def test_breakdown_adds_up(plan):
    timing = step_time(plan, H100)
    assert sum(timing.breakdown.values()) == pytest.approx(timing.step_seconds, rel=1e-9)
    assert all(seconds >= 0 for seconds in timing.breakdown.values())
    assert timing.tokens_per_second == pytest.approx(timing.tokens_per_step / timing.step_seconds)
    assert timing.tokens_per_second_per_gpu * plan.degrees.world == pytest.approx(timing.tokens_per_second)
    assert 0 < timing.mfu <= timing.hfu < 1
    if plan.recompute == "none":
        assert timing.hfu == pytest.approx(timing.mfu)
    assert timing.bottleneck in {"compute", *timing.breakdown}


def test_recompute_costs_time():
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=8), zero_stage=3, seq_len=4096)
    seconds = {mode: step_time(base.with_(recompute=mode), H100).step_seconds for mode in ("none", "selective", "op", "full")}
    assert seconds["none"] < seconds["selective"] < seconds["op"] < seconds["full"]


def test_offloading_the_optimizer_costs_time():
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=8), zero_stage=3, seq_len=4096,
                          framework="deepspeed")
    on_gpu, on_cpu = step_time(base, H100), step_time(base.with_(offload_optimizer=True), H100)
    assert on_cpu.step_seconds > on_gpu.step_seconds
    assert on_cpu.breakdown["offload"] > 0 and on_cpu.breakdown["optimizer"] == 0

    # Parameters kept on the host come in for every microbatch's forward and backward: the
    # offload time grows with the microbatches, more than the gradients' copies alone make it.
    short = base.with_(seq_len=256, offload_optimizer=True)

    def growth(params: bool) -> float:
        plan = short.with_(offload_params=params, resident_layers=0 if params else None)
        per_step = [step_time(plan.with_(num_microbatches=m), H100).breakdown["offload"] for m in (1, 8)]
        return per_step[1] - per_step[0]

    assert growth(True) > growth(False) >= 0


def test_tensor_parallel_across_nodes_is_slower():
    # The same plan with tp spanning two nodes (gpus_per_node 4) pays the network for every layer.
    inside = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(tp=8), seq_len=4096)
    across = inside.with_(gpus_per_node=4)
    assert step_time(across, H100).breakdown["tensor_parallel"] > 5 * step_time(inside, H100).breakdown["tensor_parallel"]


def test_lora_trains_faster_than_full_fine_tuning():
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=8), zero_stage=3, seq_len=4096)
    lora = LoraShape(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj"))
    full, adapted = step_time(base, H100), step_time(base, H100, lora=lora)
    assert adapted.step_seconds < full.step_seconds
    assert adapted.breakdown["optimizer"] < full.breakdown["optimizer"] / 100


def test_the_narrow_function_is_what_estimate_reports():
    job = load_job("llama-2-70b-3d", env={})
    from shardplan.cli.estimate_cmd import limits_known
    from shardplan.core.estimate_inputs import inputs_from_job

    decided = estimate_memory(inputs_from_job(job.job, job.shape, limits_known(job))).inputs
    direct = step_time(decided, hardware_of(job.job.cluster))
    reported = run_cli("estimate", "llama-2-70b-3d", "--json").json["time"]
    assert reported["step_seconds"] == direct.step_seconds
    assert reported["breakdown"] == direct.breakdown
    assert reported["mfu"] == direct.mfu


def test_hardware_refuses_nonsense():
    with pytest.raises(ValueError, match="memory_bandwidth"):
        dataclasses.replace(H100, memory_bandwidth=-1.0)
    with pytest.raises(ValueError, match="at most 1"):
        dataclasses.replace(H100, matmul_efficiency=1.5)


def test_run_reports_the_same_mfu_as_estimate():
    # `shardplan run` measures tokens/s; at the predicted rate its MFU is the estimate's.
    pytest.importorskip("torch")
    from types import SimpleNamespace

    from shardplan.runtime.train import mfu

    resolved = load_job("llama-2-70b-3d", env={})
    reported = run_cli("estimate", "llama-2-70b-3d", "--json").json["time"]
    runtime = SimpleNamespace(on_gpu=True, world=resolved.degrees.world, device=None)
    assert mfu(reported["tokens_per_second"], resolved, runtime) == pytest.approx(reported["mfu"], rel=1e-12)


def test_hybrid_sharding_keeps_the_gathers_inside_the_node():
    # Two nodes of 8: full sharding gathers over the network every microbatch; hybrid
    # sharding gathers over NVLink and all-reduces only the gradient shard across nodes.
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=16), zero_stage=3, seq_len=1024,
                          num_microbatches=4)
    full, hybrid = step_time(base, H100), step_time(base.with_(hybrid=True), H100)
    assert hybrid.breakdown["data_parallel"] < full.breakdown["data_parallel"]
    assert "network" in next(t.formula for t in full.explain() if t.label.startswith("data parallel"))


def _data_parallel_seconds(inputs: EstimateInputs) -> float:
    """The plan's data-parallel seconds before any overlap: per-microbatch traffic and the tail's."""
    from shardplan.core.hardware import DEFAULT_CONSTANTS
    from shardplan.core.step_time import _links
    from shardplan.core.time_plan import make_plan, sharded_traffic, stage_elements, tail, trained_elements

    plan = make_plan(inputs, H100, DEFAULT_CONSTANTS, None, _links(inputs, H100, DEFAULT_CONSTANTS))
    elements = stage_elements(plan)
    trained = trained_elements(plan, elements[0], plan.stage_layers[0])
    per_microbatch = sharded_traffic(plan, elements[0], trained, plan.stage_layers[0])
    end = tail(plan, 0, elements, 0.0)
    return inputs.num_microbatches * (per_microbatch.forward + per_microbatch.backward) + end.reduce + end.gather


def test_data_parallel_collectives_are_those_the_engine_runs():
    """What each engine reduces (16 ranks over two nodes of 8, Llama-3 8B, 4 microbatches):
    `run`'s ZeRO-0 is fully_shard on a replicate-only mesh, which all-reduces every
    microbatch's gradients (FSDP2 has no `no_sync`; runtime/train.py skips the sync only for
    DDP); DeepSpeed's stage 0 all-reduces once per step. `run`'s ZeRO-1 is DDP (an all-reduce,
    2(n-1)/n of the gradients) with torch's ZeroRedundancyOptimizer, which broadcasts each
    updated fp32 parameter from its owner (torch/distributed/optim/zero_redundancy_optimizer.py,
    `_sync_params`); DeepSpeed's reduce-scatters and all-gathers its 16-bit copies."""
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=16), seq_len=1024, num_microbatches=4,
                          gpus_per_node=8)
    fsdp2_0 = _data_parallel_seconds(base.with_(zero_stage=0))
    deepspeed_0 = _data_parallel_seconds(base.with_(zero_stage=0, framework="deepspeed"))
    # fp32 gradients under fsdp2 (MixedPrecisionPolicy reduces in fp32), 16-bit under DeepSpeed.
    assert fsdp2_0 == pytest.approx(4 * 2 * deepspeed_0, rel=1e-3)
    fsdp2_1 = _data_parallel_seconds(base.with_(zero_stage=1))
    deepspeed_1 = _data_parallel_seconds(base.with_(zero_stage=1, framework="deepspeed"))
    # fsdp2: all-reduce (2 volumes) of fp32 gradients + fp32 parameters (1 volume): 3 x 4 B;
    # DeepSpeed: reduce-scatter + all-gather of 16-bit: 2 x 2 B.
    assert fsdp2_1 == pytest.approx(3 * deepspeed_1, rel=1e-3)


def test_hybrid_sharding_reduces_across_replicas_every_microbatch():
    """FSDP2's HSDP all-reduces the gradient shard across the replicas in every microbatch's
    post-backward (after the reduce-scatter in the node), as its ZeRO-0 reduces: four
    microbatches pay four times the replicas' all-reduce of one."""
    base = EstimateInputs(shape=SHAPE, params=None, degrees=Degrees(dp=16), zero_stage=3, seq_len=1024,
                          gpus_per_node=8, num_microbatches=1)
    one = _data_parallel_seconds(base.with_(hybrid=True))
    four = _data_parallel_seconds(base.with_(hybrid=True, num_microbatches=4))
    assert four == pytest.approx(4 * one, rel=1e-9)


@pytest.mark.parametrize("gpu, link", [("h100-sxm", "NVLink"), ("rtx-4090", "PCIe"), ("l40s", "PCIe"),
                                       ("mi300x", "Infinity Fabric")])
def test_explanation_names_the_link_the_gpu_has(gpu, link):
    """The RTX 4090 and L40S have no NVLink (Ada whitepaper, Appendix A; L40S datasheet): their
    GPUs talk over PCIe, and the explanation said NVLink for every GPU."""
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--set", f"cluster.gpu={gpu}", "--dp", "2",
                     "--explain")
    hardware = next(line for line in result.out.splitlines() if line.strip().startswith("hardware:"))
    assert f", {link} " in hardware and (link == "NVLink" or "NVLink" not in result.out)
