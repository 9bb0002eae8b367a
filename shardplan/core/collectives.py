"""Collective communication: bytes each rank moves (ring closed forms) and the link they cross.

Ring algorithms (Patarasuk and Yuan 2009; what NCCL runs for large messages): on n ranks,
a tensor of `size` bytes costs each rank

    all-gather / reduce-scatter   (n - 1) / n * size      (size: the whole, gathered tensor)
    all-reduce                    2 (n - 1) / n * size     (a reduce-scatter then an all-gather)

on its slowest link. A group whose ranks share a node talks over NVLink (`intra_node_bandwidth`);
a group that spans nodes runs at the GPU's inter-node bandwidth (`inter_node_bandwidth`, its
share of the node's NICs), as Calculon models it (Isaev et al. 2023) and as the ZeRO-3 runs of
Narayanan et al. 2021 (Table 2) measured (docs/time.md). Which groups span nodes comes from the
rank layout (core/layout.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .degrees import Degrees
from .hardware import Hardware, TimeConstants

ALL_REDUCE, ALL_GATHER, REDUCE_SCATTER = "all-reduce", "all-gather", "reduce-scatter"


@dataclass(frozen=True)
class Link:
    """The link a group's collectives cross: effective bytes/s per GPU and per-call latency."""

    name: str  # "NVLink" (intra-node) | "network" (inter-node)
    bandwidth: float
    latency: float


def ring_bytes(kind: str, size: float, ranks: int) -> float:
    """Bytes one rank sends in a ring collective over `ranks` ranks (module docstring)."""
    if ranks <= 1:
        return 0.0
    share = (ranks - 1) / ranks * size
    return 2 * share if kind == ALL_REDUCE else share


def collective_seconds(kind: str, size: float, ranks: int, link: Link) -> float:
    """Time of one collective: its ring bytes at the link's bandwidth plus its latency."""
    if ranks <= 1 or size <= 0:
        return 0.0
    return ring_bytes(kind, size, ranks) / link.bandwidth + link.latency


def point_to_point_seconds(size: float, link: Link) -> float:
    """One send of `size` bytes to a neighbour."""
    return size / link.bandwidth + link.latency if size > 0 else 0.0


def intra_link(hw: Hardware, k: TimeConstants) -> Link:
    return Link(hw.intra_node_link, hw.intra_node_bandwidth * hw.intra_node_efficiency, k.intra_node_latency_seconds)


def inter_link(hw: Hardware, k: TimeConstants) -> Link:
    return Link("network", hw.inter_node_bandwidth * hw.inter_node_efficiency, k.inter_node_latency_seconds)


@lru_cache(maxsize=4096)
def spans_nodes(degrees: Degrees, order: str, gpus_per_node: int, group: str) -> bool:
    """True when some group of that name (tp, cp, dp_cp, pp...) has ranks on two nodes."""
    from .layout import Layout

    return Layout(degrees, order, gpus_per_node).group_spans_nodes(group)


def group_link(degrees: Degrees, order: str, gpus_per_node: int, group: str,
               hw: Hardware, k: TimeConstants) -> Link:
    """The link a group's collectives run on (module docstring)."""
    crosses = spans_nodes(degrees, order, gpus_per_node, group)
    return inter_link(hw, k) if crosses else intra_link(hw, k)
