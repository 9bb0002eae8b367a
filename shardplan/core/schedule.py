"""Pipeline schedules: the per-rank order of forward, backward and weight-gradient work.

Placement is the loop placement of Megatron-LM and torch.distributed.pipelining: with pp
ranks and `virtual` chunks per rank there are pp * virtual stages, and rank r holds stages
r, r + pp, r + 2pp, ... Each builder returns, per rank, the actions in execution order;
`schedule_sim.simulate` places them in time. Sources, per schedule:

- gpipe: Huang et al. 2019, "GPipe": all forwards, then all backwards (torch ScheduleGPipe).
- 1f1b: PipeDream-Flush, Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN
  Training" (section 3): pp - rank - 1 warm-up forwards, then one forward and one backward
  alternately, then the remaining backwards (Megatron-LM's
  `forward_backward_pipelining_without_interleaving`).
- interleaved-1f1b: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on
  GPU Clusters Using Megatron-LM", section 2.2, in the form of torch's
  ScheduleInterleaved1F1B (2.13): forwards walk the chunks in groups of pp microbatches.
- zero-bubble: ZB-H1 of Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 2.1:
  1F1B with the backward split into B (input gradient) and W (weight gradient), rank r
  starting its Ws r steps late; torch's ScheduleInterleavedZeroBubble with one stage per
  rank builds exactly this order.
- round-robin: looped breadth-first, Lamy-Poirier 2023, "Breadth-First Pipeline
  Parallelism": each chunk runs all microbatches before the next (torch ScheduleLoopedBFS).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from fractions import Fraction
from typing import Callable, Sequence

from ..spec.errors import PlanError
from ..spec.names import SCHEDULES
from .schedule_sim import BACKWARD, FORWARD, WEIGHT, Action, Costs, Timeline, simulate

# Schedules that place several model chunks on one rank (the others hold one stage each).
CHUNKED_SCHEDULES = ("interleaved-1f1b", "round-robin")


def one_chunk_interleaved(schedule: str, pp: int, virtual: int, microbatches: int) -> str | None:
    """Interleaved 1F1B with one chunk per rank: torch's order (schedules.py,
    ScheduleInterleaved1F1B: a warm-up of 2 * (pp - 1 - rank) forwards) keeps more
    microbatches in flight on the first ranks than 1F1B, for the same bubble (`shardplan
    schedule` shows both); None for another schedule, more chunks, or no more held."""
    held, one_f_one_b = min(microbatches, 2 * pp - 1), min(microbatches, pp)
    if schedule != "interleaved-1f1b" or virtual != 1 or held <= one_f_one_b:
        return None
    return (f"1 chunk per rank: interleaved-1f1b holds up to {held} microbatches on the first rank where 1f1b "
            f"holds {one_f_one_b}, for the same bubble; give more virtual stages, or the 1f1b schedule")


def chunks_per_rank(schedule: str, virtual: int) -> int:
    """Model chunks one pipeline rank holds: `virtual` under the chunked schedules, else 1."""
    return virtual if schedule in CHUNKED_SCHEDULES else 1


# Schedules whose warm-up holds up to pp microbatches before the first backward: fewer
# microbatches than pp cannot fill them (torch's Schedule1F1B refuses them, and its
# zero-bubble schedule with one stage per rank is ZB-H1's warm-up). interleaved-1f1b takes
# torch's own rule instead (`interleaved_rounds`).
NEEDS_FULL_PIPELINE = ("1f1b", "zero-bubble")
# Schedules that split the backward into B (input gradient) and W (weight gradient).
SPLIT_BACKWARD = ("zero-bubble",)
# Schedules that run every forward of a step before its first backward (GPipe; looped BFS).
ALL_FORWARDS_FIRST = ("gpipe", "round-robin")

# Bounds that keep a schedule something a person can look at, and planning instant.
# 4x the deepest pipeline published (Megatron-LM's 1T model, pp = 64; Narayanan et al. 2021,
# Table 1).
MAX_PP = 256
MAX_VIRTUAL = 64
MAX_MICROBATCHES = 65536
# pp * virtual * microbatches: (microbatch, stage) pairs; peak_inflight walks each once.
MAX_WORK_ITEMS = 2**20
# pp * makespan: the cells of the timeline (JSON grid, terminal picture, SVG).
MAX_GRID_CELLS = 2**18
# Costs are relative units; a ratio beyond 100:1 between F, B and W is a typing mistake.
MAX_COST = 100


class ScheduleInputError(PlanError):
    """A schedule request that cannot run; `field` names the input to change."""

    def __init__(self, field: str | None, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


def default_costs(schedule: str) -> Costs:
    """F = 1, B = 2 (a backward costs about two forwards); zero-bubble: F = B = W = 1."""
    if schedule in SPLIT_BACKWARD:
        return Costs(forward=1, backward=1, weight=1)
    return Costs(forward=1, backward=2, weight=0)


def _check_int(field: str, value: object, limit: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ScheduleInputError(field, f"must be an integer (got {value!r})")
    if value < 1:
        raise ScheduleInputError(field, f"must be >= 1 (got {value})")
    if limit is not None and value > limit:
        raise ScheduleInputError(field, f"must be <= {limit} (got {value})")
    return value


def interleaved_rounds(pp: int, microbatches: int) -> tuple[int, int]:
    """(rounds, microbatches per round) of torch's ScheduleInterleaved1F1B (torch 2.13,
    distributed/pipelining/schedules.py, `ScheduleInterleaved1F1B.__init__`): max(1, m // pp)
    rounds, each walking its m / rounds microbatches through chunk 0, then chunk 1, ... With
    m a multiple of pp that is Megatron-LM's schedule (rounds of pp; Narayanan et al. 2021,
    section 2.2); torch also runs m that is not, as long as the rounds divide it."""
    rounds = max(1, microbatches // pp)
    return rounds, microbatches // rounds


def interleaved_problem(pp: int, microbatches: int) -> str | None:
    """Why torch's interleaved 1F1B cannot run these microbatches (None: it can)."""
    rounds, _ = interleaved_rounds(pp, microbatches)
    if microbatches % rounds:
        return (f"interleaved-1f1b needs microbatches divisible by pp ({pp}) or by its max(1, m // pp) = "
                f"{rounds} rounds (got {microbatches})")
    return None


def check_schedule(schedule: str, pp: int, microbatches: int, virtual: int = 1, limits: bool = True) -> None:
    """Raise `ScheduleInputError` when the schedule cannot run with these values; `limits`
    adds the bounds that keep a drawn schedule readable (the estimate does without them)."""
    if schedule not in SCHEDULES:
        text = str(schedule).lower()  # '1F1B' is '1f1b' with the wrong case
        close = [text] if text in SCHEDULES else difflib.get_close_matches(text, SCHEDULES, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ScheduleInputError(
            "schedule", f"unknown schedule {schedule!r} ({hint}one of: {', '.join(SCHEDULES)})"
        )
    _check_int("pp", pp, MAX_PP if limits else None)
    _check_int("microbatches", microbatches, MAX_MICROBATCHES if limits else None)
    _check_int("virtual", virtual, MAX_VIRTUAL if limits else None)
    if virtual > 1 and schedule not in CHUNKED_SCHEDULES:
        raise ScheduleInputError(
            "virtual", f"{virtual} chunks per rank need interleaved-1f1b or round-robin ({schedule} "
            "places one stage per rank)",
        )
    if schedule in NEEDS_FULL_PIPELINE and microbatches < pp:
        raise ScheduleInputError(
            "microbatches", f"{schedule} needs at least pp ({pp}) microbatches to fill the pipeline "
            f"(got {microbatches})",
        )
    if schedule == "interleaved-1f1b" and (problem := interleaved_problem(pp, microbatches)):
        raise ScheduleInputError("microbatches", problem)
    items = pp * virtual * microbatches
    if limits and items > MAX_WORK_ITEMS:
        raise ScheduleInputError(
            "microbatches", f"pp ({pp}) * virtual ({virtual}) * microbatches ({microbatches}) = {items} "
            f"(microbatch, stage) pairs exceed the {MAX_WORK_ITEMS} shardplan plans",
        )


def _forward_backward(warmup: int, total: int, fwd_stage: Callable[[int], int],
                      bwd_stage: Callable[[int], int], split_w_delay: int | None = None) -> list[Action]:
    """Warm-up forwards, then (F, B) pairs, then the remaining Bs; microbatches counted per stage.

    The shape of torch's `_get_1f1b_rank_ops`: `fwd_stage(k)` / `bwd_stage(j)` give the stage
    of the k-th forward / j-th backward of this rank. With `split_w_delay = d` (zero-bubble)
    the j-th W follows the (j + d)-th B, and the Ws left at the end follow the last B.
    """
    forwards: dict[int, int] = {}  # stage -> its next microbatch, per kind
    backwards: dict[int, int] = {}
    weights: dict[int, int] = {}
    order: list[Action] = []
    append = order.append
    new = tuple.__new__  # Action(...) without its Python-level __new__: the time model builds many

    def weight(stage: int) -> None:
        mb = weights.get(stage, 0)
        weights[stage] = mb + 1
        append(new(Action, (WEIGHT, mb, stage)))

    for k in range(warmup):
        stage = fwd_stage(k)
        mb = forwards.get(stage, 0)
        forwards[stage] = mb + 1
        append(new(Action, (FORWARD, mb, stage)))
    backward_stages: list[int] = []
    weights_done = 0
    for step in range(warmup, total + warmup):
        if step < total:
            stage = fwd_stage(step)
            mb = forwards.get(stage, 0)
            forwards[stage] = mb + 1
            append(new(Action, (FORWARD, mb, stage)))
        stage = bwd_stage(step - warmup)
        mb = backwards.get(stage, 0)
        backwards[stage] = mb + 1
        append(new(Action, (BACKWARD, mb, stage)))
        if split_w_delay is not None:
            backward_stages.append(stage)
            if step - warmup >= split_w_delay:
                weight(backward_stages[weights_done])
                weights_done += 1
    for stage in backward_stages[weights_done:]:
        weight(stage)
    return order


def _gpipe(pp: int, m: int, v: int, rank: int) -> list[Action]:
    return [Action(FORWARD, i, rank) for i in range(m)] + [Action(BACKWARD, i, rank) for i in range(m)]


def _only(stage: int) -> Callable[[int], int]:
    """The stage of every action of a rank that holds one stage."""
    return lambda _: stage


def _one_f_one_b(pp: int, m: int, v: int, rank: int) -> list[Action]:
    return _forward_backward(min(pp - rank - 1, m), m, _only(rank), _only(rank))


def _zero_bubble(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # ZB-H1: the 1F1B warm-up, and rank r delays its first W by r steady steps, so the Ws
    # of the later ranks fill the tail bubble (Qi et al. 2023, Figure 3 top; torch
    # ScheduleInterleavedZeroBubble: `num_1f1b_microbatches = rank`).
    return _forward_backward(min(pp - rank - 1, m), m, _only(rank), _only(rank), split_w_delay=rank)


def _interleaved(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # Megatron-LM / torch ScheduleInterleaved1F1B: forwards go through a round of microbatches
    # (pp of them when pp divides m; `interleaved_rounds`) of chunk 0, then the round of
    # chunk 1, ...; backwards through the chunks in reverse. The warm-up,
    # (v - 1) * round + 2 * (pp - 1 - rank) forwards (torch `_get_warmup_ops`), lets the first
    # backward of the last chunk come back before the rank starts alternating.
    _, per_round = interleaved_rounds(pp, m)
    warmup = min((v - 1) * per_round + 2 * (pp - 1 - rank), v * m)

    def fwd_stage(k: int) -> int:
        return (k // per_round) % v * pp + rank

    def bwd_stage(j: int) -> int:
        return (v - 1 - (j // per_round) % v) * pp + rank

    return _forward_backward(warmup, v * m, fwd_stage, bwd_stage)


def _looped_bfs(pp: int, m: int, v: int, rank: int) -> list[Action]:
    # torch ScheduleLoopedBFS: every microbatch through chunk 0, then chunk 1, ...; the
    # backward walks chunks and microbatches in reverse.
    stages = range(rank, pp * v, pp)
    forwards = [Action(FORWARD, i, s) for s in stages for i in range(m)]
    backwards = [Action(BACKWARD, i, s) for s in reversed(stages) for i in reversed(range(m))]
    return forwards + backwards


_BUILDERS = {
    "gpipe": _gpipe,
    "1f1b": _one_f_one_b,
    "interleaved-1f1b": _interleaved,
    "zero-bubble": _zero_bubble,
    "round-robin": _looped_bfs,
}


def rank_orders(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[list[Action]]:
    """Per rank, the F/B/W actions in the order the rank executes them."""
    check_schedule(schedule, pp, microbatches, virtual)
    build = _BUILDERS[schedule]
    return [build(pp, microbatches, virtual, rank) for rank in range(pp)]


def rank_order(schedule: str, pp: int, microbatches: int, virtual: int, rank: int) -> list[Action]:
    """One rank's F/B/W order (the schedule's own requirements checked, not the drawing limits)."""
    check_schedule(schedule, pp, microbatches, virtual, limits=False)
    return _BUILDERS[schedule](pp, microbatches, virtual, rank)


def inflight_of(orders: list[list[Action]], split_backward: bool) -> list[int]:
    """Per rank, the most (microbatch, stage) pairs held at once while walking the order.

    A pair is held from its F until its last backward piece: W when the backward is split,
    else B.
    """
    release = WEIGHT if split_backward else BACKWARD
    return [held_peak(order, {action.stage: 1 for action in order}, release)[0] for order in orders]


def held_peak(order: Sequence[Action], stage_bytes: dict[int, int], release: str) -> tuple[int, dict[int, int]]:
    """The most a rank holds while walking its order, each (microbatch, stage) weighing its
    stage's `stage_bytes` from its F until `release` (B, or W when the backward is split), and
    how many microbatches of each stage it holds then."""
    current = peak = 0
    end = 0  # actions walked when the peak was first reached
    for position, (kind, _, stage) in enumerate(order):
        if kind == FORWARD:
            current += stage_bytes[stage]
            if current > peak:
                peak, end = current, position + 1
        elif kind == release:
            current -= stage_bytes[stage]
    at_peak = dict.fromkeys(stage_bytes, 0)
    for kind, _, stage in order[:end]:
        if kind == FORWARD:
            at_peak[stage] += 1
        elif kind == release:
            at_peak[stage] -= 1
    return peak, at_peak


def peak_inflight(schedule: str, pp: int, microbatches: int, virtual: int = 1) -> list[int]:
    """Per pipeline rank, the peak number of (microbatch, chunk) pairs whose activations it holds.

    What is counted: a rank holds the activations of (microbatch i, chunk c) from the start
    of that chunk's forward of i until its last backward piece for i ends -- the backward B
    for gpipe, 1f1b, interleaved-1f1b and round-robin; the weight-gradient W for zero-bubble,
    whose B keeps part of the activations until W (Qi et al. 2023, Table 1). The result is
    the maximum over the rank's order; it does not depend on the costs.

    Units: one pair is the activations of one microbatch through one chunk, i.e. 1/virtual
    of the rank's layers. For a stage-equivalent (a whole rank's layers) divide by
    `virtual`. Known values: 1f1b gives pp - rank; gpipe gives microbatches; round-robin
    gives virtual * microbatches; zero-bubble gives pp on every rank (counting to W).

    Raises `ScheduleInputError` (a `PlanError`) for values the schedule cannot run with.
    """
    orders = rank_orders(schedule, pp, microbatches, virtual)
    return inflight_of(orders, schedule in SPLIT_BACKWARD)


@dataclass(frozen=True)
class SchedulePlan:
    """A simulated schedule: its inputs, orders, timeline and the figures derived from them."""

    schedule: str
    pp: int
    microbatches: int
    virtual: int
    costs: Costs
    orders: list[list[Action]]
    timeline: Timeline
    inflight: list[int]

    @property
    def num_stages(self) -> int:
        return self.pp * self.virtual

    @property
    def makespan(self) -> int:
        return self.timeline.makespan

    @property
    def ideal(self) -> int:
        """Time without a bubble: one rank's own work, virtual * microbatches * (F + B + W)."""
        return self.virtual * self.microbatches * self.costs.per_item()

    @property
    def idle(self) -> int:
        return self.timeline.idle()

    @property
    def bubble(self) -> Fraction:
        """Idle / (makespan * pp), exact."""
        return self.timeline.bubble()


def check_costs(schedule: str, costs: Costs) -> None:
    for field, value in (("cost_f", costs.forward), ("cost_b", costs.backward)):
        _check_int(field, value, MAX_COST)
    if schedule in SPLIT_BACKWARD:
        _check_int("cost_w", costs.weight, MAX_COST)
    elif costs.weight:
        raise ScheduleInputError(
            "cost_w", f"only zero-bubble splits the backward into B and W; for {schedule} the "
            "backward is one action, costed by --cost-b",
        )


def plan_schedule(schedule: str, pp: int, microbatches: int, virtual: int = 1,
                  costs: Costs | None = None) -> SchedulePlan:
    """Build the orders, simulate them with `costs`, and count the peaks in flight."""
    costs = default_costs(schedule) if costs is None else costs
    check_schedule(schedule, pp, microbatches, virtual)
    check_costs(schedule, costs)
    # Every unit of work occupies a cell, so the grid has at least this many cells.
    work = pp * virtual * microbatches * costs.per_item()
    if work > MAX_GRID_CELLS:
        raise ScheduleInputError(None, _too_big(f"at least {work}"))
    orders = rank_orders(schedule, pp, microbatches, virtual)
    timeline = simulate(orders, pp * virtual, costs)
    cells = pp * timeline.makespan
    if cells > MAX_GRID_CELLS:
        raise ScheduleInputError(None, _too_big(f"pp ({pp}) * makespan ({timeline.makespan}) = {cells}"))
    inflight = inflight_of(orders, schedule in SPLIT_BACKWARD)
    return SchedulePlan(schedule, pp, microbatches, virtual, costs, orders, timeline, inflight)


def _too_big(cells: str) -> str:
    return (
        f"the timeline would have {cells} cells, more than the {MAX_GRID_CELLS} shardplan draws; "
        "use fewer microbatches or stages, or smaller costs"
    )
