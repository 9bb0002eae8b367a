"""Run per-rank pipeline orders against their dependencies: when does every piece of work run.

The model (docs/schedule.md, "Simulation rules"): time is an integer count of units; every
action has an integer cost; communication is free. Each rank executes its actions strictly
in its listed order, one at a time. An action starts as soon as its rank is free and its
dependencies have finished:

- F of stage s for microbatch i      after F of stage s-1 for i (s > 0);
- B of stage s for i                 after F of stage s for i (its own forward) and, below the
                                     last stage, after B of stage s+1 for i;
- W of stage s for i (zero-bubble)   after B of stage s for i.

With integer costs every start and end is an integer, so the bubble fraction derived from a
timeline is an exact `Fraction`. The timeline does not depend on the order in which ranks
are visited: each start is the maximum of finished end times, fixed once those are known.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

FORWARD, BACKWARD, WEIGHT = "F", "B", "W"


class Action(NamedTuple):
    """One piece of work: `kind` F, B or W, on `microbatch`, for the global `stage`."""

    kind: str
    microbatch: int
    stage: int


class Span(NamedTuple):
    """An action placed in time on its rank: it runs over the units [start, end)."""

    start: int
    end: int
    action: Action


class ScheduleDeadlock(RuntimeError):
    """A listed order can never finish: a programming error in an order builder.

    Not a user error: the CLI reports it as an internal error (exit 3), never a hang.
    """


@dataclass(frozen=True)
class Costs:
    """Time units per action: forward, backward, and weight gradient (0 when B includes it)."""

    forward: int = 1
    backward: int = 2
    weight: int = 0

    def of(self, kind: str) -> int:
        return {FORWARD: self.forward, BACKWARD: self.backward, WEIGHT: self.weight}[kind]

    def per_item(self) -> int:
        """Units one (microbatch, stage) costs its rank: F + B + W."""
        return self.forward + self.backward + self.weight

    def of_action(self, action: Action) -> int:
        return self.of(action.kind)


@dataclass(frozen=True)
class StageCosts:
    """Units per action that differ by stage (the time model's real stage costs):
    `per_stage[stage]` is (F, B, W) of that global stage."""

    per_stage: tuple[tuple[int, int, int], ...]

    def of_action(self, action: Action) -> int:
        forward, backward, weight = self.per_stage[action.stage]
        return forward if action.kind == FORWARD else backward if action.kind == BACKWARD else weight


@dataclass(frozen=True)
class Timeline:
    """What every rank does when: `spans[rank]` in execution order."""

    spans: list[list[Span]]
    makespan: int

    @property
    def num_ranks(self) -> int:
        return len(self.spans)

    def busy(self) -> list[int]:
        """Units each rank spends computing."""
        return [sum(s.end - s.start for s in rank) for rank in self.spans]

    def idle(self) -> int:
        """Units all ranks together spend waiting before the makespan."""
        return self.makespan * self.num_ranks - sum(self.busy())

    def bubble(self) -> Fraction:
        """Idle / total, total = makespan * ranks (0 for an empty timeline)."""
        total = self.makespan * self.num_ranks
        return Fraction(self.idle(), total) if total else Fraction(0)

    def grid(self) -> list[list[Action | None]]:
        """One entry per rank per time unit: the action running then, or None when idle."""
        rows = []
        for rank in self.spans:
            row: list[Action | None] = [None] * self.makespan
            for span in rank:
                row[span.start:span.end] = [span.action] * (span.end - span.start)
            rows.append(row)
        return rows


def dependencies(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The actions that must finish before `action` may start (module docstring)."""
    kind, mb, stage = action
    if kind == FORWARD:
        return (Action(FORWARD, mb, stage - 1),) if stage > 0 else ()
    if kind == BACKWARD:
        own_forward = Action(FORWARD, mb, stage)
        if stage == num_stages - 1:
            return (own_forward,)
        return (own_forward, Action(BACKWARD, mb, stage + 1))
    return (Action(BACKWARD, mb, stage),)


def _dependents(action: Action, num_stages: int) -> tuple[Action, ...]:
    """The inverse of `dependencies`: who may become ready when `action` finishes."""
    kind, mb, stage = action
    if kind == FORWARD:
        nxt = (Action(FORWARD, mb, stage + 1),) if stage + 1 < num_stages else ()
        return nxt + (Action(BACKWARD, mb, stage),)
    if kind == BACKWARD:
        prev = (Action(BACKWARD, mb, stage - 1),) if stage > 0 else ()
        return prev + (Action(WEIGHT, mb, stage),)
    return ()


def simulate(orders: list[list[Action]], num_stages: int, costs: Costs | StageCosts) -> Timeline:
    """Place every action of `orders` (per rank, in execution order) in time.

    Event driven: a rank advances while its next action's dependencies have finished; when
    an action is placed, the ranks of its dependents are looked at again. Raises
    `ScheduleDeadlock` when ranks are left waiting on each other.
    """
    owner: dict[Action, int] = {}
    for rank, order in enumerate(orders):
        for action in order:
            assert action not in owner, f"{action} listed twice"
            owner[action] = rank
    end: dict[Action, int] = {}
    free = [0] * len(orders)
    position = [0] * len(orders)
    spans: list[list[Span]] = [[] for _ in orders]
    pending = list(range(len(orders)))
    while pending:
        rank = pending.pop()
        order = orders[rank]
        while position[rank] < len(order):
            action = order[position[rank]]
            deps = dependencies(action, num_stages)
            if any(dep not in end for dep in deps):
                break
            start = max([free[rank], *(end[dep] for dep in deps)])
            finish = start + costs.of_action(action)
            end[action] = finish
            free[rank] = finish
            spans[rank].append(Span(start, finish, action))
            position[rank] += 1
            for dependent in _dependents(action, num_stages):
                other = owner.get(dependent)
                if other is not None and other != rank:
                    pending.append(other)
    stuck = [rank for rank, order in enumerate(orders) if position[rank] < len(order)]
    if stuck:
        waits = "; ".join(
            f"rank {rank} waits at {_name(orders[rank][position[rank]])}" for rank in stuck[:4]
        )
        raise ScheduleDeadlock(f"the listed order deadlocks: {waits}")
    return Timeline(spans, max(free, default=0))


def _name(action: Action) -> str:
    return f"{action.kind}{action.microbatch} (stage {action.stage})"


_KIND = {FORWARD: 0, BACKWARD: 1, WEIGHT: 2}


def encode_orders(orders: list[list[Action]]) -> tuple[tuple[tuple[int, int, int], ...], ...]:
    """`orders` as (kind 0/1/2 for F/B/W, microbatch, stage) integers, for `compile_orders`."""
    return tuple(tuple((_KIND[a.kind], a.microbatch, a.stage) for a in order) for order in orders)


class Compiled(NamedTuple):
    """Encoded orders as one list of actions in an order where each follows what it waits
    for (its rank's previous action and its dependencies), each as (rank, cost slot = stage * 3
    + kind, index of a dependency or -1, index of another or -1)."""

    ranks: int
    steps: tuple[tuple[int, int, int, int], ...]


def compile_orders(orders: tuple[tuple[tuple[int, int, int], ...], ...], num_stages: int) -> Compiled:
    """The orders of `encode_orders` as `Compiled` steps, found by the event-driven walk of
    `simulate` (a rank runs its next action once what it waits for has run). Every start is
    the latest end among what an action waits for, so the times follow from any such order of
    the steps, whatever the costs: the time model compiles a schedule once and runs it for
    every plan's costs (`run_compiled`). Raises ScheduleDeadlock as `simulate` does."""
    microbatches = 1 + max((mb for order in orders for _, mb, _ in order), default=0)
    span = microbatches * num_stages
    done = [-1] * (3 * span)  # index: kind * span + microbatch * num_stages + stage -> step
    owner = [-1] * (3 * span)
    for rank, order in enumerate(orders):
        for kind, mb, stage in order:
            owner[kind * span + mb * num_stages + stage] = rank
    last = num_stages - 1
    steps: list[tuple[int, int, int, int]] = []
    position = [0] * len(orders)
    pending = list(range(len(orders)))
    while pending:
        rank = pending.pop()
        order = orders[rank]
        at = position[rank]
        while at < len(order):
            kind, mb, stage = order[at]
            here = mb * num_stages + stage
            if kind == 0:
                first = done[here - 1] if stage > 0 else -1
                if stage > 0 and first < 0:
                    break
                second = -1
                wake = (here + 1 if stage < last else -1, span + here)
            elif kind == 1:
                first = done[here]
                if first < 0:
                    break
                second = -1
                if stage < last:
                    second = done[span + here + 1]
                    if second < 0:
                        break
                wake = (span + here - 1 if stage > 0 else -1, 2 * span + here)
            else:
                first = done[span + here]
                if first < 0:
                    break
                second = -1
                wake = ()
            done[kind * span + here] = len(steps)
            steps.append((rank, stage * 3 + kind, first, second))
            at += 1
            for index in wake:
                if index >= 0:
                    other = owner[index]
                    if other >= 0 and other != rank:
                        pending.append(other)
        position[rank] = at
    stuck = [rank for rank, order in enumerate(orders) if position[rank] < len(order)]
    if stuck:
        raise ScheduleDeadlock(f"the listed order deadlocks at ranks {stuck[:4]}")
    return Compiled(len(orders), tuple(steps))


def run_compiled(compiled: Compiled, per_stage: tuple[tuple[int, int, int], ...]) -> tuple[int, tuple[int, ...]]:
    """(makespan, each rank's last end) of compiled orders under the stages' (F, B, W) costs:
    each step starts at the latest of its rank's previous end and its dependencies' ends
    (`simulate`'s figures under `StageCosts(per_stage)`; tests/test_schedule.py holds them
    equal)."""
    costs = [cost for stage in per_stage for cost in stage]
    end: list[int] = []
    free = [0] * compiled.ranks
    for rank, slot, first, second in compiled.steps:
        start = free[rank]
        if first >= 0 and end[first] > start:
            start = end[first]
        if second >= 0 and end[second] > start:
            start = end[second]
        start += costs[slot]
        end.append(start)
        free[rank] = start
    return max(free, default=0), tuple(free)
