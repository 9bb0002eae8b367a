"""A simulated pipeline schedule as JSON, a coloured terminal timeline, or a standalone SVG.

Formats only: every number comes from `core.schedule.SchedulePlan`. The terminal picture
and the SVG draw the same grid (one cell per rank per time unit, the label of the action
running then, idle cells shown) in the same colours.
"""

from __future__ import annotations

from typing import TYPE_CHECKING
from xml.sax.saxutils import escape, quoteattr

from rich.text import Text

from ..core.schedule import SPLIT_BACKWARD, SchedulePlan
from ..core.schedule_sim import BACKWARD, FORWARD, WEIGHT, Action
from ..spec.units import counted

if TYPE_CHECKING:
    from rich.console import Console

# Colour per kind, one shade per chunk (chunk c uses shade c % len): dark to light, so the
# chunks of interleaved and round-robin schedules tell apart as in Megatron-LM's figure 4.
PALETTE = {
    FORWARD: ("#1f5fa8", "#5b93d6", "#a3c4ec"),
    BACKWARD: ("#1e7a3c", "#47b06a", "#9ad8ab"),
    WEIGHT: ("#7b3fa0", "#a774c7", "#d2b6e4"),
}
IDLE_FILL, IDLE_STROKE, IDLE_GLYPH = "#eeeeee", "#c8c8c8", "·"
FONT = "DejaVu Sans Mono, Menlo, Consolas, monospace"


def action_label(action: Action, virtual: int) -> str:
    """`F3` (forward of microbatch 3), or `F3s5` (on global stage 5) when ranks hold chunks."""
    base = f"{action.kind}{action.microbatch}"
    return f"{base}s{action.stage}" if virtual > 1 else base


def action_fill(action: Action, pp: int) -> str:
    shades = PALETTE[action.kind]
    return shades[(action.stage // pp) % len(shades)]


def _ink(fill: str) -> str:
    """Black or white text, whichever reads on `fill` (relative luminance, ITU-R BT.709)."""
    r, g, b = (int(fill[i:i + 2], 16) for i in (1, 3, 5))
    return "#000000" if 0.2126 * r + 0.7152 * g + 0.0722 * b > 150 else "#ffffff"


def kind_names(schedule: str) -> dict[str, str]:
    if schedule in SPLIT_BACKWARD:
        return {FORWARD: "forward", BACKWARD: "backward, input gradient", WEIGHT: "weight gradient"}
    return {FORWARD: "forward", BACKWARD: "backward"}


def costs_json(plan: SchedulePlan) -> dict[str, int]:
    costs = {FORWARD: plan.costs.forward, BACKWARD: plan.costs.backward}
    if plan.schedule in SPLIT_BACKWARD:
        costs[WEIGHT] = plan.costs.weight
    return costs


def schedule_document(plan: SchedulePlan) -> dict:
    """The `schedule --json` document (CONTRACT), without `schema_version`."""
    grid = [[action_label(a, plan.virtual) if a else None for a in row] for row in plan.timeline.grid()]
    return {
        "schedule": plan.schedule,
        "pp": plan.pp,
        "microbatches": plan.microbatches,
        "virtual": plan.virtual,
        "stages": plan.num_stages,
        "costs": costs_json(plan),
        "makespan": plan.makespan,
        "ideal": plan.ideal,
        "idle": plan.idle,
        "bubble_fraction": float(plan.bubble),
        "inflight": plan.inflight,
        "grid": grid,
    }


def chunk_note(plan: SchedulePlan) -> str:
    """How the picture tells chunks apart (only drawn when ranks hold several)."""
    shades = len(PALETTE[FORWARD])
    order = ", ".join(str(c) for c in range(min(plan.virtual, shades)))
    again = ", repeating" if plan.virtual > shades else ""
    return f"chunks by shade, dark to light: {order}{again}; stage = rank + {plan.pp} * chunk"


def _costs_text(plan: SchedulePlan) -> str:
    return " ".join(f"{kind}={cost}" for kind, cost in costs_json(plan).items())


def title_line(plan: SchedulePlan) -> str:
    chunks = f", {plan.virtual} chunks per rank ({plan.num_stages} stages)" if plan.virtual > 1 else ""
    return f"{plan.schedule}: pp {plan.pp}, {counted(plan.microbatches, 'microbatch')}{chunks}"


def costs_line(plan: SchedulePlan) -> str:
    return f"costs in time units: {_costs_text(plan)}; one cell per rank per time unit"


def summary_lines(plan: SchedulePlan) -> list[str]:
    """The figures under the picture (docs/schedule.md explains each)."""
    per_item = " + ".join(f"{kind} {cost}" for kind, cost in costs_json(plan).items())
    chunks = f"{plan.virtual} chunks x " if plan.virtual > 1 else ""
    bubble = plan.bubble
    total = plan.makespan * plan.pp
    inflight = ", ".join(str(n) for n in plan.inflight)
    unit = "(microbatch, chunk) pairs" if plan.virtual > 1 else "microbatches"
    return [
        f"makespan {plan.makespan}; ideal {plan.ideal} = {chunks}{counted(plan.microbatches, 'microbatch')}"
        f" x ({per_item}) per rank",
        f"bubble {float(bubble):.1%} = {plan.idle} idle / {total} ({plan.makespan} x {counted(plan.pp, 'rank')})"
        f" = {bubble}",
        f"peak {unit} in flight per rank (0..{plan.pp - 1}): {inflight}",
    ]


# --- terminal -------------------------------------------------------------------------

def _ruler(start: int, stop: int, cell: int, tick: int) -> str:
    line = [" "] * ((stop - start) * cell)
    for t in range(start, stop):
        if t % tick == 0:
            mark = str(t)
            pos = (t - start) * cell
            if pos + len(mark) <= len(line):
                line[pos:pos + len(mark)] = mark
    return "".join(line).rstrip()


def timeline_text(plan: SchedulePlan, width: int) -> list[Text]:
    """The grid in bands that fit `width` columns; colours by kind and chunk, idle as `·`."""
    grid = plan.timeline.grid()
    labels = [[action_label(a, plan.virtual) if a else "" for a in row] for row in grid]
    label_width = max([len(x) for row in labels for x in row] + [1])
    cell = label_width + 1
    names = [f"rank {r}" for r in range(plan.pp)]
    gutter = max(len(n) for n in names) + 2
    per_band = max(1, (width - gutter) // cell)
    tick = 5 if cell * 5 > len(str(plan.makespan)) else 10
    lines: list[Text] = []
    for start in range(0, max(plan.makespan, 1), per_band):
        stop = min(plan.makespan, start + per_band)
        lines.append(Text(" " * gutter + _ruler(start, stop, cell, tick), style="dim"))
        for rank, row in enumerate(grid):
            line = Text(names[rank].ljust(gutter))
            for t in range(start, stop):
                action = row[t]
                if action is None:
                    line.append(IDLE_GLYPH.ljust(cell) if t + 1 < stop else IDLE_GLYPH, style="dim")
                    continue
                fill = action_fill(action, plan.pp)
                style = f"{_ink(fill)} on {fill}"
                line.append(labels[rank][t].ljust(label_width), style=style)
                if t + 1 < stop:
                    joined = row[t + 1] == action  # one bar across a multi-unit action
                    line.append(" ", style=style if joined else None)
            lines.append(line)
        lines.append(Text(""))
    return lines


def legend_text(plan: SchedulePlan) -> Text:
    legend = Text()
    for kind, name in kind_names(plan.schedule).items():
        fill = PALETTE[kind][0]
        legend.append(f" {kind} ", style=f"{_ink(fill)} on {fill}")
        legend.append(f" {name}   ")
    legend.append(IDLE_GLYPH, style="dim")
    legend.append(" idle")
    return legend


def print_schedule(console: Console, plan: SchedulePlan) -> None:
    console.print(Text(title_line(plan)))
    console.print(Text(costs_line(plan)))
    console.print()
    for line in timeline_text(plan, console.width):
        console.print(line, no_wrap=True, overflow="ignore")
    console.print(legend_text(plan))
    if plan.virtual > 1:
        console.print(Text(chunk_note(plan)))
    for line in summary_lines(plan):
        console.print(Text(line))


# --- SVG ------------------------------------------------------------------------------

CELL_HEIGHT, ROW_GAP, MARGIN, CHAR_WIDTH, FONT_SIZE = 22, 4, 16, 7, 11
# The widest picture drawn: it reads at full size on a 1440-pixel laptop screen. A longer
# timeline wraps into bands stacked top to bottom, as the terminal picture does, instead of
# shrinking its labels to nothing.
MAX_SVG_WIDTH = 1400
RULER_HEIGHT, BAND_GAP = 18, 14


def svg_bands(makespan: int, cell: int, gutter: int) -> list[tuple[int, int]]:
    """[start, stop) time units of each band: as few bands as fit MAX_SVG_WIDTH, equally long."""
    fits = max(1, (MAX_SVG_WIDTH - gutter - MARGIN) // cell)
    count = max(1, -(-makespan // fits))
    length = -(-makespan // count) if makespan else 1
    return [(start, min(makespan, start + length)) for start in range(0, max(makespan, 1), length)]


def schedule_svg(plan: SchedulePlan) -> str:
    """A standalone SVG document of the timeline (wrapped into bands), its legend and its
    figures."""
    grid = plan.timeline.grid()
    longest = max([len(action_label(s.action, plan.virtual)) for rank in plan.timeline.spans for s in rank] + [1])
    cell = max(16, CHAR_WIDTH * longest + 6)
    gutter = MARGIN + CHAR_WIDTH * (len(f"rank {plan.pp - 1}") + 1)
    row_step = CELL_HEIGHT + ROW_GAP
    bands = svg_bands(plan.makespan, cell, gutter)
    band_height = RULER_HEIGHT + row_step * plan.pp + BAND_GAP
    first_top = MARGIN + 38 + RULER_HEIGHT  # under the title lines, below the first ruler
    grid_width = cell * max(stop - start for start, stop in bands)
    legend_y = first_top - RULER_HEIGHT + band_height * len(bands)
    lines_y = legend_y + 30
    text_lines = ([chunk_note(plan)] if plan.virtual > 1 else []) + summary_lines(plan)
    width = max(gutter + grid_width + MARGIN, MARGIN * 2 + CHAR_WIDTH * max(len(x) for x in [costs_line(plan), *text_lines]))
    height = lines_y + 18 * len(text_lines) + MARGIN
    out = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family={quoteattr(FONT)} font-size="{FONT_SIZE}">',
        f"<title>{escape(title_line(plan))}</title>",
        f'<rect x="0" y="0" width="{width}" height="{height}" fill="#ffffff"/>',
        f'<text x="{MARGIN}" y="{MARGIN + 10}" font-size="13" font-weight="bold">{escape(title_line(plan))}</text>',
        f'<text x="{MARGIN}" y="{MARGIN + 28}">{escape(costs_line(plan))}</text>',
    ]
    tick = 5 if cell * 5 >= CHAR_WIDTH * (len(str(plan.makespan)) + 1) else 10
    for index, (start, stop) in enumerate(bands):
        top = first_top + index * band_height
        x_of = lambda t: gutter + (t - start) * cell  # noqa: E731 - time unit -> x in this band
        for t in range(start - start % tick + (tick if start % tick else 0), stop + 1, tick):
            out.append(f'<line x1="{x_of(t)}" y1="{top - 8}" x2="{x_of(t)}" y2="{top - 2}" stroke="#888888"/>')
            out.append(f'<text x="{x_of(t) + 2}" y="{top - 10}" fill="#555555">{t}</text>')
        for rank, row in enumerate(grid):
            y = top + rank * row_step
            out.append(f'<text x="{MARGIN}" y="{y + CELL_HEIGHT - 7}">rank {rank}</text>')
            for t in range(start, stop):
                if row[t] is None:
                    out.append(
                        f'<rect x="{x_of(t)}" y="{y}" width="{cell}" height="{CELL_HEIGHT}" '
                        f'fill="{IDLE_FILL}" stroke="{IDLE_STROKE}" stroke-width="0.5"/>'
                    )
            for span in plan.timeline.spans[rank]:
                left, right = max(span.start, start), min(span.end, stop)
                if left >= right:
                    continue  # in another band (an action across a band's end is drawn in both)
                x, w = x_of(left), (right - left) * cell
                fill = action_fill(span.action, plan.pp)
                label = escape(action_label(span.action, plan.virtual))
                out.append(
                    f'<rect x="{x}" y="{y}" width="{w}" height="{CELL_HEIGHT}" fill="{fill}" stroke="#ffffff" '
                    f'stroke-width="1"><title>rank {rank} {label}: units {span.start}-{span.end}</title></rect>'
                )
                out.append(
                    f'<text x="{x + w / 2:g}" y="{y + CELL_HEIGHT - 7}" text-anchor="middle" '
                    f'fill="{_ink(fill)}">{label}</text>'
                )
    x = MARGIN
    for kind, name in kind_names(plan.schedule).items():
        fill = PALETTE[kind][0]
        out.append(f'<rect x="{x}" y="{legend_y}" width="14" height="14" fill="{fill}"/>')
        text = f"{kind} {name}"
        out.append(f'<text x="{x + 20}" y="{legend_y + 11}">{escape(text)}</text>')
        x += 20 + CHAR_WIDTH * len(text) + 18
    out.append(
        f'<rect x="{x}" y="{legend_y}" width="14" height="14" fill="{IDLE_FILL}" stroke="{IDLE_STROKE}"/>'
    )
    out.append(f'<text x="{x + 20}" y="{legend_y + 11}">idle</text>')
    for i, line in enumerate(text_lines):
        out.append(f'<text x="{MARGIN}" y="{lines_y + 18 * i}">{escape(line)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
