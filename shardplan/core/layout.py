"""Which rank does what: ranks <-> (dp, tp, pp, cp) coordinates, process groups, nodes.

Rank order follows Megatron-LM (NVIDIA/Megatron-LM, megatron/core/parallel_state.py,
`RankGenerator` and `generate_masked_orthogonal_rank_groups`): the order string lists the
axes fastest-varying first, and

    rank = sum(coord[axis] * stride[axis]),  stride[first] = 1,
    stride[next] = stride[previous] * degree[previous]

so `tp-cp-dp-pp` gives rank = tp + TP*(cp + CP*(dp + DP*pp)). A torch `DeviceMesh` is
row-major (last dimension fastest), so the same ranks come from a mesh whose dimensions are
the order reversed: `mesh_dims`.

Every function is O(world) with small constants: a 16,384-rank layout takes milliseconds.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property

from ..spec.errors import PlanError, Problem
from ..spec.names import DEFAULT_ORDER
from .degrees import Degrees, full_order, missing_axes

# The contract's groups, one per axis, in the order documents list them.
AXIS_GROUPS = ("dp", "tp", "pp", "cp")

# Megatron-LM's combined groups (parallel_state.py, `initialize_model_parallel`), named by
# the axes they span. Ranks inside are enumerated with the order's faster axis fastest, as
# Megatron's masked enumeration does, which makes them ascending.
COMBINED_GROUPS: dict[str, tuple[str, ...]] = {
    # _DATA_PARALLEL_GROUP_WITH_CP: gradients are reduced and ZeRO/FSDP shards over dp and
    # cp together, because context-parallel ranks hold the same weights.
    "dp_cp": ("dp", "cp"),
    # _TENSOR_AND_CONTEXT_PARALLEL_GROUP.
    "tp_cp": ("tp", "cp"),
    # _TENSOR_AND_DATA_PARALLEL_GROUP (FP8 amax reduction, MoE token dispatch).
    "tp_dp": ("tp", "dp"),
    # _TENSOR_AND_DATA_PARALLEL_GROUP_WITH_CP.
    "tp_dp_cp": ("tp", "dp", "cp"),
    # _MODEL_PARALLEL_GROUP: Megatron spans tp and pp only (not cp).
    "mp": ("tp", "pp"),
}

# _EMBEDDING_GROUP: the first and last stage of each pipeline (tied input/output embedding
# gradients are all-reduced there; `default_embedding_ranks`).
EMBEDDING_GROUP = "embedding"

GROUP_NAMES: tuple[str, ...] = (*AXIS_GROUPS, *COMBINED_GROUPS, EMBEDDING_GROUP)

# Ranks a message shows of one group before it abbreviates ("[0, 8, 16, ..., 504]").
RANKS_SHOWN = 8


def format_ranks(ranks: list[int], limit: int = RANKS_SHOWN) -> str:
    """`[0, 8]`, or `[0, 1, 2, ..., 63]` when longer than `limit`."""
    if len(ranks) <= limit:
        return "[" + ", ".join(map(str, ranks)) + "]"
    head = ", ".join(map(str, ranks[: limit - 2]))
    return f"[{head}, ..., {ranks[-1]}]"


def mesh_dims(
    order: str, degrees: Degrees, dp_shard: int | None = None
) -> tuple[tuple[str, ...], tuple[int, ...]]:
    """Dimension names and sizes of the torch `DeviceMesh` that numbers ranks like `order`.

    DeviceMesh is row-major (its last dimension varies fastest), so the dimensions are the
    order's axes reversed, slowest first: `tp-cp-dp-pp` -> ("pp", "dp", "cp", "tp"). All four
    axes are present (size 1 where unused) so `mesh[name]` always works.

    With `dp_shard` (hybrid sharding, HSDP), the dp dimension is split into
    ("dp_replicate", "dp_shard") with dp_shard fastest: `hybrid_shard_groups`' shard groups
    are then the `dp_shard` groups and its replicate groups the `dp_replicate` groups.
    """
    axes = full_order(order)
    _require_complete(order, degrees)
    names: list[str] = []
    sizes: list[int] = []
    for axis in reversed(axes):
        size = degrees.of(axis)
        if axis == "dp" and dp_shard is not None:
            if dp_shard < 1 or size % dp_shard:
                raise PlanError(f"dp_shard {dp_shard} does not divide dp ({size})")
            names += ["dp_replicate", "dp_shard"]
            sizes += [size // dp_shard, dp_shard]
        else:
            names.append(axis)
            sizes.append(size)
    return tuple(names), tuple(sizes)


def _require_complete(order: str, degrees: Degrees) -> None:
    left_out = missing_axes(order, degrees)
    if left_out:
        axis = left_out[0]
        raise PlanError(f"order {order!r} leaves out {axis}, whose degree is {degrees.of(axis)}")


def _mixed_radix(axes: tuple[str, ...], sizes: dict[str, int], strides: dict[str, int]) -> list[int]:
    """All sums of coord*stride over `axes`, the first axis varying fastest (ascending)."""
    offsets = [0]
    for axis in axes:
        stride = strides[axis]
        offsets = [offset + k * stride for k in range(sizes[axis]) for offset in offsets]
    return offsets


def _iter_mixed_radix(axes: tuple[str, ...], sizes: dict[str, int], strides: dict[str, int]):
    """`_mixed_radix` one sum at a time, in its order (a search stops early)."""
    ranges = [range(0, sizes[axis] * strides[axis], strides[axis]) for axis in reversed(axes)]
    for parts in itertools.product(*ranges):
        yield sum(parts)


def _residues(axes: tuple[str, ...], sizes: dict[str, int], strides: dict[str, int], modulus: int) -> set[int]:
    """{s % modulus for s in _mixed_radix(axes, ...)} without listing the sums: k * stride
    modulo `modulus` repeats after modulus / gcd(stride, modulus) steps."""
    found = {0}
    for axis in axes:
        step = strides[axis] % modulus
        period = modulus // math.gcd(step, modulus)
        steps = {k * step % modulus for k in range(min(sizes[axis], period))}
        found = {(r + t) % modulus for r in found for t in steps}
    return found


@dataclass(frozen=True)
class Layout:
    """The rank grid of a job: degrees, rank order and node size. Validates on construction."""

    degrees: Degrees
    order: str = DEFAULT_ORDER
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        try:
            full_order(self.order)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        _require_complete(self.order, self.degrees)
        gpn = self.gpus_per_node
        if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
            raise PlanError(f"gpus_per_node must be a positive integer (got {gpn!r})")

    # -- the grid ---------------------------------------------------------------------
    @cached_property
    def axes(self) -> tuple[str, ...]:
        """All four axes, fastest first (the order's axes, then the unnamed ones)."""
        return full_order(self.order)

    @cached_property
    def sizes(self) -> dict[str, int]:
        return {axis: self.degrees.of(axis) for axis in self.axes}

    @cached_property
    def strides(self) -> dict[str, int]:
        """Rank distance between neighbours along each axis."""
        strides, stride = {}, 1
        for axis in self.axes:
            strides[axis] = stride
            stride *= self.sizes[axis]
        return strides

    @property
    def world(self) -> int:
        return self.degrees.world

    @property
    def num_nodes(self) -> int:
        """Nodes needed: the last one may be partly used (see `layout_warnings`)."""
        return -(-self.world // self.gpus_per_node)

    @property
    def order_string(self) -> str:
        """The order with every axis named, e.g. `tp-cp-dp-pp`."""
        return "-".join(self.axes)

    def check_rank(self, rank: int) -> None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world:
            raise PlanError(f"rank {rank} is out of range: the world has ranks 0..{self.world - 1}")

    def coords(self, rank: int) -> dict[str, int]:
        """{"dp", "tp", "pp", "cp"} coordinates of `rank`."""
        self.check_rank(rank)
        return {axis: (rank // self.strides[axis]) % self.sizes[axis] for axis in AXIS_GROUPS}

    def rank_of(self, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """The rank at these coordinates (each within its degree)."""
        coords = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
        for axis, value in coords.items():
            if not 0 <= value < self.sizes[axis]:
                raise PlanError(f"{axis} coordinate {value} is out of range 0..{self.sizes[axis] - 1}")
        return sum(value * self.strides[axis] for axis, value in coords.items())

    def node_of(self, rank: int) -> int:
        return rank // self.gpus_per_node

    def local_rank(self, rank: int) -> int:
        return rank % self.gpus_per_node

    def column(self, axis: str) -> list[int]:
        """The `axis` coordinate of every rank, in rank order (one pass, no per-rank calls)."""
        size, stride = self.sizes[axis], self.strides[axis]
        run = [k for k in range(size) for _ in range(stride)]  # one period of the coordinate
        return run * (self.world // len(run))

    # -- pipeline neighbours ----------------------------------------------------------
    def pp_prev(self, rank: int) -> int | None:
        """Rank of the previous pipeline stage (same dp/tp/cp), None on the first stage."""
        stage = (rank // self.strides["pp"]) % self.sizes["pp"]
        return rank - self.strides["pp"] if stage > 0 else None

    def pp_next(self, rank: int) -> int | None:
        """Rank of the next pipeline stage, None on the last stage."""
        stage = (rank // self.strides["pp"]) % self.sizes["pp"]
        return rank + self.strides["pp"] if stage < self.sizes["pp"] - 1 else None

    # -- groups -----------------------------------------------------------------------
    def group_axes(self, name: str) -> tuple[str, ...]:
        """The axes a group spans, fastest first in this layout's order."""
        if name in AXIS_GROUPS:
            return (name,)
        if name in COMBINED_GROUPS:
            wanted = COMBINED_GROUPS[name]
            return tuple(axis for axis in self.axes if axis in wanted)
        if name == EMBEDDING_GROUP:
            return ("pp",)
        raise PlanError(f"unknown group {name!r} (groups: {', '.join(GROUP_NAMES)})")

    def groups(self, name: str) -> list[list[int]]:
        """Every group of that name, ascending by lowest rank; ranks inside ascending along
        the group's axes (Megatron's `generate_masked_orthogonal_rank_groups`)."""
        spanned = self.group_axes(name)
        others = tuple(axis for axis in self.axes if axis not in spanned)
        offsets = _mixed_radix(spanned, self.sizes, self.strides)
        bases = _mixed_radix(others, self.sizes, self.strides)
        if name == EMBEDDING_GROUP and len(offsets) > 1:
            offsets = [offsets[0], offsets[-1]]
        return [[base + offset for offset in offsets] for base in bases]

    def group_spans_nodes(self, name: str) -> bool:
        """True when some group of that name has ranks on two nodes, without listing the
        groups: a group is a base plus offsets from 0 to `last` (`groups`), so its first and
        last rank are on two nodes exactly when base % gpus_per_node + last >= gpus_per_node."""
        spanned = self.group_axes(name)
        last = sum((self.sizes[axis] - 1) * self.strides[axis] for axis in spanned)
        if last == 0:
            return False
        others = tuple(axis for axis in self.axes if axis not in spanned)
        gpn = self.gpus_per_node
        return max(_residues(others, self.sizes, self.strides, gpn)) + last >= gpn

    def group_of(self, name: str, rank: int) -> list[int]:
        """The group of that name that holds `rank` (for the embedding group: the first and
        last stage of the rank's pipeline, whether or not the rank is one of them)."""
        self.check_rank(rank)
        spanned = self.group_axes(name)
        base = rank - sum(
            ((rank // self.strides[axis]) % self.sizes[axis]) * self.strides[axis] for axis in spanned
        )
        offsets = _mixed_radix(spanned, self.sizes, self.strides)
        if name == EMBEDDING_GROUP and len(offsets) > 1:
            offsets = [offsets[0], offsets[-1]]
        return [base + offset for offset in offsets]

    def all_groups(self) -> dict[str, list[list[int]]]:
        return {name: self.groups(name) for name in GROUP_NAMES}


# -- placement warnings ---------------------------------------------------------------
def _span_text(nodes: list[int]) -> str:
    if len(nodes) == 2:
        return f"nodes {nodes[0]} and {nodes[1]}"
    if nodes == list(range(nodes[0], nodes[-1] + 1)):
        return f"nodes {nodes[0]}-{nodes[-1]}"
    return f"{len(nodes)} nodes ({', '.join(map(str, nodes[:4]))}{', ...' if len(nodes) > 4 else ''})"


def _placement(layout: Layout) -> list[tuple[str, str]]:
    """(job-file path to change, message) of each placement problem, stated once."""
    found: list[tuple[str, str]] = []
    tp, gpn = layout.sizes["tp"], layout.gpus_per_node
    if tp > 1:
        groups = layout.groups("tp")
        spanning = [g for g in groups if g[0] // gpn != g[-1] // gpn]
        if spanning:
            first = spanning[0]
            nodes = sorted({rank // gpn for rank in first})
            found.append(("parallel.tp", (
                f"tp group {format_ranks(first)} spans {_span_text(nodes)} ({len(spanning)} of "
                f"{len(groups)} tp groups {'spans' if len(spanning) == 1 else 'span'} nodes; "
                "keep tensor parallel inside a node)"
            )))
        stride = layout.strides["tp"]
        if stride > 1:
            found.append(("parallel.order", (
                f"tp group {format_ranks(groups[0])} is not contiguous: its ranks are {stride} apart "
                f"(all {len(groups)} tp groups; put tp first in the order, e.g. {DEFAULT_ORDER})"
            )))
    idle = layout.num_nodes * gpn - layout.world
    if idle:
        found.append(("cluster.gpus_per_node", (
            f"world {layout.world} does not fill whole nodes of {gpn} GPUs: node "
            f"{layout.num_nodes - 1} uses {gpn - idle} of its {gpn} GPUs ({idle} idle)"
        )))
    return found


def layout_warnings(layout: Layout) -> list[str]:
    """Placement problems that cost a cluster hour, each stated once with a count.

    - a tensor-parallel group that spans nodes: its all-reduces, on the critical path of
      every layer, would cross the network instead of NVLink (Megatron-LM's docstring:
      "the caller should make sure adjacent ranks are on the same DGX box");
    - a tensor-parallel group whose ranks are not consecutive (tp not fastest in the order);
    - a world that does not fill whole nodes.
    """
    return [message for _, message in _placement(layout)]


# -- hybrid sharding (HSDP) -----------------------------------------------------------
def shard_group_size(layout: Layout, hybrid: bool) -> int:
    """Ranks one ZeRO/FSDP group shards over: dp * cp (context-parallel ranks hold the same
    weights: Megatron-LM's data-parallel-with-cp group, torchtitan's dp_shard_cp mesh); with
    hybrid sharding only the part of that group inside one node."""
    if hybrid:
        return _hybrid_shard_size(layout, "dp_cp")
    return layout.degrees.dp * layout.degrees.cp


def _hybrid_shard_size(layout: Layout, group: str) -> int:
    """`len(hybrid_shard_groups(layout, group)[0][0])`, the size of the shard group of rank 0,
    without listing every group (a search asks it of worlds of thousands of ranks). Every
    group is one base rank plus the same offsets (`Layout.groups`), and two groups whose bases
    differ by whole nodes split over nodes alike: one group per base modulo gpus_per_node
    decides whether every group splits evenly, and the first uneven one, in the order of
    `Layout.groups`, is the one `hybrid_shard_groups`' error names."""
    gpn = layout.gpus_per_node
    spanned = layout.group_axes(group)
    offsets = _mixed_radix(spanned, layout.sizes, layout.strides)
    others = tuple(axis for axis in layout.axes if axis not in spanned)
    residues = len(_residues(others, layout.sizes, layout.strides, gpn))
    size_at: dict[int, int] = {}  # base modulo gpus_per_node -> its groups' piece size
    for base in _iter_mixed_radix(others, layout.sizes, layout.strides):
        if base % gpn not in size_at:
            size_at[base % gpn] = _piece_size([base + offset for offset in offsets], group, gpn)
            if len(size_at) == residues:  # every residue met: the rest split alike
                break
    return size_at[0]


def _piece_size(ranks: list[int], group: str, gpn: int) -> int:
    """`len(_node_pieces(ranks, group, gpn)[0])`, counted without building the pieces (a group
    of half a million ranks); the same PlanError when they differ in size."""
    counts = Counter(map(gpn.__rfloordiv__, ranks))  # node -> ranks of the group on it
    if len(set(counts.values())) > 1:
        _node_pieces(ranks, group, gpn)  # raises, naming the pieces
    return counts[ranks[0] // gpn]


def _node_pieces(ranks: list[int], group: str, gpn: int) -> list[list[int]]:
    """A group's ranks (ascending) cut into the pieces on each node; PlanError when the
    pieces differ in size."""
    pieces: list[list[int]] = []
    for rank in ranks:  # ranks ascend, so a node's ranks are consecutive here
        if pieces and pieces[-1][0] // gpn == rank // gpn:
            pieces[-1].append(rank)
        else:
            pieces.append([rank])
    sizes = {len(piece) for piece in pieces}
    if len(sizes) > 1:
        counts = ", ".join(f"{len(p)} on node {p[0] // gpn}" for p in pieces[:4])
        more = ", ..." if len(pieces) > 4 else ""
        raise PlanError(
            f"hybrid sharding needs every {group} group spread evenly over nodes: "
            f"{group} group {format_ranks(ranks)} has {counts}{more} (gpus_per_node {gpn})"
        )
    return pieces


def hybrid_shard_groups(layout: Layout, group: str = "dp") -> tuple[list[list[int]], list[list[int]]]:
    """(shard groups, replicate groups) of hybrid sharding over `group` (default the dp axis;
    with cp > 1 FSDP shards over "dp_cp").

    Each group's ranks on one node form a shard group (parameters are sharded over NVLink);
    the k-th rank of each of those node-local pieces form a replicate group (gradients are
    all-reduced across nodes), as torch's HSDP mesh (replicate, shard) and FSDP1's
    HYBRID_SHARD do. Both lists are ascending by lowest rank. Raises PlanError when a group's
    ranks are not spread evenly over its nodes: the shard groups would differ in size.
    """
    gpn = layout.gpus_per_node
    shard_groups: list[list[int]] = []
    replicate_groups: list[list[int]] = []
    for ranks in layout.groups(group):
        pieces = _node_pieces(ranks, group, gpn)
        shard_groups += pieces
        replicate_groups += [list(column) for column in zip(*pieces)]
    shard_groups.sort(key=lambda g: g[0])
    replicate_groups.sort(key=lambda g: g[0])
    return shard_groups, replicate_groups


def layout_problems(
    degrees: Degrees, order: str, gpus_per_node: int, hybrid: bool
) -> list[Problem]:
    """Cross-field rules of rank placement for `shardplan validate` (core/checks.py).

    An error when hybrid sharding cannot split the ZeRO/FSDP shard group (dp x cp) evenly
    over nodes; warnings for the placement problems of `layout_warnings`. Returns nothing
    when the order itself is invalid (that has its own message).
    """
    try:
        layout = Layout(degrees, order, gpus_per_node)
    except PlanError:
        return []
    problems = []
    if hybrid:
        try:
            hybrid_shard_groups(layout, "dp_cp")
        except PlanError as exc:
            problems.append(Problem("zero.hybrid", str(exc)))
    problems += [Problem(path, message, severity="warning") for path, message in _placement(layout)]
    return problems
