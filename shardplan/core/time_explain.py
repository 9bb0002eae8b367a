"""`--explain` for the time model: every term with its formula and this plan's numbers.

Only formats: every number was computed by step_time.py and its modules; the strings are
built when the user asks for them (each TimeTerm's formula is a callable).
"""

from __future__ import annotations

from ..spec.units import counted
from .collectives import Link
from .kernels import Work
from .layer_time import LayerCosts
from .pipeline_time import PipelineRun
from .stage_time import CATEGORIES, EdgeCosts, StageCost
from .deepspeed import accumulation_dtype, steps_with_bf16_optimizer
from .time_plan import Tail, TimePlan, cpu_step_bytes


def _three_digits(value: float) -> str:
    """Three significant digits, trailing zeros kept and no exponent: `3.80`, `54.0`, `1234`."""
    if value >= 99.95:
        return f"{value:.0f}"
    if value >= 9.995:
        return f"{value:.1f}"
    return f"{value:.2f}"


def seconds_text(seconds: float) -> str:
    """`1.42 s`, `54.0 s`, `1234 s`, `12.3 ms`, `45.0 us`."""
    if seconds >= 1:
        return f"{_three_digits(seconds)} s"
    if seconds >= 1e-3:
        return f"{_three_digits(seconds * 1e3)} ms"
    return f"{_three_digits(seconds * 1e6)} us"


def _si(value: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g} {prefix}{unit}"
    return f"{value:.3g} {unit}"


def _rate(value: float) -> str:
    return _si(value, "B/s")


def _work(work: Work, plan: TimePlan) -> str:
    """How a Work's seconds came about: matmuls on the roofline (FLOPs at the peak, or bytes
    at HBM speed, whichever is longer, plus a fixed cost per kernel), streaming kernels on HBM."""
    hw = plan.hw
    memory = f"{_si(work.bytes, 'B')} at {_rate(hw.memory_bandwidth)} * {hw.memory_efficiency:g}"
    if not work.flops:
        return memory if work.bytes else "nothing"
    return (f"{_si(work.flops, 'FLOP')} at {_si(plan.peak, 'FLOP/s')} * {hw.matmul_efficiency:g} or {memory}, "
            f"the longer, per kernel, + {work.kernels} kernels * {plan.c.matmul_overhead_seconds * 1e6:g} us")


def _link(link: Link) -> str:
    return f"{link.name} at {_rate(link.bandwidth)} effective, {link.latency * 1e6:g} us per call"


def _terms(items):
    from .step_time import TimeTerm

    return [TimeTerm(*item) for item in items]


def _hardware(plan: TimePlan) -> list:
    hw = plan.hw
    text = (f"{hw.name}: {_si(plan.peak, 'FLOP/s')} peak ({plan.inputs.precision}), HBM {_rate(hw.memory_bandwidth)}, "
            f"{hw.intra_node_link} {_rate(hw.intra_node_bandwidth)} * {hw.intra_node_efficiency:g}, network "
            f"{_rate(hw.inter_node_bandwidth)} * {hw.inter_node_efficiency:g}, host {_rate(hw.host_bandwidth)}; "
            f"matmul efficiency {hw.matmul_efficiency:g}, memory efficiency {hw.memory_efficiency:g}")
    return [("hardware", 0.0, text)]


def _layer_terms(plan: TimePlan, layer: LayerCosts) -> list:
    inputs = plan.inputs
    d = inputs.degrees
    c = plan.c
    sp = ", sequence parallel" if inputs.sequence_parallel and d.tp > 1 else ""
    flash = inputs.attention == "flash"
    total = layer.forward + layer.backward + layer.recompute.seconds + layer.tp_forward + layer.tp_backward \
        + layer.tp_recompute + layer.cp_forward + layer.cp_backward
    items = [
        ("layer", total, f"one microbatch on one rank: {inputs.micro_batch} x {inputs.seq_len // d.cp} tokens, "
                         f"tp {d.tp}{sp}, {inputs.attention} attention, recompute {inputs.recompute}"),
        ("layer: forward matmuls", layer.forward_matmul.seconds, lambda: _work(layer.forward_matmul, plan)),
        (f"layer: forward attention ({inputs.attention})", layer.forward_attention.seconds,
         lambda: f"{_si(layer.forward_attention.flops, 'FLOP')} (causal half) at {_si(plan.peak, 'FLOP/s')} * "
                 f"{c.flash_forward_efficiency:g}" if flash else _work(layer.forward_attention, plan)),
        ("layer: forward elementwise kernels", layer.forward_memory.seconds, lambda: _work(layer.forward_memory, plan)),
        ("layer: backward matmuls", layer.backward_matmul.seconds,
         lambda: f"input gradients {seconds_text(layer.forward_matmul.seconds)} (as forward) + weight gradients "
                 f"{seconds_text(layer.weight_matmul.seconds)}"),
        ("layer: backward attention", layer.backward_attention.seconds,
         lambda: f"{c.flash_backward_ratio:g} x the forward FLOPs at {_si(plan.peak, 'FLOP/s')} * "
                 f"{c.flash_backward_efficiency:g}" if flash else _work(layer.backward_attention, plan)),
        ("layer: backward elementwise kernels", layer.backward_memory.seconds,
         lambda: f"{c.elementwise_backward_ratio:g} x the forward bytes: {_work(layer.backward_memory, plan)}"
         if not layer.dequant_bytes else
         f"{c.elementwise_backward_ratio:g} x the forward bytes but the NF4 dequantization, which runs once "
         f"({_si(layer.dequant_bytes, 'B')}): {_work(layer.backward_memory, plan)}"),
    ]
    if inputs.recompute != "none":
        items.append((f"layer: recompute ({inputs.recompute})", layer.recompute.seconds,
                      lambda: "the layer's forward again" if inputs.recompute == "full"
                      else "the attention core's forward again"))
    if layer.tp_count:
        each = "an all-gather and a reduce-scatter" if layer.tp_count == 4 else "an all-reduce"
        ring = "(t-1)/t" if layer.tp_count == 4 else "2(t-1)/t"
        items.append(("layer: tensor parallel, forward", layer.tp_forward,
                      lambda: f"2 x {each} of T*h = {_si(layer.tp_message_bytes, 'B')} over {counted(d.tp, 'rank')} (ring: {ring} "
                              f"of it per collective), {_link(plan.links['tp'])}"))
        items.append(("layer: tensor parallel, backward (and recompute)", layer.tp_backward + layer.tp_recompute,
                      lambda: "the same collectives backward" + (", twice the input all-gather again (Megatron-LM)"
                              if layer.tp_backward > layer.tp_forward * 1.01 else "")
                              + (", and the forward's again" if layer.tp_recompute else "")))
    if d.cp > 1:
        items.append(("layer: context parallel K/V ring, exposed", layer.cp_forward + layer.cp_backward,
                      lambda: f"(cp-1) = {d.cp - 1} steps of {_si(layer.cp_step_bytes, 'B')} forward, twice backward, "
                              f"beyond the attention compute, {_link(plan.links['cp'])}"))
    return items


def _stage_terms(plan: TimePlan, costs: list[StageCost], edges: EdgeCosts) -> list:
    items = [("embedding (first stage), forward + backward", edges.embed_forward.seconds + edges.embed_backward.seconds,
              lambda: f"{_work(edges.embed_forward, plan)}; backward {_work(edges.embed_backward, plan)}"),
             ("final norm, head and loss (last stage), forward + backward",
              edges.head_forward.seconds + edges.head_backward.seconds,
              lambda: f"{_work(edges.head_forward, plan)}; backward {_work(edges.head_backward, plan)}")]
    for stage, cost in enumerate(costs):
        f, b, w = cost.totals()

        def parts(cost=cost) -> str:
            def listed(part: dict) -> str:
                return " + ".join(f"{k} {seconds_text(v)}" for k, v in part.items() if v)
            text = f"F = {listed(cost.forward)}; B = {listed(cost.backward)}"
            return text + (f"; W = {listed(cost.weight)}" if cost.weight else "")

        items.append((f"stage {stage} ({plan.stage_layers[stage]} layers), one microbatch: F + B + W", f + b + w, parts))
    return items


def _pipeline_terms(plan: TimePlan, run: PipelineRun, critical: int, breakdown: dict) -> list:
    inputs = plan.inputs
    d, m = inputs.degrees, inputs.num_microbatches
    if d.pp == 1:
        return [("forward/backward phase", run.makespan,
                 lambda: f"{counted(m, 'microbatch')} x (F + B) = {m} x {seconds_text(run.busy[0] / m)}")]
    return [
        ("pipeline phase (simulated)", run.makespan,
         lambda: f"{inputs.schedule}, pp {d.pp}, {counted(plan.chunks, 'chunk')} per rank, {counted(m, 'microbatch')}: the "
                 f"schedule simulator with every stage's F, B, W above"),
        (f"pipeline bubble of rank {critical}", breakdown["pipeline_bubble"],
         lambda: f"its finish {seconds_text(run.finish[critical])} - its own work {seconds_text(run.busy[critical])} "
                 f"({breakdown['pipeline_bubble'] / run.finish[critical]:.1%} idle)"),
    ]


def _tail_terms(plan: TimePlan, tails: list[Tail], critical: int) -> list:
    t, hw = tails[critical], plan.hw
    inputs = plan.inputs
    reduce = {0: "all-reduce of the gradients", 1: "reduce-scatter of the gradients"}.get(inputs.zero_stage)
    if inputs.zero_stage == 1 and inputs.framework == "fsdp2":
        reduce = "all-reduce of the gradients (DDP)"
    if steps_with_bf16_optimizer(inputs):
        dtype = accumulation_dtype(inputs.precision, inputs.grad_accum_dtype)
        reduce = f"all-reduce of BF16_Optimizer's {dtype} gradient buffers"
    if inputs.hybrid and inputs.zero_stage >= 2:
        reduce = "all-reduce of the gradient shard across the replicas"
    overlap = "overlapping the last backward" if plan.overlap else "after the backward, not overlapped"
    parts = []
    if reduce:
        across = inputs.hybrid and inputs.zero_stage >= 2
        link = plan.links["replicate"] if across else plan.links["dp"]
        ranks = inputs.degrees.dp * inputs.degrees.cp // plan.degree if across else plan.degree
        parts.append(f"{reduce} over {counted(ranks, 'rank')} on {_link(link)}: {seconds_text(t.reduce)}, {overlap}")
    if t.gather:
        parts.append(f"all-gather of the updated 16-bit parameters after the step: {seconds_text(t.gather)}")
    if inputs.zero_stage >= 2:
        parts.append(f"the per-microbatch gathers and reduce-scatters over {counted(plan.degree, 'rank')} on "
                     f"{_link(plan.links['dp'])} are in the stages' F and B")
    items = [("data parallel after the pipeline, exposed", t.data_parallel, lambda: "; ".join(parts) or "none"),
             ("optimizer step (GPU)", t.optimizer,
              lambda: f"{t.optimizer_elements - t.cpu_elements:,} elements x {t.traffic_per_element:g} B at "
                      f"{_rate(hw.memory_bandwidth)} * {hw.memory_efficiency:g}")]
    if t.offload:
        items.append(("offload (host copies and CPU optimizer), exposed", t.offload,
                      lambda: f"{t.cpu_elements:,} elements on the CPU x {inputs.gpus_per_node} GPUs x "
                              f"{cpu_step_bytes(plan):g} B at {_rate(hw.host_memory_bandwidth)} * "
                              f"{plan.c.cpu_memory_efficiency:g}; copies at {_rate(plan.host_link)}"))
    return items


def explanation(plan: TimePlan, layer: LayerCosts, edges: EdgeCosts, costs: list[StageCost], run: PipelineRun,
                tails: list[Tail], critical: int, breakdown: dict, step: float, tokens: int, model: float,
                executed: float) -> list:
    d = plan.inputs.degrees
    capacity = step * d.world * plan.peak
    items = _hardware(plan) + _layer_terms(plan, layer) + _stage_terms(plan, costs, edges)
    items += _pipeline_terms(plan, run, critical, breakdown) + _tail_terms(plan, tails, critical)
    items.append(("step", step, lambda: " + ".join(f"{k} {seconds_text(breakdown[k])}" for k in CATEGORIES if breakdown[k])
                  + f" (rank {critical} of the pipeline finishes last)" if d.pp > 1 else
                  " + ".join(f"{k} {seconds_text(breakdown[k])}" for k in CATEGORIES if breakdown[k])))
    items.append(("tokens per second", tokens / step,
                  lambda: f"dp {d.dp} x {plan.inputs.micro_batch} x {counted(plan.inputs.num_microbatches, 'microbatch')} x "
                          f"{plan.inputs.seq_len} tokens = {tokens:,} per step / {seconds_text(step)}", "tokens/s"))
    items.append(("MFU", model / capacity,
                  lambda: f"model FLOPs {_si(model, 'FLOP')} / ({seconds_text(step)} x {d.world} GPUs x "
                          f"{_si(plan.peak, 'FLOP/s')}) (causal attention counted half; core/flops.py)", ""))
    items.append(("HFU", executed / capacity,
                  lambda: f"executed FLOPs {_si(executed, 'FLOP')} (recomputation included) / the same", ""))
    return _terms(items)
