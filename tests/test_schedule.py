"""`shardplan schedule` and `shardplan.core.schedule`: orders, simulation, bubble, in-flight, CLI.

Expected bubbles are the published closed forms (sources next to each); the simulation
never sees them. With integer costs the simulated bubble is an exact Fraction, so the
comparisons are equalities.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import ROOT, run_cli
from shardplan.core import schedule as core
from shardplan.core.schedule import (
    MAX_GRID_CELLS,
    MAX_PP,
    ScheduleInputError,
    peak_inflight,
    plan_schedule,
    rank_orders,
)
from shardplan.core.schedule_sim import Action, Costs, ScheduleDeadlock, dependencies, simulate

UNIT = Costs(forward=1, backward=1, weight=0)
UNIT_SPLIT = Costs(forward=1, backward=1, weight=1)
SHAPES = [(p, m) for p in range(2, 9) for m in range(p, 4 * p + 1)]


def _ids(shape):
    return f"p{shape[0]}-m{shape[1]}"


# --- bubble against published closed forms -------------------------------------------------

@pytest.mark.parametrize("costs", [UNIT, Costs(1, 2, 0)], ids=["F1B1", "F1B2"])
@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_gpipe_and_1f1b_bubble(shape, costs):
    # Narayanan et al. 2021 (Megatron-LM, section 2.2.1): bubble time (p-1)(tf+tb) against
    # ideal m(tf+tb), the same for GPipe and 1F1B, whatever tf and tb; idle / total is
    # (p-1)/(m+p-1).
    p, m = shape
    for schedule in ("gpipe", "1f1b"):
        plan = plan_schedule(schedule, p, m, costs=costs)
        assert plan.bubble == Fraction(p - 1, m + p - 1), schedule
        assert plan.makespan == (m + p - 1) * (costs.forward + costs.backward)


@pytest.mark.parametrize("costs", [UNIT, Costs(1, 2, 0)], ids=["F1B1", "F1B2"])
@pytest.mark.parametrize("virtual", [2, 3, 4])
@pytest.mark.parametrize("shape", [s for s in SHAPES if s[1] % s[0] == 0], ids=_ids)
def test_interleaved_bubble(shape, virtual, costs):
    # Narayanan et al. 2021, section 2.2.2: with v chunks per rank the bubble time shrinks
    # to (p-1)(tf+tb)/v of a stage's time, i.e. idle / total = (p-1)/(v*m + p - 1) when
    # costs are per chunk.
    p, m = shape
    plan = plan_schedule("interleaved-1f1b", p, m, virtual, costs)
    assert plan.bubble == Fraction(p - 1, virtual * m + p - 1)


@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_zero_bubble_h1_bubble(shape):
    # Qi et al. 2023, section 2.1 / Figure 3 (top): with T_F = T_B = T_W, ZB-H1's bubble is a
    # third of 1F1B's: (p-1) units per rank instead of 3(p-1). The authors' README
    # (sail-sg/zero-bubble-pipeline-parallelism, "Comparison of Schedules") gives the
    # bubble rate (p-1)/3m, i.e. idle / total = (p-1)/(3m + p - 1).
    p, m = shape
    plan = plan_schedule("zero-bubble", p, m, costs=UNIT_SPLIT)
    assert plan.idle == p * (p - 1)
    assert plan.bubble == Fraction(p - 1, 3 * m + p - 1)
    one_f_one_b = plan_schedule("1f1b", p, m, costs=Costs(1, 2, 0))  # B = its B + W
    assert 3 * plan.idle == one_f_one_b.idle


@pytest.mark.parametrize("virtual", [1, 2, 3])
@pytest.mark.parametrize("p", range(1, 9))
def test_round_robin_bubble(p, virtual):
    # Looped BFS (derivation in docs/schedule.md): with unit costs the forward of chunk k
    # for microbatch i on rank r starts at k*max(m, p) + r + i, and the backward mirrors
    # the forward, so makespan = 2((v-1)max(m, p) + m + p - 1). For m >= p that is the
    # interleaved bubble (p-1)/(v*m + p - 1): breadth-first loses nothing to depth-first.
    for m in range(1, 4 * p + 1):
        plan = plan_schedule("round-robin", p, m, virtual, UNIT)
        assert plan.makespan == 2 * ((virtual - 1) * max(m, p) + m + p - 1), m
        if m >= p:
            assert plan.bubble == Fraction(p - 1, virtual * m + p - 1)


def test_bubble_is_exact():
    plan = plan_schedule("1f1b", 3, 7)
    assert isinstance(plan.bubble, Fraction)
    assert plan.bubble == Fraction(plan.idle, plan.makespan * plan.pp) == Fraction(2, 9)


# --- the orders --------------------------------------------------------------------------

def test_1f1b_order_warms_up_pp_minus_rank_minus_1_forwards():
    # PipeDream-Flush / Megatron-LM: pp - rank - 1 warm-up forwards, then F, B alternating.
    orders = rank_orders("1f1b", 4, 6)
    for rank, order in enumerate(orders):
        kinds = "".join(a.kind for a in order)
        warmup = 4 - rank - 1
        assert kinds == "F" * warmup + "FB" * (6 - warmup) + "B" * warmup
        assert [a.microbatch for a in order if a.kind == "F"] == list(range(6))
        assert [a.microbatch for a in order if a.kind == "B"] == list(range(6))


def test_zero_bubble_rank_r_delays_its_weights_by_r():
    for rank, order in enumerate(rank_orders("zero-bubble", 4, 8)):
        first_w = next(i for i, a in enumerate(order) if a.kind == "W")
        assert sum(1 for a in order[:first_w] if a.kind == "B") == rank + 1


def test_loop_placement_and_every_item_once():
    for schedule, virtual in [("interleaved-1f1b", 3), ("round-robin", 3), ("gpipe", 1), ("zero-bubble", 1)]:
        orders = rank_orders(schedule, 4, 8, virtual)
        kinds = "FBW" if schedule == "zero-bubble" else "FB"
        expected = {Action(k, i, s) for k in kinds for i in range(8) for s in range(4 * virtual)}
        assert sorted(a for o in orders for a in o) == sorted(expected)
        for rank, order in enumerate(orders):
            assert {a.stage % 4 for a in order} == {rank}


# --- the simulation ----------------------------------------------------------------------

def _check_timeline(plan):
    """Every span obeys the rules: listed order, one at a time, deps first, as early as allowed."""
    end = {s.action: s.end for rank in plan.timeline.spans for s in rank}
    for rank, spans in enumerate(plan.timeline.spans):
        assert [s.action for s in spans] == plan.orders[rank]
        free = 0
        for span in spans:
            deps = dependencies(span.action, plan.num_stages)
            assert span.start == max([free, *(end[d] for d in deps)])
            assert span.end - span.start == plan.costs.of(span.action.kind)
            free = span.end
    assert plan.makespan == max(end.values())


COSTS = st.builds(Costs, st.integers(1, 4), st.integers(1, 4), st.just(0))


@settings(max_examples=60, deadline=None)
@given(schedule=st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "round-robin"]),
       p=st.integers(1, 6), k=st.integers(1, 4), virtual=st.integers(1, 3), costs=COSTS)
def test_simulation_rules_hold(schedule, p, k, virtual, costs):
    virtual = virtual if schedule in core.CHUNKED_SCHEDULES else 1
    plan = plan_schedule(schedule, p, p * k, virtual, costs)
    _check_timeline(plan)
    assert plan.makespan >= plan.ideal
    assert plan.idle == plan.makespan * p - p * plan.ideal
    # Narayanan et al. 2021, section 2.2: the bubble does not depend on tf and tb.
    if schedule in ("gpipe", "1f1b"):
        assert plan.bubble == Fraction(p - 1, p * k + p - 1)
    if schedule == "interleaved-1f1b":
        assert plan.bubble == Fraction(p - 1, virtual * p * k + p - 1)


@settings(max_examples=30, deadline=None)
@given(p=st.integers(1, 6), k=st.integers(1, 4), f=st.integers(1, 3), b=st.integers(1, 3), w=st.integers(1, 3))
def test_zero_bubble_simulation_rules_hold(p, k, f, b, w):
    plan = plan_schedule("zero-bubble", p, p * k, costs=Costs(f, b, w))
    _check_timeline(plan)


def test_grid_has_one_cell_per_time_unit():
    # By hand, F = 1, B = 2. Rank 1 (no warm-up): F0 [1,2) after rank 0's F0, B0 [2,4),
    # F1 [4,5), B1 [5,7). Rank 0 (warm-up F0): F0 [0,1), F1 [1,2), B0 waits for rank 1's
    # B0: [4,6), B1 waits for rank 1's B1: [7,9).
    plan = plan_schedule("1f1b", 2, 2, costs=Costs(1, 2, 0))
    labels = [[f"{a.kind}{a.microbatch}" if a else None for a in row] for row in plan.timeline.grid()]
    assert labels == [
        ["F0", "F1", None, None, "B0", "B0", None, "B1", "B1"],
        [None, "F0", "B0", "B0", "F1", "B1", "B1", None, None],
    ]


def test_deadlocked_order_is_reported_not_hung():
    # Rank 0 insists on B0 before its own F0 ever runs: no order of events can finish it.
    orders = [[Action("B", 0, 0), Action("F", 0, 0)], [Action("F", 0, 1), Action("B", 0, 1)]]
    with pytest.raises(ScheduleDeadlock, match="rank 0 waits at B0"):
        simulate(orders, 2, Costs())


def test_deadlock_reaches_the_user_as_an_internal_error(monkeypatch):
    def backwards_first(pp, m, v, rank):
        return [core.Action("B", i, rank) for i in range(m)] + [core.Action("F", i, rank) for i in range(m)]

    monkeypatch.setitem(core._BUILDERS, "gpipe", backwards_first)
    result = run_cli("schedule", "--pp", "2", "--microbatches", "2", "--schedule", "gpipe")
    assert result.code == 3
    assert result.err_lines == [result.err_lines[0]]
    assert "internal error: ScheduleDeadlock" in result.err and "Traceback" not in result.err


# --- microbatches in flight --------------------------------------------------------------

@pytest.mark.parametrize("shape", SHAPES, ids=_ids)
def test_inflight_known_values(shape):
    p, m = shape
    assert peak_inflight("1f1b", p, m) == [p - r for r in range(p)]  # PipeDream-Flush: pp - rank
    assert peak_inflight("gpipe", p, m) == [m] * p  # GPipe keeps every microbatch
    assert peak_inflight("round-robin", p, m, 2) == [2 * m] * p
    # ZB-H1 counted until W: every rank peaks at pp, the peak of 1F1B's first rank, so the
    # largest rank is the same as 1F1B's (Qi et al. 2023, section 2.1).
    assert peak_inflight("zero-bubble", p, m) == [p] * p
    if m % p == 0:
        # Megatron-LM's warm-up of (v-1)p + 2(p-1-r) forwards, plus the first steady one.
        assert peak_inflight("interleaved-1f1b", p, m, 2) == [min(p + 2 * (p - 1 - r) + 1, 2 * m) for r in range(p)]


@pytest.mark.parametrize("schedule, virtual", [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2),
                                               ("round-robin", 3), ("zero-bubble", 1)])
def test_inflight_matches_the_timeline(schedule, virtual):
    # Count held pairs over simulated time instead of along the order: the same peaks.
    plan = plan_schedule(schedule, 4, 8, virtual)
    release = "W" if schedule == "zero-bubble" else "B"
    for rank, spans in enumerate(plan.timeline.spans):
        start = {s.action[1:]: s.start for s in spans if s.action.kind == "F"}
        end = {s.action[1:]: s.end for s in spans if s.action.kind == release}
        held = [sum(1 for key in start if start[key] <= t < end[key]) for t in range(plan.makespan)]
        assert max(held) == plan.inflight[rank]


# --- rejected input ----------------------------------------------------------------------

@pytest.mark.parametrize("args, field, needle", [
    (("1f1b", 4, 3, 1), "microbatches", "1f1b needs at least pp (4) microbatches to fill the pipeline (got 3)"),
    (("zero-bubble", 4, 2, 1), "microbatches", "zero-bubble needs at least pp (4)"),
    (("interleaved-1f1b", 4, 9, 2), "microbatches", "needs microbatches divisible by pp (4) or by its max(1, m // pp) = 2 rounds (got 9)"),
    (("gpipe", 4, 8, 2), "virtual", "2 chunks per rank need interleaved-1f1b or round-robin"),
    (("zero-bubble", 4, 8, 2), "virtual", "zero-bubble places one stage per rank"),
    (("1f1b", 0, 8, 1), "pp", "must be >= 1 (got 0)"),
    (("1f1b", -2, 8, 1), "pp", "must be >= 1 (got -2)"),
    (("1f1b", MAX_PP + 1, 10**4, 1), "pp", f"must be <= {MAX_PP}"),
    (("gpipe", 2, 10**30, 1), "microbatches", "must be <= "),
    (("round-robin", 2, 4, 0), "virtual", "must be >= 1"),
    (("round-robin", 256, 4097, 1), "microbatches", "(microbatch, stage) pairs exceed"),
    (("1f1b", 2, True, 1), "microbatches", "must be an integer"),
    (("interleaved", 2, 4, 1), "schedule", "did you mean 'interleaved-1f1b'?"),
])
def test_rejections(args, field, needle):
    with pytest.raises(ScheduleInputError) as info:
        peak_inflight(*args)
    assert info.value.field == field
    assert needle in info.value.message


def test_grid_bound():
    with pytest.raises(ScheduleInputError, match=f"more than the {MAX_GRID_CELLS} shardplan draws"):
        plan_schedule("gpipe", 64, 2048, costs=Costs(1, 2, 0))
    with pytest.raises(ScheduleInputError, match="costed by --cost-b"):
        plan_schedule("1f1b", 2, 2, costs=Costs(1, 2, 1))
    with pytest.raises(ScheduleInputError, match="must be >= 1"):
        plan_schedule("zero-bubble", 2, 2, costs=Costs(1, 1, 0))


# --- the CLI -----------------------------------------------------------------------------

def schedule_cli(*args):
    return run_cli("schedule", *args)


def test_json_document():
    result = schedule_cli("--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert list(doc)[:7] == ["schema_version", "schedule", "pp", "microbatches", "virtual", "stages", "costs"]
    assert doc["schema_version"] == 1 and doc["schedule"] == "1f1b" and doc["virtual"] == 1
    assert doc["costs"] == {"F": 1, "B": 2}
    assert doc["inflight"] == [4, 3, 2, 1]
    assert len(doc["grid"]) == 4 and {len(row) for row in doc["grid"]} == {doc["makespan"]}
    assert doc["makespan"] == 33 and doc["ideal"] == 24  # (m + p - 1)(F + B); m (F + B)
    idle = sum(cell is None for row in doc["grid"] for cell in row)
    assert doc["idle"] == idle
    assert doc["bubble_fraction"] == pytest.approx(idle / (doc["makespan"] * 4)) == 3 / 11
    assert doc["grid"][0][:6] == ["F0", "F1", "F2", "F3", None, None]
    assert result.err == ""


def test_json_names_stages_when_ranks_hold_chunks():
    doc = schedule_cli("--pp", "2", "--microbatches", "2", "--schedule", "interleaved-1f1b",
                       "--virtual", "2", "--json").json
    assert doc["grid"][0][:2] == ["F0s0", "F1s0"] and doc["stages"] == 4
    assert any(cell == "B1s3" for row in doc["grid"] for cell in row)
    zb = schedule_cli("--pp", "2", "--microbatches", "2", "--schedule", "zero-bubble", "--json").json
    assert zb["costs"] == {"F": 1, "B": 1, "W": 1}
    assert any(cell == "W1" for row in zb["grid"] for cell in row)


def test_costs_flags():
    doc = schedule_cli("--pp", "2", "--microbatches", "2", "--schedule", "gpipe", "--cost-f", "3",
                       "--cost-b", "5", "--json").json
    assert doc["costs"] == {"F": 3, "B": 5}
    assert doc["grid"][0][:3] == ["F0", "F0", "F0"]
    assert doc["makespan"] == (2 + 2 - 1) * 8


def test_terminal_picture():
    result = schedule_cli("--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
    assert result.code == 0, result.err
    lines = result.out.splitlines()
    assert lines[0] == "1f1b: pp 4, 8 microbatches"
    assert "rank 0  F0 F1 F2 F3 ·  ·  ·  ·  ·  ·  B0 B0 F4 B1 B1" in result.out
    assert "rank 3  ·  ·  ·  F0 B0 B0 F1 B1 B1" in result.out
    assert "bubble 27.3% = 36 idle / 132 (33 x 4 ranks) = 3/11" in result.out
    assert "peak microbatches in flight per rank (0..3): 4, 3, 2, 1" in result.out
    assert max(len(line) for line in lines) <= 80  # wrapped into bands, not cut


@pytest.mark.parametrize("args, needle", [
    (["--pp", "4", "--microbatches", "3", "--schedule", "1f1b"],
     "--microbatches: 1f1b needs at least pp (4) microbatches to fill the pipeline (got 3)"),
    (["--pp", "4", "--microbatches", "2", "--schedule", "zero-bubble"], "--microbatches: zero-bubble needs"),
    (["--pp", "4", "--microbatches", "9", "--schedule", "interleaved-1f1b", "--virtual", "2"],
     "--microbatches: interleaved-1f1b needs microbatches divisible by pp (4) or by its max(1, m // pp) = 2 rounds (got 9)"),
    (["--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--virtual", "2"], "--virtual: 2 chunks per rank"),
    (["--pp", "0", "--microbatches", "4", "--schedule", "gpipe"], "--pp: must be >= 1 (got 0)"),
    (["--pp", "-3", "--microbatches", "4", "--schedule", "gpipe"], "--pp: must be >= 1 (got -3)"),
    (["--pp", "4", "--microbatches", "99999999999999999999", "--schedule", "gpipe"], "--microbatches: must be <="),
    (["--pp", "4", "--microbatches", "4", "--schedule", "gpipe", "--virtual", "100"], "--virtual: must be <= 64"),
    (["--pp", "four", "--microbatches", "4", "--schedule", "gpipe"], "'--pp'"),
    (["--pp", "4", "--microbatches", "4", "--schedule", "1f1f"], "--schedule: unknown schedule '1f1f' (did you mean '1f1b'?"),
    (["--pp", "4", "--microbatches", "4", "--schedule", "1F1B"], "--schedule: unknown schedule '1F1B' (did you mean '1f1b'?"),
    (["--pp", "4", "--microbatches", "4", "--schedule", "1f1b", "--cost-w", "1"], "--cost-w: only zero-bubble splits"),
    (["--pp", "4", "--microbatches", "4", "--schedule", "1f1b", "--cost-f", "0"], "--cost-f: must be >= 1 (got 0)"),
    (["--pp", "4", "--microbatches", "4", "--schedule", "1f1b", "--cost-b", "1000"], "--cost-b: must be <= 100"),
    (["--pp", "64", "--microbatches", "2048", "--schedule", "gpipe"], "more than the 262144 shardplan draws"),
    (["--microbatches", "4", "--schedule", "gpipe"], "--pp: required (or give a job FILE that sets parallel.pp)"),
])
def test_cli_rejections(args, needle):
    result = schedule_cli(*args)
    assert result.code == 2, (result.out, result.err)
    assert len(result.err_lines) == 1, result.err
    assert needle in result.err_lines[0]
    assert "Traceback" not in result.err and result.out == ""


def test_missing_everything_lists_each_flag():
    result = schedule_cli()
    assert result.code == 2
    assert [line.split(":")[0] for line in result.err_lines] == ["--pp", "--microbatches", "--schedule"]


def test_job_file_values_and_flag_overrides(write):
    path = write("job.toml", '[parallel]\npp = 4\nnum_microbatches = 8\npipeline_schedule = "interleaved-1f1b"\n'
                             "virtual_stages = 2\n")
    doc = schedule_cli(path, "--json").json
    assert (doc["schedule"], doc["pp"], doc["microbatches"], doc["virtual"]) == ("interleaved-1f1b", 4, 8, 2)
    doc = schedule_cli(path, "--microbatches", "12", "--schedule", "round-robin", "--json").json
    assert (doc["schedule"], doc["pp"], doc["microbatches"], doc["virtual"]) == ("round-robin", 4, 12, 2)
    # A flag that breaks the file's combination is the one blamed.
    result = schedule_cli(path, "--microbatches", "9")
    assert result.err_lines == ["--microbatches: interleaved-1f1b needs microbatches divisible by pp (4) or by its max(1, m // pp) = 2 rounds (got 9)"]
    # A value the file holds, beyond what schedule plans, is blamed on the file's key.
    big = write("big.toml", "[parallel]\npp = 512\nnum_microbatches = 512\n")
    result = schedule_cli(big)
    assert result.err_lines == [f"{big}: parallel.pp: must be <= {MAX_PP} (got 512)"]


def test_job_file_errors_and_presets(write):
    bad = write("bad.toml", "[parallel]\npp = 4\nnum_microbatches = 2\n")
    result = schedule_cli(bad)
    assert result.code == 2
    assert result.err_lines == [f"{bad}:3: parallel.num_microbatches: 1f1b needs at least pp (4) microbatches "
                                "to fill the pipeline (got 2)"]
    assert schedule_cli(write("x.toml", "[parallel\n")).code == 2
    assert "no such file or job preset" in schedule_cli("no-such-job").err
    preset = schedule_cli("llama-2-70b-3d", "--json")
    assert preset.code == 0, preset.err
    assert preset.json["pp"] >= 1


def test_world_size_does_not_matter(write):
    # The schedule only needs the pipeline keys: torchrun's WORLD_SIZE is no reason to fail.
    path = write("job.toml", "[parallel]\npp = 2\nnum_microbatches = 2\n")
    assert run_cli("schedule", path, "--json", env={"WORLD_SIZE": "7"}).code == 0


def test_svg_flag_writes_the_file(tmp_path):
    target = tmp_path / "pipe.svg"
    result = schedule_cli("--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--svg", str(target), "--json")
    assert result.code == 0, result.err
    assert json.loads(result.out)["pp"] == 2  # stdout keeps only the JSON
    assert target.read_text(encoding="utf-8").startswith("<?xml")
    assert result.err_lines == [f"wrote {target}"]
    bad = schedule_cli("--pp", "2", "--microbatches", "4", "--schedule", "1f1b", "--svg", str(tmp_path / "no" / "x.svg"))
    assert bad.code == 2 and bad.err_lines[0].startswith("--svg: cannot write")


def test_schedule_never_imports_torch(tmp_path):
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torch is blocked in this test')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT)]))
    env.pop("WORLD_SIZE", None)
    svg = tmp_path / "s.svg"
    proc = subprocess.run(
        [sys.executable, "-m", "shardplan", "schedule", "--pp", "4", "--microbatches", "8",
         "--schedule", "zero-bubble", "--svg", str(svg), "--json"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    code = ("import sys, shardplan.core.schedule, shardplan.render.schedule, shardplan.cli.schedule_cmd; "
            "assert 'torch' not in sys.modules")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_set_overrides_reach_the_schedule():
    result = run_cli("schedule", "--pp", "2", "--set", "parallel.num_microbatches=3",
                     "--set", "parallel.pipeline_schedule=gpipe", "--json")
    assert result.code == 0, result.err
    assert (result.json["schedule"], result.json["microbatches"]) == ("gpipe", 3)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "round-robin"]),
       st.integers(2, 6), st.integers(1, 4), st.integers(1, 3), st.data())
def test_integer_walk_equals_the_simulation(schedule, pp, rounds, virtual, data):
    """The time model's compiled orders (integers, ends only) place every action where
    `simulate` does: the same makespan and the same last end on every rank, for any stage costs."""
    from shardplan.core.schedule import chunks_per_rank, rank_order
    from shardplan.core.schedule_sim import StageCosts, compile_orders, encode_orders, run_compiled

    chunks = chunks_per_rank(schedule, virtual)
    microbatches = pp * rounds
    weight = schedule == "zero-bubble"
    per_stage = tuple((data.draw(st.integers(1, 50)), data.draw(st.integers(1, 90)),
                       data.draw(st.integers(1, 40)) if weight else 0) for _ in range(pp * chunks))
    orders = [rank_order(schedule, pp, microbatches, chunks, rank) for rank in range(pp)]
    timeline = simulate(orders, pp * chunks, StageCosts(per_stage))
    expected = (timeline.makespan, tuple(spans[-1].end for spans in timeline.spans))
    assert run_compiled(compile_orders(encode_orders(orders), pp * chunks), per_stage) == expected


@pytest.mark.parametrize("pp, microbatches", [(4, 8), (2, 4), (8, 16)])
def test_interleaved_with_one_chunk_per_rank_warns_with_the_simulated_peak(pp, microbatches):
    """Interleaved 1F1B with one chunk per rank has 1F1B's bubble but holds more microbatches
    on the first rank (torch's ScheduleInterleaved1F1B warm-up, which the simulation follows):
    the warning's two counts are the simulated peaks of rank 0 under each schedule."""
    args = ("schedule", "--pp", str(pp), "--microbatches", str(microbatches))
    interleaved = run_cli(*args, "--schedule", "interleaved-1f1b", "--json")
    one_f_one_b = run_cli(*args, "--schedule", "1f1b", "--json")
    held, fewer = interleaved.json["inflight"][0], one_f_one_b.json["inflight"][0]
    assert interleaved.json["bubble_fraction"] == one_f_one_b.json["bubble_fraction"] and held > fewer
    assert interleaved.err_lines == [f"warning: --virtual: 1 chunk per rank: interleaved-1f1b holds up to {held} "
                                     f"microbatches on the first rank where 1f1b holds {fewer}, for the same bubble; "
                                     "give more virtual stages, or the 1f1b schedule"]
    assert run_cli(*args, "--schedule", "interleaved-1f1b", "--virtual", "2").err_lines == []
