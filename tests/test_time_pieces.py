"""The time model's pieces against closed forms: ring collectives, the roofline, the bubble."""

from __future__ import annotations

import random

import pytest

from shardplan.core.collectives import (
    ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Link, collective_seconds, ring_bytes, spans_nodes,
)
from shardplan.core.degrees import Degrees
from shardplan.core.hardware import DEFAULT_CONSTANTS, Hardware, TimeConstants
from shardplan.core.kernels import matmul, streaming
from shardplan.core.pipeline_time import _makespan_units, _simulate_units, _warm_up, run_pipeline
from shardplan.core.schedule import chunks_per_rank
from shardplan.core.stage_time import overlapped

A100 = Hardware("a100", 312e12, 19.5e12, 2039e9, 300e9, 25e9, 32e9, 409.6e9)


@pytest.mark.parametrize("ranks", [1, 2, 3, 8, 64, 1536])
def test_ring_volumes(ranks):
    # Ring algorithms (Patarasuk and Yuan 2009; Thakur et al. 2005): all-gather and
    # reduce-scatter send (n-1)/n of the whole tensor per rank, all-reduce twice that.
    size = 1e9
    assert ring_bytes(ALL_GATHER, size, ranks) == pytest.approx((ranks - 1) / ranks * size)
    assert ring_bytes(REDUCE_SCATTER, size, ranks) == pytest.approx((ranks - 1) / ranks * size)
    assert ring_bytes(ALL_REDUCE, size, ranks) == pytest.approx(2 * (ranks - 1) / ranks * size)


def test_collective_time_is_volume_over_bandwidth_plus_latency():
    link = Link("test", 100e9, 1e-5)
    assert collective_seconds(ALL_REDUCE, 8e9, 8, link) == pytest.approx(2 * 7 / 8 * 8e9 / 100e9 + 1e-5)
    assert collective_seconds(ALL_GATHER, 8e9, 1, link) == 0.0


@pytest.mark.parametrize("degrees,order,gpn,group,crosses", [
    (Degrees(tp=8, dp=2), "tp-cp-dp-pp", 8, "tp", False),
    (Degrees(tp=8, dp=2), "tp-cp-dp-pp", 8, "dp_cp", True),
    (Degrees(tp=16), "tp-cp-dp-pp", 8, "tp", True),
    (Degrees(tp=4, dp=2), "tp-cp-dp-pp", 8, "dp", False),
    (Degrees(tp=2, dp=4), "dp-tp-cp-pp", 4, "tp", True),  # tp not fastest: ranks 4 apart
    (Degrees(tp=8, pp=2), "tp-cp-dp-pp", 8, "pp", True),
    (Degrees(tp=1), "tp-cp-dp-pp", 8, "tp", False),
])
def test_which_groups_span_nodes(degrees, order, gpn, group, crosses):
    # Megatron-LM rank order (core/layout.py): rank = tp + TP*(cp + CP*(dp + DP*pp)).
    assert spans_nodes(degrees, order, gpn, group) is crosses


def test_roofline():
    c = DEFAULT_CONSTANTS
    big = matmul(8192, 8192, 8192, 2, A100.peak_flops, A100, c)
    assert big.seconds == pytest.approx(2 * 8192**3 / (A100.peak_flops * A100.matmul_efficiency) + c.matmul_overhead_seconds)
    # A matrix-vector product is bound by reading the matrix.
    skinny = matmul(1, 8192, 8192, 2, A100.peak_flops, A100, c)
    moved = 2 * (8192 + 8192 * 8192 + 8192)
    assert skinny.seconds == pytest.approx(moved / (A100.memory_bandwidth * A100.memory_efficiency) + c.matmul_overhead_seconds)
    assert streaming(1e9, A100).seconds == pytest.approx(1e9 / (A100.memory_bandwidth * A100.memory_efficiency))


def test_small_per_rank_matmuls_run_below_the_large_ones():
    # After a wide tensor-parallel split each rank multiplies narrower matrices: fewer FLOP/s.
    c = DEFAULT_CONSTANTS
    rate = lambda m, n, k: 2 * m * n * k / matmul(m, n, k, 2, A100.peak_flops, A100, c).seconds
    assert rate(4096, 14336, 4096) > rate(4096, 14336 // 8, 4096) > rate(1024, 14336 // 32, 4096)
    assert rate(4096, 14336, 4096) < A100.peak_flops * A100.matmul_efficiency


def test_overlap_hides_at_most_the_shorter():
    c = TimeConstants(overlap_efficiency=0.7)
    assert overlapped(10.0, 0.0, c) == 0.0
    assert overlapped(10.0, 4.0, c) == pytest.approx(0.3 * 4.0)  # hidden but for the interference
    assert overlapped(2.0, 10.0, c) == pytest.approx(8.0 + 0.3 * 2.0)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,microbatches", [(2, 2), (4, 8), (4, 17), (8, 8), (8, 64), (16, 100)])
def test_bubble_closed_form(schedule, pp, microbatches):
    # Unit costs: makespan (m + p - 1)(F + B), bubble (p - 1) / (m + p - 1) (Huang et al.
    # 2019; Narayanan et al. 2021, section 2.2.1).
    run = run_pipeline(schedule, pp, microbatches, 1, [(1.0, 2.0, 0.0)] * pp)
    assert run.makespan == pytest.approx((microbatches + pp - 1) * 3.0)
    assert 1 - run.busy[0] / run.makespan == pytest.approx((pp - 1) / (microbatches + pp - 1))


@pytest.mark.parametrize("pp,virtual,microbatches", [(2, 2, 4), (4, 2, 8), (4, 4, 16), (8, 2, 64), (4, 3, 400)])
def test_interleaved_bubble_closed_form(pp, virtual, microbatches):
    # Narayanan et al. 2021, section 2.2.2: with v chunks per rank the bubble shrinks by v:
    # makespan = v m (F + B) + (p - 1)(F + B), F and B per chunk.
    run = run_pipeline("interleaved-1f1b", pp, microbatches, virtual, [(1.0, 2.0, 0.0)] * (pp * virtual))
    assert run.makespan == pytest.approx(virtual * microbatches * 3.0 + (pp - 1) * 3.0)


def test_uneven_last_stage_widens_the_bubble():
    # The head and loss on the last stage slow the whole 1F1B steady state.
    even = run_pipeline("1f1b", 4, 32, 1, [(1.0, 2.0, 0.0)] * 4)
    heavy = run_pipeline("1f1b", 4, 32, 1, [(1.0, 2.0, 0.0)] * 3 + [(1.5, 3.0, 0.0)])
    assert heavy.makespan >= even.makespan + 31 * 1.5


def _costs(rng, schedule, stages, realistic):
    weight = schedule == "zero-bubble"
    if not realistic:
        return tuple((rng.randint(1, 50), rng.randint(1, 100), rng.randint(1, 40) if weight else 0) for _ in range(stages))
    f = rng.randint(100, 300)
    b, w = rng.randint(int(1.5 * f), 3 * f), (rng.randint(50, 200) if weight else 0)
    costs = [(f, b, w)] * stages
    costs[0] = (f + rng.randint(0, 50), b + rng.randint(0, 50), w)
    costs[-1] = (f + rng.randint(0, 300), b + rng.randint(0, 600), w)
    return tuple(costs)


def test_interleaved_rounds_not_of_pp_are_simulated_whole():
    # torch 2.13's ScheduleInterleaved1F1B runs m that pp does not divide in max(1, m // pp)
    # rounds of m / rounds microbatches (core/schedule.py `interleaved_rounds`); the counts
    # the extrapolation samples (multiples of pp) run rounds of pp, so such m are simulated
    # whole: the makespan is the full simulation's, where the line through those samples
    # misses it by several percent on uneven costs.
    from shardplan.core.schedule import interleaved_problem

    rng = random.Random(11)
    compared = missed = 0
    for pp in (6, 8, 12):
        for chunks in (1, 2, 3):
            for microbatches in range(_warm_up(pp, chunks) + 3 * pp + 1, pp * pp):
                if microbatches % pp == 0 or interleaved_problem(pp, microbatches):
                    continue
                costs = _costs(rng, "interleaved-1f1b", pp * chunks, realistic=False)
                exact = _simulate_units("interleaved-1f1b", pp, microbatches, chunks, costs)
                assert _makespan_units("interleaved-1f1b", pp, microbatches, chunks, costs) == (
                    exact[0], tuple(map(float, exact[1])))
                low = _warm_up(pp, chunks)
                first, second = (_simulate_units("interleaved-1f1b", pp, low + i * pp, chunks, costs)[0] for i in (0, 1))
                line = first + (microbatches - low) / pp * (second - first)
                missed += abs(line - exact[0]) / exact[0] > 0.005
                compared += 1
    assert compared > 20 and missed > 0


@pytest.mark.parametrize("realistic", [True, False])
def test_extrapolated_makespan_equals_the_full_simulation(realistic):
    # Past the warm-up a schedule repeats: the extrapolated makespan and finishes are the full
    # simulation's, exactly for even middle stages with uneven ends (the time model's stages);
    # for arbitrary random costs the period can settle late, and the error stays under 1%.
    rng = random.Random(7)
    worst = 0.0
    for _ in range(120):
        schedule = rng.choice(["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble", "round-robin"])
        pp = rng.choice([2, 3, 4, 6, 8])
        chunks = chunks_per_rank(schedule, rng.choice([1, 2, 3]))
        costs = _costs(rng, schedule, pp * chunks, realistic)
        microbatches = _warm_up(pp, chunks) + pp * rng.randint(3, 12)
        exact_span, exact_finish = _simulate_units(schedule, pp, microbatches, chunks, costs)
        span, finish = _makespan_units(schedule, pp, microbatches, chunks, costs)
        if realistic:
            assert span == exact_span and finish == pytest.approx(exact_finish), (schedule, pp, chunks, costs)
        worst = max(worst, abs(span - exact_span) / exact_span)
    assert worst < 0.01
