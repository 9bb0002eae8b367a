"""How long one training step takes: `step_time(inputs, hardware)`, the narrow function the
estimate and the planner call.

    step = pipeline phase: every stage's per-microbatch costs (time_plan.py) placed in time
           by the schedule simulator (pipeline_time.py)
         + on each pipeline rank, what follows its last backward: the exposed gradient
           reduction, the optimizer step, offload's CPU step and copies (time_plan.tail)

The step ends when the last rank does. Along that rank's path every second belongs to one
category (stage_time.CATEGORIES): its own work, split by kind, the idle time the schedule
leaves it (the bubble) and its tail; `breakdown` holds them and they add up to
`step_seconds`. docs/time.md gives every formula and its source; `StepTime.explain()` lists
them with this plan's numbers, formatted from what was computed here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from .collectives import group_link, inter_link, intra_link, spans_nodes
from .estimate_inputs import EstimateInputs
from .flops import hardware_flops_per_token, model_flops_per_token
from .hardware import DEFAULT_CONSTANTS, Hardware, TimeConstants
from .pipeline_time import RESOLUTION, PipelineRun, run_pipeline
from .layer_time import LayerWork, layer_costs
from .pipeline import stage_layers
from .precision import element_bytes
from .schedule import SPLIT_BACKWARD, chunks_per_rank
from .stage_time import (
    BACKWARD, CATEGORIES, DATA_PARALLEL, FORWARD, OFFLOAD, OPTIMIZER, PIPELINE_BUBBLE, RECOMPUTE, StageCost,
    edge_costs,
)
from .time_plan import LoraShape, Tail, edges_of, layer_of, make_plan, stage_costs, stage_elements, tail

__all__ = ["LoraShape", "StepTime", "TimeTerm", "step_time", "step_time_bound", "step_time_refined_bound"]

# `bottleneck` is the largest group of breakdown categories; these group several.
GROUPS = {"compute": (FORWARD, BACKWARD, RECOMPUTE)}


@dataclass(frozen=True)
class TimeTerm:
    """One line of `--explain`: `label = formula = value` (the formula built on demand);
    `unit` is "s" for seconds, "tokens/s", or "" for a fraction."""

    label: str
    value: float
    source: str | Callable[[], str] = ""
    unit: str = "s"

    @property
    def formula(self) -> str:
        return self.source() if callable(self.source) else self.source


@dataclass(frozen=True)
class StepTime:
    """The predicted step; `breakdown` (category -> seconds) sums to `step_seconds`."""

    step_seconds: float
    tokens_per_step: int
    tokens_per_second: float
    tokens_per_second_per_gpu: float
    mfu: float
    hfu: float
    bottleneck: str
    breakdown: dict[str, float]
    model_flops_per_step: float
    hardware_flops_per_step: float
    hardware: Hardware
    _explain: Callable[[], list[TimeTerm]] = field(repr=False, compare=False, default=lambda: [])

    def explain(self) -> list[TimeTerm]:
        """Every term with its formula and numbers (formatted now, computed before)."""
        return self._explain()


def _links(inputs: EstimateInputs, hw: Hardware, c: TimeConstants) -> dict:
    d, order, gpn = inputs.degrees, inputs.order, inputs.gpus_per_node
    dp_cp = group_link(d, order, gpn, "dp_cp", hw, c)
    links = {
        "tp": group_link(d, order, gpn, "tp", hw, c),
        "cp": group_link(d, order, gpn, "cp", hw, c),
        "pp": group_link(d, order, gpn, "pp", hw, c),
        "dp": dp_cp,
        "replicate": dp_cp,
    }
    if inputs.hybrid:  # shard inside the node, replicate across nodes
        links["dp"] = intra_link(hw, c)
        links["replicate"] = inter_link(hw, c) if spans_nodes(d, order, gpn, "dp_cp") else intra_link(hw, c)
    return links


def _rank_path(run: PipelineRun, costs: list[StageCost], microbatches: int, pp: int, rank: int,
               rank_tail: Tail) -> dict[str, float]:
    """Seconds by category along one pipeline rank's step: its work, its idle time, its tail."""
    path = dict.fromkeys(CATEGORIES, 0.0)
    for stage in range(rank, len(costs), pp):
        for part in (costs[stage].forward, costs[stage].backward, costs[stage].weight):
            for category, seconds in part.items():
                path[category] += microbatches * seconds
    path[PIPELINE_BUBBLE] = max(0.0, run.finish[rank] - run.busy[rank])
    path[DATA_PARALLEL] += rank_tail.data_parallel
    path[OPTIMIZER] += rank_tail.optimizer
    path[OFFLOAD] += rank_tail.offload
    return path


def _bottleneck(breakdown: dict[str, float]) -> str:
    grouped = {name: sum(breakdown[c] for c in members) for name, members in GROUPS.items()}
    grouped.update({c: s for c, s in breakdown.items() if not any(c in m for m in GROUPS.values())})
    return max(grouped, key=grouped.get)


def step_time(inputs: EstimateInputs, hardware: Hardware, constants: TimeConstants = DEFAULT_CONSTANTS,
              lora: LoraShape | None = None) -> StepTime:
    """The predicted step of a plan (`inputs` as the memory estimate decided them, offload
    included) on `hardware`; `lora` when only adapters are trained. Pure; cached where it
    pays: per-layer costs by layer shape (layer_time.layer_costs), pipeline simulations by
    schedule, pp, chunks and relative stage costs (pipeline_time), node spans by layout."""
    plan = make_plan(inputs, hardware, constants, lora, _links(inputs, hardware, constants))
    layer = layer_of(plan)
    edges = edges_of(plan)
    costs = stage_costs(plan, layer, edges)
    d, m = inputs.degrees, inputs.num_microbatches
    run = run_pipeline(inputs.schedule, d.pp, m, inputs.virtual, [c.totals() for c in costs])
    elements = stage_elements(plan)
    tails = []
    for rank in range(d.pp):
        last = costs[rank]  # chunk 0: a rank's last backward is its first chunk's
        window = last.backward[BACKWARD] + last.backward[RECOMPUTE] + last.weight.get(BACKWARD, 0.0)
        tails.append(tail(plan, rank, elements, window))
    ends = [run.finish[r] + tails[r].data_parallel + tails[r].optimizer + tails[r].offload for r in range(d.pp)]
    critical = max(range(d.pp), key=ends.__getitem__)
    breakdown = _rank_path(run, costs, m, d.pp, critical, tails[critical])
    step = sum(breakdown.values())
    tokens = d.dp * inputs.micro_batch * m * inputs.seq_len
    shape = plan.shape
    model = tokens * model_flops_per_token(shape, inputs.seq_len, frozen_weights=plan.frozen)
    executed = tokens * hardware_flops_per_token(shape, inputs.seq_len, inputs.recompute, frozen_weights=plan.frozen,
                                                 tp=d.tp)
    capacity = step * d.world * plan.peak
    from .time_explain import explanation

    return StepTime(
        step_seconds=step, tokens_per_step=tokens, tokens_per_second=tokens / step,
        tokens_per_second_per_gpu=tokens / step / d.world, mfu=model / capacity, hfu=executed / capacity,
        bottleneck=_bottleneck(breakdown), breakdown=breakdown, model_flops_per_step=model,
        hardware_flops_per_step=executed, hardware=hardware,
        _explain=lambda: explanation(plan, layer, edges, costs, run, tails, critical, breakdown, step, tokens, model, executed),
    )


def step_time_bound(inputs: EstimateInputs, hardware: Hardware, constants: TimeConstants = DEFAULT_CONSTANTS,
                    lora: LoraShape | None = None) -> float:
    """A lower bound of `step_time(...).step_seconds`, much cheaper. Each stage's forward and
    backward count only its layers and edges (compute, recomputation, and the tensor- and
    context-parallel collectives, as `stage_cost` adds them), leaving out sends, exposed
    data-parallel and host traffic and the tails, which are never negative. A pipeline rank
    runs its actions one after another, cannot start before the first microbatch has gone
    through the stages before it, and its last backward must go back through them: the step
    takes at least that, for every rank (for uniform 1F1B stages, (m + p - 1)(F + B): the
    bubble's closed form). `shardplan plan` walks candidates in the order of this bound and
    stops when it exceeds the plans found (core/search.py; tests/test_plan.py holds bound <=
    step time over random plans)."""
    return _bound(inputs.shape, inputs.degrees, inputs.order, inputs.gpus_per_node, inputs.framework,
                  inputs.precision, inputs.optimizer, inputs.micro_batch, inputs.seq_len, inputs.num_microbatches,
                  inputs.schedule, inputs.virtual, inputs.stage_split, inputs.sequence_parallel, inputs.recompute,
                  inputs.attention, inputs.dropout, inputs.loss, hardware, constants, lora)


@lru_cache(maxsize=65536)
def _bound(shape, d, order, gpus_per_node, framework, precision, optimizer, micro_batch, seq_len, microbatches,
           schedule, virtual, stage_split, sequence_parallel, recompute, attention, dropout, loss, hardware,
           constants, lora) -> float:
    """`step_time_bound` on the inputs it reads (plans that differ in sharding share it)."""
    layer_f, layer_b, embed_f, embed_b, head_f, head_b = _bound_parts(
        shape, d, order, gpus_per_node, framework, precision, optimizer, micro_batch, seq_len, sequence_parallel,
        recompute, attention, dropout, loss, hardware, constants, lora)
    chunks = chunks_per_rank(schedule, virtual)
    counts = _stage_counts(shape.num_layers, d.pp * chunks, stage_split)
    last_stage = len(counts) - 1
    forward = [layers * layer_f for layers in counts]
    backward = [layers * layer_b for layers in counts]
    forward[0] += embed_f
    backward[0] += embed_b
    forward[last_stage] += head_f
    backward[last_stage] += head_b
    m = microbatches
    # Rank r starts once microbatch 0 has gone forward through the stages before it (chunk 0
    # holds global stages 0..pp-1), runs its own microbatches one action at a time, and its
    # last backward (chunk 0's) must still run back through those stages. With the backward
    # split (zero-bubble) the weight passes may trail: only the forward chain is added.
    chain_back = schedule not in SPLIT_BACKWARD
    best = 0.0
    before_f = before_b = 0.0
    for rank in range(d.pp):
        own = m * sum(forward[s] + backward[s] for s in range(rank, len(counts), d.pp))
        best = max(best, before_f + own + (before_b if chain_back else 0.0))
        before_f += forward[rank]
        before_b += backward[rank]
    return best


def step_time_group_bound(inputs: EstimateInputs, batches: tuple[tuple[int, int], ...], hardware: Hardware,
                          constants: TimeConstants = DEFAULT_CONSTANTS, lora: LoraShape | None = None) -> float:
    """A lower bound of `step_time_bound` over the plans that differ from `inputs` only in
    the (micro batch, microbatches) of `batches`, all with the same product (the sequences a
    data-parallel rank takes per step), computed once for them all. `_bound` is, for each rank
    r, the sequences' share of its own actions, m * own_r(b) = local * own_r(b) / b, plus the
    fill before it, sum of the earlier stages' per-microbatch costs; both are sums of
    per-layer, embedding and head costs, so each is at least the same sum of each part's least
    value over `batches` (the least of a sum is at least the sum of the least parts). `shardplan
    plan` orders groups of plans by this bound and computes the exact one only for the groups it
    reaches (core/search.py; tests/test_plan.py holds it at or below every plan's bound)."""
    return _group_bound(inputs.shape, inputs.degrees, inputs.order, inputs.gpus_per_node, inputs.framework,
                        inputs.precision, inputs.optimizer, tuple(batches), inputs.seq_len, inputs.schedule,
                        inputs.virtual, inputs.stage_split, inputs.sequence_parallel, inputs.recompute,
                        inputs.attention, inputs.dropout, inputs.loss, hardware, constants, lora)


@lru_cache(maxsize=16384)
def _group_bound(shape, d, order, gpus_per_node, framework, precision, optimizer, batches, seq_len, schedule,
                 virtual, stage_split, sequence_parallel, recompute, attention, dropout, loss, hardware, constants,
                 lora) -> float:
    local = batches[0][0] * batches[0][1]
    chain_back = schedule not in SPLIT_BACKWARD
    per_sequence = [float("inf")] * 3  # layer, embedding, head: least (forward + backward) / micro batch
    per_fill = [float("inf")] * 2  # layer, embedding: least forward (+ backward when chained) of a microbatch
    for micro_batch, microbatches in batches:
        if micro_batch * microbatches != local:
            raise ValueError(f"batches of unequal sequences per rank: {batches}")
        layer_f, layer_b, embed_f, embed_b, head_f, head_b = _bound_parts(
            shape, d, order, gpus_per_node, framework, precision, optimizer, micro_batch, seq_len,
            sequence_parallel, recompute, attention, dropout, loss, hardware, constants, lora)
        for n, value in enumerate(((layer_f + layer_b) / micro_batch, (embed_f + embed_b) / micro_batch,
                                   (head_f + head_b) / micro_batch)):
            per_sequence[n] = min(per_sequence[n], value)
        for n, value in enumerate((layer_f + (layer_b if chain_back else 0.0),
                                   embed_f + (embed_b if chain_back else 0.0))):
            per_fill[n] = min(per_fill[n], value)
    counts = _stage_counts(shape.num_layers, d.pp * chunks_per_rank(schedule, virtual), stage_split)
    last_rank = (len(counts) - 1) % d.pp
    best = before = 0.0
    for rank in range(d.pp):
        layers = sum(counts[s] for s in range(rank, len(counts), d.pp))
        own = layers * per_sequence[0] + (per_sequence[1] if rank == 0 else 0.0) + (
            per_sequence[2] if rank == last_rank else 0.0)
        best = max(best, local * own + before)
        before += counts[rank] * per_fill[0] + (per_fill[1] if rank == 0 else 0.0)
    # The sums are regrouped: a relative 1e-9 covers their rounding.
    return best * (1 - 1e-9)


@lru_cache(maxsize=16384)
def _bound_parts(shape, d, order, gpus_per_node, framework, precision, optimizer, micro_batch, seq_len,
                 sequence_parallel, recompute, attention, dropout, loss, hardware, constants,
                 lora) -> tuple[float, ...]:
    """(forward, backward of one layer; embedding's forward, backward; head's forward,
    backward) of one microbatch as `stage_cost` counts them (compute, recomputation, tensor- and
    context-parallel collectives): what the bound reads of a plan beside its schedule, split
    and microbatches, shared by the plans that differ only in those."""
    links = _bound_links(d, order, gpus_per_node, False, hardware, constants)
    eb = element_bytes(framework, precision, optimizer)
    peak = hardware.peak_for(precision)
    frozen = lora is not None
    work = LayerWork(
        shape=shape, micro_batch=micro_batch, seq_len=seq_len, tp=d.tp, cp=d.cp,
        sequence_parallel=sequence_parallel, attention=attention, dropout=dropout,
        recompute=recompute, act_bytes=eb.compute, frozen=frozen, lora_rank=lora.rank if lora else 0,
        lora_targets=lora.targets if lora else (), sp_regather=framework != "fsdp2",
    )
    layer = layer_costs(work, peak, hardware, constants, links["tp"], links["cp"])
    tokens = micro_batch * seq_len // d.cp
    sp = sequence_parallel and d.tp > 1
    edges = edge_costs(shape, tokens, d.tp, sp, eb.compute, frozen, loss, peak, hardware, constants, links["tp"])
    layer_f = layer.forward + layer.tp_forward + layer.cp_forward
    layer_b = layer.backward + layer.recompute.seconds + layer.tp_backward + layer.tp_recompute + layer.cp_backward
    return (layer_f, layer_b, edges.embed_forward.seconds + edges.embed_tp, edges.embed_backward.seconds,
            edges.head_forward.seconds + edges.head_tp_forward, edges.head_backward.seconds + edges.head_tp_backward)


@lru_cache(maxsize=4096)
def _bound_links(degrees, order: str, gpus_per_node: int, hybrid: bool, hardware: Hardware,
                 constants: TimeConstants) -> dict:
    probe = EstimateInputs(shape=None, params=None, degrees=degrees, order=order, gpus_per_node=gpus_per_node,
                           hybrid=hybrid)
    return _links(probe, hardware, constants)


@lru_cache(maxsize=4096)
def _stage_counts(num_layers: int, stages: int, split: tuple[int, int]) -> tuple[int, ...]:
    return tuple(len(s) for s in stage_layers(num_layers, stages, *split))


def step_time_refined_bound(inputs: EstimateInputs, hardware: Hardware, constants: TimeConstants = DEFAULT_CONSTANTS,
                            lora: LoraShape | None = None) -> float:
    """A sharper lower bound of `step_time`, without the pipeline simulation: every stage's
    whole per-microbatch cost (sends, exposed data-parallel and host traffic included) and
    every rank's tail (gradient reduction, optimizer, offload), which do not depend on the
    simulation. Rank r cannot start before the first microbatch has gone forward through the
    stages before it and then runs its own actions one at a time: its end is at least that
    plus its tail. Without a split backward its last action is a backward that must still go
    back through those stages before rank 0 ends, and rank 0's tail follows. The step is the
    latest end, so at least each of these."""
    plan = make_plan(inputs, hardware, constants, lora, _links(inputs, hardware, constants))
    costs = stage_costs(plan, layer_of(plan), edges_of(plan))
    d, m = inputs.degrees, inputs.num_microbatches
    elements = stage_elements(plan)
    ends = []
    for rank in range(d.pp):
        last = costs[rank]
        window = last.backward[BACKWARD] + last.backward[RECOMPUTE] + last.weight.get(BACKWARD, 0.0)
        t = tail(plan, rank, elements, window)
        ends.append(t.data_parallel + t.optimizer + t.offload)
    totals = [c.totals() for c in costs]
    chain_back = inputs.schedule not in SPLIT_BACKWARD
    best = before_f = before_b = 0.0
    for rank in range(d.pp):
        own = m * sum(sum(totals[s]) for s in range(rank, len(costs), d.pp))
        best = max(best, before_f + own + ends[rank])
        if chain_back:
            best = max(best, before_f + own + before_b + ends[0])
        before_f += totals[rank][0]
        before_b += totals[rank][1] + totals[rank][2]
    # The simulator runs on integer units of 1/RESOLUTION of the largest action, so a
    # simulated makespan can lie a fraction of a percent below this exact chain (0.046% at
    # most over 1,500 random plans): the bound is taken REFINE_MARGIN low.
    return best * (1 - REFINE_MARGIN)


# How far below the exact chain the refined bound is taken: five units of the simulator.
REFINE_MARGIN = 5 / RESOLUTION
