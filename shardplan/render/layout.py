"""A layout as JSON (CONTRACT: `layout`) and as a picture: nodes as rows of GPUs.

Its JSON is written by render/output.py `write_document`: one rank (one group) per line.
"""

from __future__ import annotations

from rich.text import Text

from ..core.layout import EMBEDDING_GROUP, GROUP_NAMES, Layout, format_ranks
from ..spec.units import counted

# Nodes drawn before the picture says how many more there are.
NODES_SHOWN = 4
# GPUs drawn per line: wider nodes (e.g. 72-GPU NVL72 racks) continue on the next line.
GPUS_PER_LINE = 8
# Groups listed per kind before "... N more".
GROUPS_SHOWN = 4
# Pipeline stage colours, cycled when there are more stages.
STAGE_STYLES = ("cyan", "green", "yellow", "magenta", "bright_blue", "red", "bright_cyan", "bright_green")

GROUP_HELP = {
    "dp": "data parallel: gradient all-reduce",
    "tp": "tensor parallel: all-reduce in every layer",
    "pp": "pipeline: stages in order, activations sent point to point",
    "cp": "context parallel: attention key/value exchange",
    "dp_cp": "ZeRO/FSDP shard group; gradients reduced here when cp > 1",
    "tp_cp": "tensor x context parallel",
    "tp_dp": "tensor x data parallel (FP8 amax, MoE dispatch)",
    "tp_dp_cp": "tensor x data x context parallel",
    "mp": "model parallel: tp x pp, one model replica",
    EMBEDDING_GROUP: "first and last stage: tied embedding gradients",
}


def layout_document(layout: Layout, warnings: list[str]) -> dict:
    """The CONTRACT `layout` document: every rank, every group, the warnings."""
    world, gpn = layout.world, layout.gpus_per_node
    last_stage = layout.sizes["pp"] - 1
    pp_stride = layout.strides["pp"]
    dp, tp, pp, cp = (layout.column(axis) for axis in ("dp", "tp", "pp", "cp"))
    ranks = [
        {
            "rank": rank, "node": rank // gpn, "local_rank": rank % gpn,
            "dp": d, "tp": t, "pp": p, "cp": c,
            "pp_prev": rank - pp_stride if p > 0 else None,
            "pp_next": rank + pp_stride if p < last_stage else None,
            "first_stage": p == 0, "last_stage": p == last_stage,
        }
        for rank, d, t, p, c in zip(range(world), dp, tp, pp, cp)
    ]
    return {**_header(layout), "ranks": ranks, "groups": layout.all_groups(), "warnings": warnings}


def rank_document(layout: Layout, rank: int, warnings: list[str]) -> dict:
    """`--rank R`: that rank's entry and, per group name, the one group that holds it."""
    coords = layout.coords(rank)
    last_stage = layout.sizes["pp"] - 1
    entry = {
        "rank": rank, "node": layout.node_of(rank), "local_rank": layout.local_rank(rank), **coords,
        "pp_prev": layout.pp_prev(rank), "pp_next": layout.pp_next(rank),
        "first_stage": coords["pp"] == 0, "last_stage": coords["pp"] == last_stage,
    }
    groups = {name: layout.group_of(name, rank) for name in GROUP_NAMES}
    return {**_header(layout), "rank": entry, "groups": groups, "warnings": warnings}


def _header(layout: Layout) -> dict:
    return {
        "world_size": layout.world,
        "order": layout.order_string,
        "gpus_per_node": layout.gpus_per_node,
        "num_nodes": layout.num_nodes,
        "degrees": {axis: layout.sizes[axis] for axis in ("dp", "tp", "pp", "cp")},
    }


# -- the picture ------------------------------------------------------------------------
def _stage_style(stage: int) -> str:
    return STAGE_STYLES[stage % len(STAGE_STYLES)]


def _title(layout: Layout) -> str:
    d = layout.sizes
    nodes = layout.num_nodes
    return (
        f"world {layout.world} = dp {d['dp']} x tp {d['tp']} x pp {d['pp']} x cp {d['cp']}, "
        f"order {layout.order_string} ({layout.axes[0]} fastest), {counted(nodes, 'node')} "
        f"of {counted(layout.gpus_per_node, 'GPU')}"
    )


def _cell_labels(layout: Layout, rank: int) -> tuple[str, str]:
    c = layout.coords(rank)
    coords = f"d{c['dp']} t{c['tp']}" + (f" c{c['cp']}" if layout.sizes["cp"] > 1 else "")
    return f"r{rank} p{c['pp']}", coords


def layout_picture(layout: Layout) -> Text:
    """Nodes as rows of GPUs, each labelled `r<rank> p<stage>` / `d<dp> t<tp> [c<cp>]` and
    coloured by pipeline stage; then the groups."""
    gpn, world = layout.gpus_per_node, layout.world
    nodes_shown = min(layout.num_nodes, NODES_SHOWN)
    shown = range(min(world, nodes_shown * gpn))
    labels = {rank: _cell_labels(layout, rank) for rank in shown}
    width = max(len(s) for pair in labels.values() for s in pair) + 2
    per_line = min(gpn, GPUS_PER_LINE)
    margin = len(f"node {nodes_shown - 1}  ") + (len(f"gpu {gpn - 1}-{gpn - 1} ") if gpn > per_line else 0)

    out = Text(_title(layout) + "\n", style="bold")
    legend = Text("pipeline stages: ")
    for stage in range(min(layout.sizes["pp"], len(STAGE_STYLES))):
        legend.append(f"p{stage} ", style=_stage_style(stage))
    if layout.sizes["pp"] > len(STAGE_STYLES):
        legend.append(f"(colours repeat every {len(STAGE_STYLES)} stages)")
    legend.rstrip()
    out.append_text(legend)
    out.append("\n\n")
    for node in range(nodes_shown):
        for first in range(0, gpn, per_line):
            local = range(first, min(first + per_line, gpn))
            head = f"node {node}" if first == 0 else ""
            if gpn > per_line:
                head = f"{head:<{len(f'node {nodes_shown - 1}')}}  gpu {first}-{local[-1]}"
            if node * gpn + first >= world:  # the unused rest of a partly used node, in one line
                if gpn > per_line:
                    head = f"{'':<{len(f'node {nodes_shown - 1}')}}  gpu {first}-{gpn - 1}"
                out.append(f"{head:<{margin}}")
                out.append("idle\n", style="dim")
                break
            for line in (0, 1):
                row = Text(f"{head if line == 0 else '':<{margin}}")
                for gpu in local:
                    rank = node * gpn + gpu
                    if rank >= world:
                        row.append(f"{'idle' if line == 0 else '':<{width}}", style="dim")
                        continue
                    stage = (rank // layout.strides["pp"]) % layout.sizes["pp"]
                    row.append(f"{labels[rank][line]:<{width}}", style=_stage_style(stage))
                row.rstrip()
                out.append_text(row)
                out.append("\n")
    if layout.num_nodes > nodes_shown:
        hidden = layout.num_nodes - nodes_shown
        out.append(
            f"... {hidden} more {'node' if hidden == 1 else 'nodes'} "
            f"(ranks {nodes_shown * gpn}-{world - 1}); --json lists every rank, --rank R shows one\n",
            style="dim",
        )
    out.append("\n")
    out.append_text(groups_text(layout))
    out.rstrip()  # the console adds the final newline
    return out


def groups_text(layout: Layout) -> Text:
    """Each group kind: count and size, the first few groups, what it is for. A combined
    group equal to one listed before (dp_cp when cp = 1) is named, not repeated."""
    out = Text("groups (ranks in each group ascend along its axes)\n", style="bold")
    seen: dict[str, list[list[int]]] = {}
    name_width = max(map(len, GROUP_NAMES)) + 2
    for name in GROUP_NAMES:
        groups = layout.groups(name)
        out.append(f"  {name:<{name_width}}")
        if len(groups[0]) == 1:
            out.append(f"{len(groups)} x 1: every rank alone", style="dim")
            out.append(f"  ({GROUP_HELP[name]})\n", style="dim")
            continue
        same = next((other for other, listed in seen.items() if listed == groups), None)
        if same is not None:
            out.append(f"same as {same}", style="dim")
            out.append(f"  ({GROUP_HELP[name]})\n", style="dim")
            continue
        seen[name] = groups
        size = len(groups[0])
        out.append(f"{len(groups)} x {size}: ")
        out.append(" ".join(format_ranks(g) for g in groups[:GROUPS_SHOWN]))
        if len(groups) > GROUPS_SHOWN:
            out.append(f" ... {len(groups) - GROUPS_SHOWN} more")
        out.append(f"  ({GROUP_HELP[name]})\n", style="dim")
    return out


def rank_text(document: dict) -> Text:
    """`--rank R`: one rank's coordinates, node, neighbours and groups."""
    r = document["rank"]
    out = Text(f"rank {r['rank']} of {document['world_size']} (order {document['order']})\n", style="bold")
    out.append(f"  node {r['node']}, local rank {r['local_rank']} (nodes of {counted(document['gpus_per_node'], 'GPU')})\n")
    out.append(f"  coordinates: dp {r['dp']}, tp {r['tp']}, pp {r['pp']}, cp {r['cp']}\n")
    stage = "first and last stage" if r["first_stage"] and r["last_stage"] else (
        "first stage" if r["first_stage"] else "last stage" if r["last_stage"] else "middle stage"
    )
    prev = "none" if r["pp_prev"] is None else f"rank {r['pp_prev']}"
    nxt = "none" if r["pp_next"] is None else f"rank {r['pp_next']}"
    out.append(f"  pipeline: {stage}; previous stage {prev}, next stage {nxt}\n")
    out.append("groups holding this rank\n", style="bold")
    width = max(map(len, GROUP_NAMES)) + 2
    for name, ranks in document["groups"].items():
        out.append(f"  {name:<{width}}{format_ranks(ranks, limit=16)}")
        out.append(f"  ({GROUP_HELP[name]})\n", style="dim")
    out.rstrip()  # the console adds the final newline
    return out

