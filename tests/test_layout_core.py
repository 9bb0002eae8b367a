"""Rank layout: exhaustive over every (dp, tp, pp, cp) of worlds up to 64, hypothesis beyond,
and Megatron-LM's published group enumeration.

The independent formula each layout is checked against is CONTRACT's: with the order's axes
a0 (fastest) .. a3, rank = c(a0) + D(a0) * (c(a1) + D(a1) * (c(a2) + D(a2) * c(a3))).
"""

from __future__ import annotations

import itertools
from math import comb, prod

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from shardplan.core.degrees import Degrees
from shardplan.core.layout import (
    AXIS_GROUPS, COMBINED_GROUPS, EMBEDDING_GROUP, GROUP_NAMES, Layout, format_ranks, hybrid_shard_groups,
    layout_problems, layout_warnings, mesh_dims, shard_group_size,
)
from shardplan.spec.common import MAX_WORLD_SIZE
from shardplan.spec.errors import PlanError

AXES = ("tp", "cp", "dp", "pp")
ORDERS = ["-".join(p) for p in itertools.permutations(AXES)]


def factorizations(max_world: int):
    """Every (dp, tp, pp, cp) whose product is at most max_world."""
    for dp in range(1, max_world + 1):
        for tp in range(1, max_world // dp + 1):
            for pp in range(1, max_world // (dp * tp) + 1):
                for cp in range(1, max_world // (dp * tp * pp) + 1):
                    yield dp, tp, pp, cp


def nested_rank(order: str, degrees: Degrees, coords: dict) -> int:
    """CONTRACT's nested formula, written from the slowest axis outwards."""
    axes = order.split("-")
    rank = 0
    for axis in reversed(axes):
        rank = coords[axis] + degrees.of(axis) * rank
    return rank


def check_layout(grid: Layout) -> None:
    """Every property a layout must have; O(world * groups)."""
    world, degrees = grid.world, grid.degrees
    columns = {axis: grid.column(axis) for axis in AXIS_GROUPS}
    seen = set()
    for rank in range(world):
        coords = {axis: columns[axis][rank] for axis in AXIS_GROUPS}
        assert coords == grid.coords(rank)
        assert all(0 <= coords[a] < degrees.of(a) for a in AXIS_GROUPS)
        assert grid.rank_of(**coords) == rank == nested_rank(grid.order_string, degrees, coords)
        seen.add(tuple(coords.values()))
    assert len(seen) == world  # a bijection between ranks and coordinates

    for name in GROUP_NAMES:
        groups = grid.groups(name)
        spanned = grid.group_axes(name)
        lows = [g[0] for g in groups]
        assert lows == sorted(lows), name
        for group in groups:
            assert group == sorted(group), name
            others = {tuple(columns[a][r] for a in AXIS_GROUPS if a not in spanned) for r in group}
            assert len(others) == 1, (name, group)  # only the group's own axes vary
        if name == EMBEDDING_GROUP:
            pp_groups = grid.groups("pp")
            assert groups == [[g[0], g[-1]] if len(g) > 1 else [g[0]] for g in pp_groups]
            continue
        size = 1
        for axis in spanned:
            size *= degrees.of(axis)
        assert all(len(g) == size for g in groups), name
        flat = [r for g in groups for r in g]
        assert sorted(flat) == list(range(world)), name  # a partition of the ranks
        if name in AXIS_GROUPS:
            for group in groups:
                assert [columns[name][r] for r in group] == list(range(degrees.of(name)))
    for rank in (0, world // 2, world - 1):
        for name in GROUP_NAMES:
            group = grid.group_of(name, rank)
            assert group in grid.groups(name)
            assert rank in group or name == EMBEDDING_GROUP


def ordered_factorizations(world: int) -> int:
    """d_4(world): prod over prime powers p^e of C(e + 3, 3) (multiplicative, independent of
    the enumeration above)."""
    count, n, p = 1, world, 2
    while n > 1:
        e = 0
        while n % p == 0:
            n, e = n // p, e + 1
        count *= comb(e + 3, 3)
        p += 1
    return count


def test_every_factorization_up_to_64():
    """All 1,824 factorizations of worlds 1..64, each under one of the 24 orders in turn (every
    order is used 76 times), plus the default order for all of them."""
    count = 0
    for index, (dp, tp, pp, cp) in enumerate(factorizations(64)):
        degrees = Degrees(dp=dp, tp=tp, pp=pp, cp=cp)
        for order in {ORDERS[index % len(ORDERS)], "tp-cp-dp-pp"}:
            check_layout(Layout(degrees, order, gpus_per_node=1 + index % 9))
        count += 1
    assert count == sum(ordered_factorizations(w) for w in range(1, 65))


@pytest.mark.parametrize("order", ORDERS)
def test_every_order_on_a_full_4d_grid(order):
    check_layout(Layout(Degrees(dp=3, tp=2, pp=4, cp=2), order, 8))


@settings(max_examples=30, deadline=None)
@given(
    exponents=st.tuples(*[st.integers(0, 5)] * 4),
    odd=st.tuples(*[st.sampled_from([1, 1, 3, 5])] * 4),
    order=st.sampled_from(ORDERS),
    gpn=st.sampled_from([1, 2, 4, 6, 8, 16, 72]),
)
def test_large_worlds(exponents, odd, order, gpn):
    """Worlds up to 2^20 ranks: properties on the whole grid where it is small enough to
    check in time, else on sampled ranks and the tp partition."""
    sizes = [2**e * o for e, o in zip(exponents, odd)]
    assume(prod(sizes) <= MAX_WORLD_SIZE)
    degrees = Degrees(dp=sizes[0], tp=sizes[1], pp=sizes[2], cp=sizes[3])
    grid = Layout(degrees, order, gpn)
    if grid.world <= 1024:
        check_layout(grid)
        return
    for rank in {0, 1, grid.world // 3, grid.world - 1}:
        coords = grid.coords(rank)
        assert grid.rank_of(**coords) == rank == nested_rank(order, degrees, coords)
        for name in AXIS_GROUPS:
            group = grid.group_of(name, rank)
            assert [grid.coords(r)[name] for r in group] == list(range(degrees.of(name)))
    tp_groups = grid.groups("tp")
    assert sorted(r for g in tp_groups for r in g) == list(range(grid.world))


def test_default_order_formula():
    """CONTRACT: tp-cp-dp-pp means rank = tp + TP*(cp + CP*(dp + DP*pp))."""
    d = Degrees(dp=3, tp=4, pp=2, cp=2)
    grid = Layout(d)
    for rank in range(d.world):
        c = grid.coords(rank)
        assert rank == c["tp"] + 4 * (c["cp"] + 2 * (c["dp"] + 3 * c["pp"]))


def test_pp_fastest_order():
    """CONTRACT: `pp-tp-dp` is the "[dp][tp][pp], pp fastest" layout."""
    d = Degrees(dp=2, tp=3, pp=4)
    grid = Layout(d, "pp-tp-dp")
    expected = [(dp, tp, pp) for dp in range(2) for tp in range(3) for pp in range(4)]
    assert [(c["dp"], c["tp"], c["pp"]) for c in map(grid.coords, range(24))] == expected


# Megatron-LM, NVIDIA/Megatron-LM megatron/core/parallel_state.py (commit
# 00caa53af30912914981c86f39db123961678bbd), `initialize_model_parallel` docstring:
# "16 GPUs ... use 2 GPUs to parallelize the model tensor, and 4 GPUs to parallelize the
# model pipeline" with its default order (tp-cp-ep-dp-pp; cp = ep = 1 here).
MEGATRON_DP = [[0, 2], [1, 3], [4, 6], [5, 7], [8, 10], [9, 11], [12, 14], [13, 15]]
MEGATRON_TP = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]
MEGATRON_PP = [[0, 4, 8, 12], [1, 5, 9, 13], [2, 6, 10, 14], [3, 7, 11, 15]]


def test_megatron_docstring_groups():
    grid = Layout(Degrees(dp=2, tp=2, pp=4), "tp-cp-dp-pp", 8)
    assert grid.groups("dp") == MEGATRON_DP
    assert grid.groups("tp") == MEGATRON_TP
    assert grid.groups("pp") == MEGATRON_PP
    # Megatron's embedding group: first and last rank of each pipeline group
    # (`default_embedding_ranks`).
    assert grid.groups("embedding") == [[g[0], g[-1]] for g in MEGATRON_PP]


def test_megatron_masked_enumeration_docstring():
    """Same file, `generate_masked_orthogonal_rank_groups` docstring: order tp-pp-dp with
    sizes 2-2-2 gives dp groups [[0, 4], [1, 5], [2, 6], [3, 7]]; parallel_size
    [tp, dp, pp] = [2, 3, 4] gives dp_group[0] = [0, 2, 4], dp_group[1] = [1, 3, 5] and
    dp_group[7] = [19, 21, 23]."""
    assert Layout(Degrees(dp=2, tp=2, pp=2), "tp-pp-dp").groups("dp") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    dp_groups = Layout(Degrees(dp=3, tp=2, pp=4), "tp-dp-pp").groups("dp")
    assert dp_groups[0] == [0, 2, 4] and dp_groups[1] == [1, 3, 5] and dp_groups[7] == [19, 21, 23]


def test_combined_groups_are_megatron_masks():
    """dp_cp = Megatron's 'dp-cp' mask: with tp 2, cp 2, dp 2 (default order) the ranks of
    one data-parallel replica group are tp-stride apart over cp and dp."""
    grid = Layout(Degrees(dp=2, tp=2, cp=2))
    assert grid.groups("dp_cp") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert grid.groups("tp_cp") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert grid.groups("mp") == [[0, 1], [2, 3], [4, 5], [6, 7]]  # tp x pp, not cp
    assert set(COMBINED_GROUPS) <= set(GROUP_NAMES)


def test_pipeline_neighbours():
    grid = Layout(Degrees(dp=2, tp=2, pp=3))
    for group in grid.groups("pp"):
        assert grid.pp_prev(group[0]) is None and grid.pp_next(group[-1]) is None
        for before, after in zip(group, group[1:]):
            assert grid.pp_next(before) == after and grid.pp_prev(after) == before


def test_nodes_and_local_ranks():
    grid = Layout(Degrees(dp=3, tp=4), gpus_per_node=6)
    assert grid.num_nodes == 2
    assert [grid.node_of(r) for r in range(12)] == [0] * 6 + [1] * 6
    assert [grid.local_rank(r) for r in range(12)] == list(range(6)) * 2


def test_warning_tp_spans_nodes_contract_example():
    """CONTRACT's example warning: `tp group [0, 8] spans nodes 0 and 1`."""
    grid = Layout(Degrees(dp=8, tp=2), "dp-tp", 8)
    warnings = layout_warnings(grid)
    assert warnings[0].startswith("tp group [0, 8] spans nodes 0 and 1 (8 of 8 tp groups span nodes")
    assert "tp group [0, 8] is not contiguous: its ranks are 8 apart" in warnings[1]
    assert len(warnings) == 2  # each problem once, with a count, not once per group


def test_warning_counts_only_the_spanning_groups():
    grid = Layout(Degrees(dp=4, tp=2), gpus_per_node=3)  # nodes [0-2] [3-5] [6-7]
    assert [w for w in layout_warnings(grid) if "spans" in w] == [
        "tp group [2, 3] spans nodes 0 and 1 (1 of 4 tp groups spans nodes; keep tensor parallel inside a node)"
    ]


def test_warning_partial_node_and_none_when_clean():
    assert layout_warnings(Layout(Degrees(dp=3, tp=4))) == [
        "world 12 does not fill whole nodes of 8 GPUs: node 1 uses 4 of its 8 GPUs (4 idle)"
    ]
    assert layout_warnings(Layout(Degrees(dp=2, tp=8, pp=4))) == []


def test_mesh_dims():
    assert mesh_dims("tp-cp-dp-pp", Degrees(dp=2, tp=4, pp=3)) == (("pp", "dp", "cp", "tp"), (3, 2, 1, 4))
    assert mesh_dims("pp-tp-dp", Degrees(dp=2, tp=4, pp=3)) == (("cp", "dp", "tp", "pp"), (1, 2, 4, 3))
    assert mesh_dims("tp-dp", Degrees(dp=8, tp=2), dp_shard=4) == (
        ("pp", "cp", "dp_replicate", "dp_shard", "tp"), (1, 1, 2, 4, 2)
    )
    with pytest.raises(PlanError, match="dp_shard 3 does not divide dp"):
        mesh_dims("tp-dp", Degrees(dp=8), dp_shard=3)


HYBRID_CASES = [(order, gpn) for order in ORDERS for gpn in (4, 6, 8)]


@pytest.mark.parametrize("order, gpn", HYBRID_CASES)
def test_hybrid_groups_partition_and_stay_inside_nodes(order, gpn):
    grid = Layout(Degrees(dp=8, tp=2, pp=2), order, gpn)
    nodes_per_dp_group = [len({r // gpn for r in g}) for g in grid.groups("dp")]
    spread_evenly = all(
        len({sum(1 for r in g if r // gpn == node) for node in {r // gpn for r in g}}) == 1
        for g in grid.groups("dp")
    )
    if not spread_evenly:
        with pytest.raises(PlanError, match="spread evenly over nodes"):
            hybrid_shard_groups(grid)
        return
    shard, replicate = hybrid_shard_groups(grid)
    assert sorted(r for g in shard for r in g) == list(range(grid.world))
    assert sorted(r for g in replicate for r in g) == list(range(grid.world))
    for group in shard:
        assert len({r // gpn for r in group}) == 1  # inside one node
    for group in replicate:
        assert len({r // gpn for r in group}) == len(group)  # one rank per node
    for group in shard + replicate:  # both are sub-groups of a dp group
        assert any(set(group) <= set(dp) for dp in grid.groups("dp"))
    assert len(shard[0]) * len(replicate[0]) == 8 and len(replicate[0]) == nodes_per_dp_group[0]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ORDERS), st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([1, 2, 3, 4]),
       st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 3]), st.sampled_from([2, 3, 4, 6, 8, 16]))
def test_hybrid_shard_size_is_the_listed_groups(order, dp, tp, pp, cp, gpn):
    """`shard_group_size(hybrid=True)` checks one dp x cp group per base rank modulo the node
    size instead of listing every group (a search asks it of thousands of ranks): the same
    size as the first listed shard group, and the same error where a group splits unevenly."""
    grid = Layout(Degrees(dp=dp, tp=tp, pp=pp, cp=cp), order, gpn)
    try:
        shard, _ = hybrid_shard_groups(grid, group="dp_cp")
    except PlanError as slow:
        with pytest.raises(PlanError) as fast:
            shard_group_size(grid, hybrid=True)
        assert str(fast.value) == str(slow)
        return
    assert shard_group_size(grid, hybrid=True) == len(shard[0])


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(ORDERS), st.sampled_from([1, 2, 3, 4, 6, 8]), st.sampled_from([1, 2, 3, 4]),
       st.sampled_from([1, 2, 3, 4]), st.sampled_from([1, 2, 3]), st.sampled_from([1, 2, 3, 4, 6, 8, 16]))
def test_group_spans_nodes_is_the_listed_groups(order, dp, tp, pp, cp, gpn):
    """`group_spans_nodes` reads whether a group crosses a node from the bases' residues
    modulo the node size instead of listing every group (the time model asks it of a million
    ranks): the same answer as the listed groups, for every group name."""
    grid = Layout(Degrees(dp=dp, tp=tp, pp=pp, cp=cp), order, gpn)
    for name in GROUP_NAMES:
        listed = any(len({rank // gpn for rank in group}) > 1 for group in grid.groups(name))
        assert grid.group_spans_nodes(name) is listed, name


def test_hybrid_cases_cover_both_outcomes():
    outcomes = set()
    for order, gpn in HYBRID_CASES:
        try:
            hybrid_shard_groups(Layout(Degrees(dp=8, tp=2, pp=2), order, gpn))
            outcomes.add("even")
        except PlanError:
            outcomes.add("uneven")
    assert outcomes == {"even", "uneven"}


def test_hybrid_groups_known_answer_and_uneven():
    shard, replicate = hybrid_shard_groups(Layout(Degrees(dp=8, tp=2), "tp-dp", 8))
    assert shard == [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
    assert replicate == [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
    with pytest.raises(PlanError, match=r"dp group \[0, 1, 2\] has 2 on node 0, 1 on node 1"):
        hybrid_shard_groups(Layout(Degrees(dp=3), gpus_per_node=2))


def test_layout_problems_for_validate():
    problems = layout_problems(Degrees(dp=3), "tp-cp-dp-pp", 2, hybrid=True)
    assert [(p.path, p.severity) for p in problems] == [("zero.hybrid", "error"), ("cluster.gpus_per_node", "warning")]
    assert layout_problems(Degrees(dp=4, tp=2), "tp-cp-dp-pp", 8, hybrid=True) == []
    assert layout_problems(Degrees(dp=2, pp=2), "tp-dp", 8, hybrid=False) == []  # bad order: its own message


@pytest.mark.parametrize("kwargs, message", [
    ({"order": "tp-dp"}, "order 'tp-dp' leaves out pp, whose degree is 2"),
    ({"order": "tp-xp"}, "unknown axis 'xp'"),
    ({"gpus_per_node": 0}, "gpus_per_node must be a positive integer"),
])
def test_bad_layouts(kwargs, message):
    with pytest.raises(PlanError, match=message):
        Layout(Degrees(pp=2), **kwargs)


def test_rank_out_of_range():
    grid = Layout(Degrees(dp=4))
    with pytest.raises(PlanError, match=r"rank 4 is out of range: the world has ranks 0..3"):
        grid.coords(4)
    with pytest.raises(PlanError, match="tp coordinate 1 is out of range"):
        grid.rank_of(tp=1)


def test_format_ranks_abbreviates_long_groups():
    assert format_ranks([0, 8]) == "[0, 8]"
    assert format_ranks(list(range(8))) == "[0, 1, 2, 3, 4, 5, 6, 7]"
    assert format_ranks(list(range(0, 512, 8))) == "[0, 8, 16, 24, 32, 40, ..., 504]"
