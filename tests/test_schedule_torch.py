"""Our per-rank orders against torch.distributed.pipelining's own schedules (torch 2.13).

torch's schedule classes compute `pipeline_order` (per rank, a list of `_Action` or None)
in their constructor, without running anything; only compute actions are compared (F, B,
I = input-gradient backward, W), never torch's communication or REDUCE_GRAD actions, and
torch's None padding (its own idea of time) is ignored. Findings, torch 2.13.0:

- gpipe = ScheduleGPipe, round-robin = ScheduleLoopedBFS, interleaved-1f1b =
  ScheduleInterleaved1F1B: identical on every rank. interleaved-1f1b also for the
  microbatch counts pp does not divide that torch runs (its max(1, m // pp) rounds must
  divide m; fewer microbatches than pp make one round), and refused where torch refuses.
- zero-bubble = ScheduleInterleavedZeroBubble with ONE stage per rank (torch's docstring:
  "implementing the ZB1P schedule"; with one local stage it is ZB-H1): identical wherever
  torch accepts the microbatch count. torch refuses m that is not a multiple of its
  "rounds" max(1, m // pp), a restriction of its interleaved bookkeeping that ZB-H1 itself
  does not have; we accept any m >= pp.
- 1f1b = Schedule1F1B: identical on every rank but the last, where torch lists forwards of
  microbatches 1..m instead of 0..m-1 (its simulated list would deadlock; real runs take
  another code path). There we check the standard warm-up (pp - rank - 1 = 0 forwards,
  then F0 B0 F1 B1 ...) and that torch's list is exactly ours with forward indices + 1, so
  the test notices when torch fixes it.
"""

from __future__ import annotations

from unittest import mock

import pytest

torch = pytest.importorskip("torch")
schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops  # noqa: E402
from torch.distributed.pipelining.stage import PipelineStage  # noqa: E402

from shardplan.core.schedule import rank_orders  # noqa: E402

pytestmark = pytest.mark.torch

CT = schedules._ComputationType
KIND = {CT.FORWARD: "F", CT.FULL_BACKWARD: "B", CT.BACKWARD_INPUT: "B", CT.BACKWARD_WEIGHT: "W"}
TORCH_CLASS = {
    "gpipe": schedules.ScheduleGPipe,
    "1f1b": schedules.Schedule1F1B,
    "interleaved-1f1b": schedules.ScheduleInterleaved1F1B,
    "round-robin": schedules.ScheduleLoopedBFS,
    "zero-bubble": schedules.ScheduleInterleavedZeroBubble,
}


def torch_orders(schedule: str, pp: int, m: int, virtual: int) -> list[list[tuple]]:
    """torch's compute actions per rank, as (kind, microbatch, stage).

    Built as torch's own `_schedule_visualizer.get_schedule_ops` builds them (a mocked
    PipelineStage), but also for one stage per rank with the multi-stage classes, which
    get_schedule_ops refuses.
    """
    cls = TORCH_CLASS[schedule]
    stage = mock.create_autospec(PipelineStage, instance=True)
    stage.group_rank, stage.group_size, stage.submod = 0, pp, None
    stage.num_stages = pp * virtual
    stages = stage if issubclass(cls, schedules.PipelineScheduleSingle) else [stage] * virtual
    order = cls(stages, m).pipeline_order
    return [
        [(KIND[a.computation_type], a.microbatch_index, a.stage_index)
         for a in order[rank] if a is not None and a.computation_type in KIND]
        for rank in range(pp)
    ]


def ours(schedule: str, pp: int, m: int, virtual: int) -> list[list[tuple]]:
    return [[tuple(a) for a in rank] for rank in rank_orders(schedule, pp, m, virtual)]


SHAPES = [(p, m) for p in range(1, 9) for m in range(p, 4 * p + 1)]


@pytest.mark.parametrize("schedule, virtuals", [
    ("gpipe", [1]),
    ("round-robin", [1, 2, 3]),
    ("interleaved-1f1b", [1, 2, 3, 4]),
])
def test_identical_to_torch(schedule, virtuals):
    from shardplan.core.schedule import interleaved_problem

    compared = 0
    for p, m in SHAPES:
        if schedule == "interleaved-1f1b" and interleaved_problem(p, m):
            continue  # refused by both (the next test)
        for v in virtuals:
            assert ours(schedule, p, m, v) == torch_orders(schedule, p, m, v), (p, m, v)
            compared += 1
    assert compared > 100


def test_interleaved_takes_the_microbatch_counts_torch_takes():
    # Every count from 1 to past pp * pp (beyond it only multiples of pp divide into the
    # rounds): ours equals torch's order where torch builds one and refuses where torch does.
    from shardplan.core.schedule import ScheduleInputError

    built = refused = flexible = 0
    for p in range(2, 7):
        for m in range(1, p * p + 2 * p):
            for v in (1, 3):
                try:
                    theirs = torch_orders("interleaved-1f1b", p, m, v)
                except ValueError as exc:
                    assert "multiple of the number of rounds" in str(exc)
                    with pytest.raises(ScheduleInputError, match=r"divisible by pp \(\d+\) or by its max\(1, m // pp\)"):
                        ours("interleaved-1f1b", p, m, v)
                    refused += 1
                    continue
                assert ours("interleaved-1f1b", p, m, v) == theirs, (p, m, v)
                built += 1
                flexible += m % p != 0
    assert built > 120 and refused > 100 and flexible > 80


def test_zero_bubble_is_torch_zb_with_one_stage_per_rank():
    compared = refused = 0
    for p, m in SHAPES:
        rounds = max(1, m // p)
        if m % rounds:
            with pytest.raises(ValueError, match="multiple of the number of rounds"):
                torch_orders("zero-bubble", p, m, 1)
            refused += 1
            continue
        assert ours("zero-bubble", p, m, 1) == torch_orders("zero-bubble", p, m, 1), (p, m)
        compared += 1
    assert compared > 50 and refused > 0


def test_1f1b_matches_torch_but_its_last_rank_off_by_one():
    for p, m in SHAPES:
        mine, theirs = ours("1f1b", p, m, 1), torch_orders("1f1b", p, m, 1)
        assert mine[:-1] == theirs[:-1], (p, m)
        last = mine[-1]
        assert [k for k, _, _ in last] == ["F", "B"] * m  # warm-up pp - (pp-1) - 1 = 0
        assert [i for k, i, _ in last if k == "F"] == list(range(m))
        assert theirs[-1] == [(k, i + 1 if k == "F" else i, s) for k, i, s in last], (p, m)


def test_get_schedule_ops_agrees_with_the_helper():
    # The documented entry point, where it accepts the arguments, gives the same lists.
    for name, schedule, virtual in [("Interleaved1F1B", "interleaved-1f1b", 2), ("LoopedBFS", "round-robin", 3),
                                    ("GPipe", "gpipe", None)]:
        ops = get_schedule_ops(name, 4, 8, virtual)
        listed = [[(KIND[a.computation_type], a.microbatch_index, a.stage_index)
                   for a in rank if a is not None and a.computation_type in KIND] for rank in ops]
        assert listed == torch_orders(schedule, 4, 8, virtual or 1) == ours(schedule, 4, 8, virtual or 1)
