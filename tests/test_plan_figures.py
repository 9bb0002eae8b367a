"""The planner's numeric path (`core.memory.plan_figures`) equals the explained estimate.

`plan_figures` adds up the same cached parts as `estimate_memory` without building terms, and
looks only at the stages that can be the largest under monotone schedules; both shortcuts are
held here against the whole computation, over random plans.
"""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardplan.core.degrees import Degrees
from shardplan.core.estimate import Coordinates, held_at_peak, rank_parts
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.figures import _framework_key, rank_states_bytes
from shardplan.core.lora import LoraPlan
from shardplan.core.memory import estimate_memory, plan_figures
from shardplan.core.pipeline import split_problem
from shardplan.core.schedule import SPLIT_BACKWARD, chunks_per_rank, held_peak, rank_order
from shardplan.core.schedule_sim import BACKWARD as BACKWARD_ACTION, WEIGHT
from shardplan.spec.model import resolve_shape

SHAPES = {
    "llama": resolve_shape(dict(family="llama", num_layers=12, hidden_size=512, num_heads=8, num_kv_heads=4,
                                ffn_hidden_size=1536, vocab_size=3000, max_seq_len=4096))[0],
    "gpt2": resolve_shape(dict(family="gpt2", num_layers=10, hidden_size=256, num_heads=8, vocab_size=2500,
                               max_seq_len=2048))[0],
}


@st.composite
def plans(draw):
    shape = SHAPES[draw(st.sampled_from(sorted(SHAPES)))]
    tp = draw(st.sampled_from([1, 2, 4]))
    pp = draw(st.sampled_from([1, 2, 3, 4, 5, 6]))
    dp = draw(st.sampled_from([1, 2, 3, 4]))
    schedule = draw(st.sampled_from(["1f1b", "gpipe", "zero-bubble", "interleaved-1f1b", "round-robin"]))
    virtual = draw(st.sampled_from([1, 2])) if schedule in ("interleaved-1f1b", "round-robin") else 1
    if pp * virtual > shape.num_layers:
        virtual = 1
    first = last = 0
    if pp * virtual > 2 and draw(st.booleans()):
        first, last = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    assume(split_problem(shape.num_layers, pp * virtual, first, last) is None)
    stage = draw(st.integers(0, 3))
    framework = draw(st.sampled_from(["fsdp2", "deepspeed", "zero-paper"]))
    offload_params = stage == 3 and draw(st.booleans())
    lora = None
    if draw(st.booleans()):
        targets = draw(st.sets(st.sampled_from(["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"]),
                               min_size=1))
        lora = LoraPlan(rank=draw(st.sampled_from([1, 8])), targets=tuple(sorted(targets)),
                        base_dtype=draw(st.sampled_from(["bf16", "nf4"])), dropout=draw(st.booleans()))
    return EstimateInputs(
        shape=shape, params=None, degrees=Degrees(dp=dp, tp=tp, pp=pp), order=draw(st.sampled_from(
            ["tp-cp-dp-pp", "pp-tp-dp", "dp-tp-pp"])), gpus_per_node=draw(st.sampled_from([2, 4, 8])),
        framework=framework, zero_stage=stage, precision=draw(st.sampled_from(["bf16-mixed", "fp32"])),
        seq_len=256, micro_batch=draw(st.integers(1, 3)), num_microbatches=max(pp, draw(st.integers(1, 9))) * (
            pp if schedule == "interleaved-1f1b" else 1),
        schedule=schedule, virtual=virtual, stage_split=(first, last),
        sequence_parallel=tp > 1 and draw(st.booleans()),
        recompute=draw(st.sampled_from(["none", "selective", "op", "full"])),
        attention=draw(st.sampled_from(["flash", "eager"])), dropout=draw(st.booleans()),
        loss=draw(st.sampled_from(["fp32", "fused"])),
        offload_params=offload_params, offload_optimizer=(optimizer := draw(st.booleans())),
        offload_grads=optimizer and draw(st.booleans()),
        compression=draw(st.sampled_from(["none", "bf16", "fp16", "int8"])), gpu_param_budget=2**20,
        strategy="conservative", on_gpu=draw(st.booleans()), checkpointing=draw(st.booleans()),
        gpu_memory=80 * 2**30, cpu_memory_per_node=2**40, lora=lora,
        optimizer=draw(st.sampled_from(["adamw", "adamw8bit", "sgd"])),
    )


@settings(max_examples=250, deadline=None)
@given(inputs=plans())
def test_plan_figures_equal_the_explained_estimate(inputs):
    explained = estimate_memory(inputs)
    assert plan_figures(inputs) == (explained.peak_gpu_bytes, explained.cpu_bytes_per_node)


@settings(max_examples=250, deadline=None)
@given(inputs=plans())
def test_the_states_check_adds_what_the_explained_estimate_holds(inputs):
    """The search's model-states check (`rank_states_bytes`, from the states alone under
    fsdp2 and zero-paper) is the explained estimate's GPU parameters and optimizer states."""
    for stage in {0, inputs.degrees.pp - 1}:
        parts = rank_parts(inputs, Coordinates(pp_rank=stage))
        explained = sum(t.bytes for t in parts.gpu["params"]) + sum(t.bytes for t in parts.gpu["optimizer"])
        assert rank_states_bytes(inputs, Coordinates(pp_rank=stage)) == explained


@settings(max_examples=300, deadline=None)
@given(schedule=st.sampled_from(["1f1b", "zero-bubble", "interleaved-1f1b"]), pp=st.integers(2, 5),
       virtual=st.integers(1, 3), rounds=st.integers(1, 6), data=st.data())
def test_held_microbatches_follow_the_whole_order_whatever_the_scale(schedule, pp, virtual, rounds, data):
    """`held_at_peak` walks a prefix of the rank's order, shared by byte counts of the same
    ratios; the walk of the whole order (core/schedule.py `held_peak`) with the bytes as given,
    and again scaled, holds the same microbatches at the peak."""
    virtual = virtual if schedule == "interleaved-1f1b" else 1
    microbatches = pp * rounds
    rank = data.draw(st.integers(0, pp - 1))
    stages = range(rank, pp * virtual, pp)
    stage_bytes = {s: data.draw(st.integers(1, 50)) for s in stages}
    scale = data.draw(st.integers(2, 7))
    order = rank_order(schedule, pp, microbatches, chunks_per_rank(schedule, virtual), rank)
    release = WEIGHT if schedule in SPLIT_BACKWARD else BACKWARD_ACTION
    whole = held_peak(order, stage_bytes, release)[1]
    assert held_at_peak(schedule, pp, microbatches, virtual, rank, stage_bytes) == whole
    scaled = {s: b * scale for s, b in stage_bytes.items()}
    assert held_at_peak(schedule, pp, microbatches, virtual, rank, scaled) == whole


def test_plans_that_differ_in_activations_share_one_framework_key():
    """The framework part's key is one instance for plans that differ only in what it does not
    read, so its cache finds it by identity; a difference it reads gives another."""
    base = EstimateInputs(shape=SHAPES["llama"], params=None, degrees=Degrees(dp=2, pp=2), zero_stage=3,
                          num_microbatches=4)
    same = [base.with_(micro_batch=b, num_microbatches=m, recompute=r)
            for b, m, r in ((1, 4, "none"), (2, 2, "full"), (4, 8, "selective"))]
    assert all(_framework_key(p) is _framework_key(base) for p in same)
    assert _framework_key(base.with_(num_microbatches=1)) is not _framework_key(base)
    assert _framework_key(base.with_(zero_stage=2)) is not _framework_key(base)
    assert _framework_key(base.with_(zero_stage=2)).zero_stage == 2
