"""The planner's numeric path (`core.memory.plan_figures`) equals the explained estimate.

`plan_figures` adds up the same cached parts as `estimate_memory` without building terms, and
looks only at the stages that can be the largest under monotone schedules; both shortcuts are
held here against the whole computation, over random plans.
"""

from __future__ import annotations

from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.lora import LoraPlan
from shardplan.core.memory import estimate_memory, plan_figures
from shardplan.core.pipeline import split_problem
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
