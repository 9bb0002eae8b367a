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
from typing import Callable

from .collectives import group_link, inter_link, intra_link, spans_nodes
from .estimate_inputs import EstimateInputs
from .flops import hardware_flops_per_token, model_flops_per_token
from .hardware import DEFAULT_CONSTANTS, Hardware, TimeConstants
from .pipeline_time import PipelineRun, run_pipeline
from .stage_time import (
    BACKWARD, CATEGORIES, DATA_PARALLEL, FORWARD, OFFLOAD, OPTIMIZER, PIPELINE_BUBBLE, RECOMPUTE, StageCost,
)
from .time_plan import LoraShape, Tail, edges_of, layer_of, make_plan, stage_costs, stage_elements, tail

__all__ = ["LoraShape", "StepTime", "TimeTerm", "step_time"]

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
