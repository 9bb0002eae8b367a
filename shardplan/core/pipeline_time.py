"""The pipeline phase of a step: each stage's real costs run through the schedule simulator.

Every global stage (pp * virtual of them, core/schedule.py) has its own forward, backward and
weight-gradient seconds per microbatch; `schedule_sim.simulate` places every action of every
rank's order in time, so the bubble comes from the real costs, uneven first and last stages
included. With one stage there is no pipeline: gradient accumulation runs the microbatches
back to back.

Costs become integer units (the simulator is exact on integers): a unit is 1/RESOLUTION of
the largest action's cost, so nearby plans share a cached simulation. Long schedules are not
walked to the end: once warm, a schedule repeats with a fixed period, so the makespan and
every rank's finish grow linearly with the microbatches; two simulations past the warm-up
fix that line (tests/test_time_pieces.py checks it against full simulations).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .schedule import chunks_per_rank, rank_order
from .schedule_sim import compile_orders, encode_orders, run_compiled

RESOLUTION = 1024  # units of the largest action: rounding moves a makespan by < 0.1%
POINTS = 4  # simulations that must lie on one line before the makespan is extrapolated


@dataclass(frozen=True)
class PipelineRun:
    """The simulated pipeline phase, in seconds."""

    makespan: float
    finish: tuple[float, ...]  # per pipeline rank: when its last action ends
    busy: tuple[float, ...]  # per pipeline rank: seconds of its own work
    last_backward: tuple[float, ...]  # per pipeline rank: seconds of its last action


def _warm_up(pp: int, chunks: int) -> int:
    """Microbatches after which a schedule is usually periodic (a multiple of pp, as
    interleaving needs): past the pp * chunks forwards of the warm-up."""
    return pp * (chunks + 1)


@lru_cache(maxsize=256)
def _orders(schedule: str, pp: int, microbatches: int, chunks: int):
    """Every rank's order, compiled for `run_compiled`: the same for every plan that shares
    the schedule, the depth and the microbatches."""
    orders = encode_orders([rank_order(schedule, pp, microbatches, chunks, rank) for rank in range(pp)])
    return compile_orders(orders, pp * chunks)


@lru_cache(maxsize=1024)
def _simulate_units(schedule: str, pp: int, microbatches: int, chunks: int,
                    costs: tuple[tuple[int, int, int], ...]) -> tuple[int, tuple[int, ...]]:
    return run_compiled(_orders(schedule, pp, microbatches, chunks), costs)


def _on_a_line(points: list[tuple[int, tuple[int, ...]]]) -> bool:
    """Equal steps between consecutive simulations, for the makespan and every finish."""
    series = [[p[0] for p in points]] + [list(column) for column in zip(*(p[1] for p in points))]
    return all(len({b - a for a, b in zip(values, values[1:])}) == 1 for values in series)


def _makespan_units(schedule: str, pp: int, microbatches: int, chunks: int,
                    costs: tuple[tuple[int, int, int], ...]) -> tuple[float, tuple[float, ...]]:
    """Makespan and per-rank finish; past the warm-up, extrapolated along the line that
    POINTS equally spaced simulations agree on (simulating further while they do not)."""
    low = _warm_up(pp, chunks)
    # interleaved-1f1b with m not a multiple of pp runs rounds of m / max(1, m // pp)
    # microbatches (core/schedule.py `interleaved_rounds`), not the rounds of pp that the
    # sampled counts run: it is simulated whole (such m are below pp * pp).
    flexible = schedule == "interleaved-1f1b" and microbatches % pp
    while not flexible and low + (POINTS - 1) * pp < microbatches:
        points = [_simulate_units(schedule, pp, low + i * pp, chunks, costs) for i in range(POINTS)]
        if _on_a_line(points):
            steps = (microbatches - low) / pp
            return (points[0][0] + steps * (points[1][0] - points[0][0]),
                    tuple(a + steps * (b - a) for a, b in zip(points[0][1], points[1][1])))
        low *= 2
    makespan, finish = _simulate_units(schedule, pp, microbatches, chunks, costs)
    return float(makespan), tuple(map(float, finish))


def run_pipeline(schedule: str, pp: int, microbatches: int, virtual: int,
                 stage_costs: list[tuple[float, float, float]]) -> PipelineRun:
    """Simulate the step's forward/backward phase; `stage_costs[s]` = (F, B, W) seconds of
    global stage s for one microbatch (W > 0 only when the schedule splits the backward)."""
    chunks = chunks_per_rank(schedule, virtual)
    per_rank = [[stage_costs[rank + chunk * pp] for chunk in range(chunks)] for rank in range(pp)]
    busy = tuple(microbatches * sum(f + b + w for f, b, w in stages) for stages in per_rank)
    # A rank's last action is the backward (or W) of its first chunk.
    last = tuple(stages[0][2] or stages[0][1] for stages in per_rank)
    if pp == 1:
        return PipelineRun(busy[0], busy, busy, last)
    largest = max(max(cost) for cost in stage_costs)
    if largest <= 0:
        return PipelineRun(0.0, (0.0,) * pp, busy, last)
    # Units relative to the largest action: a simulation serves every plan with the same
    # cost ratios (the timeline scales with its costs), and past the warm-up the simulated
    # microbatch counts do not depend on the plan's.
    unit = largest / RESOLUTION
    units = tuple(tuple(round(x / unit) for x in cost) for cost in stage_costs)
    makespan, finish = _makespan_units(schedule, pp, microbatches, chunks, units)
    return PipelineRun(makespan * unit, tuple(f * unit for f in finish), busy, last)
