"""Shards as JSON (CONTRACT: `shards`) and as compact tables.

Tables are aligned plain columns (no wrapping: long worlds are summarised instead), and
repeated values over consecutive ranks are written once: `r0-62: 43, r63: 42`.
"""

from __future__ import annotations

from rich.text import Text

from ..core.shards import RankShare, Shard
from ..core.shards_model import FlatBuffer, ModelShards, ParamOwner, ParamShards
from ..spec.units import counted, format_bytes

# Ranks listed in full before a table shows the first and last few.
RANKS_SHOWN = 16
HEAD_RANKS, TAIL_RANKS = 8, 4


# -- JSON documents ---------------------------------------------------------------------
def _shard_json(shard: Shard) -> dict:
    return {"rank": shard.rank, "start": shard.start, "end": shard.end, "padding": shard.padding}


def numel_document(numel: int, world: int, style: str, chunk: int, shards: list[Shard]) -> dict:
    return {
        "numel": numel, "world": world, "style": style, "chunk": chunk,
        "padded_numel": sum(s.stored for s in shards),
        "shards": [_shard_json(s) for s in shards],
    }


def blocks_document(world: int, assign: str, owners: list[int], shares: list[RankShare]) -> dict:
    return {
        "num_blocks": len(owners), "world": world, "assign": assign,
        "blocks": [{"block": block, "owner": owner} for block, owner in enumerate(owners)],
        "ranks": [{"rank": s.rank, "num_blocks": s.num_blocks, "fraction": s.fraction} for s in shares],
    }


def param_blocks_document(
    model: str, world: int, assign: str, element_bytes: int, owned: list[ParamOwner], shares: list[tuple[int, RankShare]],
    whole_bytes: dict[int, int] | None = None, dtype: str | None = None, frozen_dtype: str | None = None,
) -> dict:
    """Whole parameters as blocks: each with its owner; each (stage, rank) with its share.
    Under LoRA the blocks are the trainable parameters (the adapters); `whole_bytes`: by stage,
    the bytes of all parameters every rank holds whole (frozen base included)."""
    return {
        "model": model, "num_blocks": len(owned), "world": world, "assign": assign,
        "element_bytes": element_bytes, "dtype": dtype, "frozen_dtype": frozen_dtype,
        "param_bytes": [{"stage": stage, "bytes": size} for stage, size in sorted((whole_bytes or {}).items())],
        "blocks": [
            {"block": i, "owner": p.owner, "name": p.name, "stage": p.stage, "numel": p.numel, "bytes": p.stored_bytes}
            for i, p in enumerate(owned)
        ],
        "ranks": [
            {"stage": stage, "rank": s.rank, "num_blocks": s.num_blocks, "bytes": s.weight, "fraction": s.fraction}
            for stage, s in shares
        ],
    }


def model_document(context: dict, plan: ModelShards) -> dict:
    """`context`: model name, tp, tp_rank (whose pieces), pp."""
    def param_json(p: ParamShards) -> dict:
        shards = [_shard_json(s) for s in p.shards]
        if p.rows is not None:
            for entry, rows in zip(shards, p.rows):
                entry["rows"] = rows
        for entry, size in zip(shards, p.stored_bytes):
            entry["bytes"] = size
        return {
            "name": p.name, "shape": list(p.shape), "local_shape": list(p.local_shape),
            "stage": p.stage, "unit": p.unit, "replicated": p.replicated, "shards": shards,
            "dtype": p.dtype, "trainable": p.trainable, "persistent_bytes": p.persistent_bytes,
            "group": p.group,
        }

    return {
        "model": context["model"], "style": plan.style, "world": plan.world, "tp": context["tp"],
        "tp_rank": context["tp_rank"], "pp": context["pp"], "element_bytes": plan.element_bytes,
        "dtype": plan.dtype, "frozen_dtype": plan.frozen_dtype,
        "persistent_at_most": context.get("persistent_at_most"),
        "numel": sum(p.numel for p in plan.params),
        "params": [param_json(p) for p in plan.params],
        "flat_buffers": [
            {"name": b.name, "stage": b.stage, "numel": b.numel, "padded_numel": b.padded_numel,
             "num_params": b.num_params, "group": b.group, "shards": [_shard_json(s) for s in b.shards]}
            for b in plan.buffers
        ],
        "ranks": [
            {"stage": t.stage, "rank": t.rank, "numel": t.numel, "padding": t.padding, "bytes": t.stored_bytes}
            for t in plan.totals
        ],
    }


# -- text helpers -----------------------------------------------------------------------
def _table(header: list[str], rows: list[list[str]], right: set[int]) -> Text:
    """Aligned columns; `right` are the right-aligned (numeric) column indices."""
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        parts = [f"{c:>{w}}" if i in right else f"{c:<{w}}" for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    out = Text(line(header) + "\n", style="bold")
    for row in rows:
        out.append(line(row) + "\n")
    return out


def _elided(items: list) -> list:
    """All items when few; else the first HEAD_RANKS, None (a gap), the last TAIL_RANKS."""
    if len(items) <= RANKS_SHOWN:
        return items
    return [*items[:HEAD_RANKS], None, *items[-TAIL_RANKS:]]


def rank_span(first: int, last: int) -> str:
    return f"r{first}" if first == last else f"r{first}-{last}"


def runs(values: list, unit: str = "") -> str:
    """`r0-62: 43, r63: 42` - each value once with the consecutive ranks holding it."""
    parts, start = [], 0
    for i in range(1, len(values) + 1):
        if i == len(values) or values[i] != values[start]:
            parts.append(f"{rank_span(start, i - 1)}: {values[start]:,}{unit}")
            start = i
    if len(values) > 1 and len(parts) == 1:
        return f"all: {values[0]:,}{unit}"
    return ", ".join(parts)


def _precision_note(precision: str, element_bytes: int) -> str:
    if not precision.endswith("-mixed"):
        return precision
    kept = "FSDP keeps fp32 shards" if element_bytes == 4 else "DeepSpeed keeps 16-bit parameters"
    return f"{precision}: {kept}"


def storage_text(precision: str, element_bytes: int, dtype: str, frozen_dtype: str | None) -> str:
    """`4 bytes per element (...)`, or under LoRA how the frozen base and the adapters are stored."""
    note = _precision_note(precision, element_bytes)
    if frozen_dtype is None:
        return f"{element_bytes} bytes per element ({note})"
    frozen = ("frozen base NF4 in its layer linears (4-bit codes + block scales), bf16 elsewhere (2 bytes)"
              if frozen_dtype == "nf4" else "frozen base bf16 (2 bytes)")
    return f"{frozen}, adapters {dtype} ({element_bytes} bytes; {note})"


def _percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "0.0%"


# -- numel and blocks -------------------------------------------------------------------
def numel_text(document: dict) -> Text:
    d = document
    padding = d["padded_numel"] - d["numel"]
    if d["style"] == "even":
        extra = d["numel"] % d["world"]
        share = f"{extra} ranks hold {d['chunk']:,}, the rest {d['numel'] // d['world']:,}" if extra else (
            f"each holds {d['chunk']:,}"
        )
    else:
        share = f"each stores {d['chunk']:,}"
    out = Text(
        f"{d['style']}: {counted(d['numel'], 'element')} over {counted(d['world'], 'rank')}; {share} "
        f"(stored {d['padded_numel']:,}, padding {padding:,} = {_percent(padding, d['padded_numel'])})\n",
        style="bold",
    )
    rows = []
    for s in _elided(d["shards"]):
        if s is None:
            rows.append(["...", "", "", "", ""])
            continue
        rows.append([str(s["rank"]), f"{s['start']:,}", f"{s['end']:,}", f"{s['end'] - s['start']:,}", f"{s['padding']:,}"])
    out.append_text(_table(["rank", "start", "end", "elements", "padding"], rows, {0, 1, 2, 3, 4}))
    out.rstrip()  # the console adds the final newline
    return out


def _list_blocks(blocks: list[int]) -> str:
    shown = ", ".join(map(str, blocks[:6]))
    return shown + (f", ... ({len(blocks)})" if len(blocks) > 6 else "")


def blocks_text(document: dict) -> Text:
    d = document
    owned: dict[int, list[int]] = {}
    for entry in d["blocks"]:
        owned.setdefault(entry["owner"], []).append(entry["block"])
    out = Text(f"{d['assign']}: {counted(d['num_blocks'], 'block')} over {counted(d['world'], 'rank')}\n", style="bold")
    rows = []
    for r in _elided(d["ranks"]):
        if r is None:
            rows.append(["...", "", "", ""])
            continue
        rows.append([str(r["rank"]), _list_blocks(owned.get(r["rank"], [])), str(r["num_blocks"]), f"{100 * r['fraction']:.1f}%"])
    out.append_text(_table(["rank", "blocks", "count", "share"], rows, {0, 2, 3}))
    out.rstrip()  # the console adds the final newline
    return out


def param_blocks_text(document: dict) -> Text:
    d = document
    if d.get("frozen_dtype"):
        what = f"adapters ({d['element_bytes']} bytes per element; the frozen base has no optimizer state)"
    else:
        what = f"parameters ({d['element_bytes']} bytes per element)"
    out = Text(
        f"{d['model']}: {d['num_blocks']} {what} owned {d['assign']} over {counted(d['world'], 'rank')}; "
        "share is bytes-weighted\n",
        style="bold",
    )
    names: dict[tuple[int, int], list[str]] = {}
    for entry in d["blocks"]:
        names.setdefault((entry["stage"], entry["owner"]), []).append(entry["name"])
    multi_stage = len({r["stage"] for r in d["ranks"]}) > 1
    rows = []
    for r in _elided(d["ranks"]):
        if r is None:
            rows.append(["...", "", "", "", ""] + ([""] if multi_stage else []))
            continue
        first = names.get((r["stage"], r["rank"]), [""])
        row = [str(r["rank"]), str(r["num_blocks"]), format_bytes(r["bytes"]), f"{100 * r['fraction']:.1f}%",
               first[0] + (f", ... ({len(first)})" if len(first) > 1 else "")]
        rows.append(([str(r["stage"])] if multi_stage else []) + row)
    header = ["rank", "params", "size", "share", "first parameters"]
    if multi_stage:
        header = ["stage", *header]
    out.append_text(_table(header, rows, {0, 1, 2, 3} if not multi_stage else {0, 1, 2, 3, 4}))
    for entry in d.get("param_bytes", []):
        where = f"stage {entry['stage']}: " if multi_stage else ""
        out.append(f"{where}every rank holds all parameters whole: {format_bytes(entry['bytes'])} "
                   f"({entry['bytes']:,} bytes)\n", style="dim")
    out.rstrip()  # the console adds the final newline
    return out


# -- a model ----------------------------------------------------------------------------
def _param_rows(plan: ModelShards, params: list[ParamShards], show_tp: bool, show_stage: bool) -> list[list[str]]:
    rows = []
    for p in params:
        if p.replicated:
            why = "frozen: whole on every rank" if not p.trainable else "below min_num_params, not sharded"
            held, pad = f"all: {p.numel} ({why})", "0"
        elif p.rows is not None:
            row_numel = p.numel // p.local_shape[0] if p.local_shape and p.local_shape[0] else 0
            held = runs(list(p.rows))
            pad = runs([(s.padding // row_numel if row_numel else 0) for s in p.shards])
        else:
            held = runs([s.numel for s in p.shards])
            pad = runs([s.padding for s in p.shards])
        if p.persistent:
            held += f" + {p.numel:,} whole (persistent)"
        row = [p.name, "x".join(map(str, p.shape))]
        if plan.frozen_dtype is not None:
            row.append(p.dtype)
        if show_tp:
            row.append("x".join(map(str, p.local_shape)))
        if show_stage:
            row.append(str(p.stage))
        rows.append(row + ([held] if plan.style == "fsdp1" else [held, pad]))
    return rows


def model_text(context: dict, plan: ModelShards, num_layers: int) -> Text:
    """Header, the per-parameter table (layer 0 stands for every layer where the layers
    are cut alike), and per-rank totals. `context`: model, tp, tp_rank, pp, precision."""
    d = context
    out = Text(
        f"{d['model']}: {plan.style} over {counted(plan.world, 'rank')}"
        + (f"; tp {d['tp']} (tp rank {d['tp_rank']}'s pieces)" if d["tp"] > 1 else "")
        + (f"; pp {d['pp']}" if d["pp"] > 1 else "")
        + f"; {storage_text(d['precision'], plan.element_bytes, plan.dtype, plan.frozen_dtype)}\n",
        style="bold",
    )
    if plan.frozen_dtype is not None and plan.buffers:
        out.append("only the adapters are flattened; the frozen base stays whole on every rank\n", style="dim")
    show_tp, show_stage = d["tp"] > 1, d["pp"] > 1
    per_layer = plan.style != "zero12" and plan.style != "even"
    if per_layer:
        shown = [p for p in plan.params if p.layer is None or p.layer == 0]
        unit = "dim-0 rows per rank" if plan.style == "fsdp2" else "elements per rank"
        pad_unit = "padding rows" if plan.style == "fsdp2" else "padding"
        header = ["parameter", "shape"] + (["stored as"] if plan.frozen_dtype is not None else [])
        header += (["tp shape"] if show_tp else []) + (["stage"] if show_stage else [])
        header += [unit] if plan.style == "fsdp1" else [unit, pad_unit]
        out.append_text(_table(header, _param_rows(plan, shown, show_tp, show_stage), set()))
        if num_layers > 1:
            out.append(f"layers 1..{num_layers - 1} the same as layer 0\n", style="dim")
        kept = [p for p in plan.params if p.persistent]
        if kept:
            size = sum(p.persistent_bytes for p in kept)
            out.append(f"{counted(len(kept), 'parameter')} of at most {d['persistent_at_most']:,} elements "
                       f"(stage3_param_persistence_threshold) are also kept whole on every rank: "
                       f"{format_bytes(size)} ({size:,} bytes) per rank, in the totals\n", style="dim")
        if plan.style == "fsdp1":
            out.append_text(_flat_parameters(plan, num_layers))
    else:
        out.append_text(_buffer_ranks(plan))
    out.append("\n")
    out.append_text(totals_text(plan, show_stage))
    out.rstrip()  # the console adds the final newline
    return out


def _flat_parameters(plan: ModelShards, num_layers: int) -> Text:
    """fsdp1: the FlatParameters (root ones and layer 0's), each padded at its end."""
    out = Text("\nflat parameters (padding sits at the end of each)\n", style="bold")
    rows = []
    for buffer in plan.buffers:
        if buffer.name.startswith("layers.") and buffer.name != "layers.0":
            continue
        rows.append([
            buffer.name, str(buffer.stage), f"{buffer.numel:,}", str(buffer.num_params),
            runs([s.numel for s in buffer.shards]), runs([s.padding for s in buffer.shards]),
        ])
    out.append_text(_table(["unit", "stage", "elements", "params", "elements per rank", "padding"], rows, {1, 2, 3}))
    if num_layers > 1:
        out.append(f"layers.1..{num_layers - 1} the same as layers.0\n", style="dim")
    return out


def _buffer_title(buffer: FlatBuffer) -> str:
    """`flat buffer NAME: N elements of K parameters`; for an optimizer group (zero12) which one
    and its padded size (a multiple of 2 * world)."""
    title = f"flat buffer {buffer.name}: {buffer.numel:,} elements of {buffer.num_params} parameters"
    if buffer.group is None:
        return title
    kind = "matrices" if buffer.matrices else "vectors, no weight decay"
    return f"{title} (optimizer group {buffer.group}: {kind}), padded to {buffer.padded_numel:,}"


def _buffer_ranks(plan: ModelShards) -> Text:
    """zero12 / even: which parameters each rank's slice of each flat buffer covers."""
    out = Text()
    for buffer in plan.buffers:
        members = [p for p in plan.params if p.unit == buffer.name and p.stage == buffer.stage]
        out.append(_buffer_title(buffer) + "\n", style="dim")
        rows = []
        for shard in _elided(list(buffer.shards)):
            if shard is None:
                rows.append(["...", "", "", "", ""])
                continue
            covered = [p for p in members if p.shards[shard.rank].numel > 0]
            first = f"{covered[0].name}[{covered[0].shards[shard.rank].start:,}:]" if covered else "-"
            last = f"{covered[-1].name}[:{covered[-1].shards[shard.rank].end:,}]" if covered else "-"
            rows.append([str(shard.rank), first, last, f"{shard.numel:,}", f"{shard.padding:,}"])
        out.append_text(_table(["rank", "from", "to", "elements", "padding"], rows, {0, 3, 4}))
    return out


def totals_text(plan: ModelShards, show_stage: bool) -> Text:
    """Per-rank totals; consecutive ranks of a stage with equal totals share one row."""
    rows, run = [], []
    def flush() -> None:
        first, last = run[0], run[-1]
        row = [rank_span(first.rank, last.rank), f"{first.numel:,}", f"{first.padding:,}",
               format_bytes(first.stored_bytes), f"{first.stored_bytes:,}"]
        rows.append(([str(first.stage)] if show_stage else []) + row)

    for total in plan.totals:
        key = (total.stage, total.numel, total.padding, total.stored_bytes)
        if run and key != (run[0].stage, run[0].numel, run[0].padding, run[0].stored_bytes):
            flush()
            run = []
        run.append(total)
    if run:
        flush()
    header = (["stage"] if show_stage else []) + ["ranks", "elements", "padding", "stored", "bytes"]
    numeric = set(range(len(header))) - {1 if show_stage else 0}
    out = Text("per-rank totals (parameters only)\n", style="bold")
    out.append_text(_table(header, rows, numeric))
    return out
