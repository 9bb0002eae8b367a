"""Estimate -> a table with bars, headroom lines, `--explain` formulas, or JSON."""

from __future__ import annotations

from rich.text import Text

from ..core.memory import Estimate
from ..core.timeline import MOMENT_HELP
from ..spec.units import byte_unit, format_bytes, format_count

GPU_KINDS = ("params", "grads", "optimizer", "activations", "buffers")
COLOURS = {"params": "blue", "grads": "magenta", "optimizer": "yellow", "activations": "green", "buffers": "cyan"}
BAR_WIDTH = 12
SHORT = {"optimizer": "optim", "activations": "activ"}


def _ranks(ranks: list[int]) -> str:
    """The stage's ranks in one form for every row: runs of consecutive ranks (`0-7`, `8-15`,
    `0,8`); beyond three runs the middle ones elided (`0,2,..,14`). JSON lists them all."""
    ordered = sorted(ranks)
    runs, start = [], 0
    for i in range(1, len(ordered) + 1):
        if i == len(ordered) or ordered[i] != ordered[i - 1] + 1:
            first, last = ordered[start], ordered[i - 1]
            runs.append(str(first) if first == last else f"{first}-{last}")
            start = i
    return ",".join(runs if len(runs) <= 3 else [runs[0], runs[1], "..", runs[-1]])


def _bar(gpu: dict[str, int], scale: int) -> Text:
    bar = Text()
    used = 0
    for kind in GPU_KINDS:
        cells = round(BAR_WIDTH * gpu[kind] / scale) if scale else 0
        cells = min(cells, BAR_WIDTH - used)
        bar.append("█" * cells, style=COLOURS[kind])
        used += cells
    bar.append("·" * (BAR_WIDTH - used), style="dim")
    return bar


def estimate_table(result: Estimate, gpu_memory: int | None, title: str) -> list[Text]:
    """One line per pipeline stage, all figures in one unit, and a bar against the GPU."""
    largest = max([result.peak_gpu_bytes] + [d.cpu["total"] for d in result.devices])
    unit, size = byte_unit(largest)  # one unit for the whole table: narrow, comparable columns
    cell = (lambda value: f"{value / size:.2f}") if size > 1 else str
    headers = ["stage", "ranks", *(SHORT.get(k, k) for k in GPU_KINDS), "GPU", "peak at", "CPU"]
    rows = []
    for device in result.devices:
        gpu = device.gpu
        rows.append([str(device.stage), _ranks(device.ranks), *(cell(gpu[k]) for k in GPU_KINDS),
                     cell(gpu["total"]), device.peak_moment, cell(device.cpu["total"])])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    scale = gpu_memory or result.peak_gpu_bytes

    def line(cells: list[str], styles: list[str]) -> Text:
        text = Text()
        for i, value in enumerate(cells):
            text.append(" " * (widths[i] - len(value) + (0 if i == 0 else 2)))
            text.append(value, style=styles[i])
        return text

    styles = ["", "", *(COLOURS[k] for k in GPU_KINDS), "bold", "", ""]
    lines = [Text(f"{title} ({unit})", style="bold")]
    header = line(headers, [""] * len(headers))
    header.append("  " + ("of GPU" if gpu_memory else "of peak"))
    lines.append(header)
    for device, row in zip(result.devices, rows):
        text = line(row, styles)
        text.append("  ")
        text.append_text(_bar(device.gpu, scale))
        lines.append(text)
    return lines


def summary_lines(result: Estimate, gpu_memory: int | None, cpu_memory: int | None,
                  budget_written: bool = False) -> list[Text]:
    p = result.params
    params = f"parameters {format_count(p['total'])} ({p['total']:,})"
    if p["active"] != p["total"]:
        params += f", active per token {format_count(p['active'])}"
    if p["trainable"] != p["total"]:
        params += f", trainable {format_count(p['trainable'])} ({p['trainable']:,})"
    lines = [Text(params)]
    peak = result.peak_gpu_bytes
    if gpu_memory:
        share = peak / gpu_memory
        style = "green" if peak <= gpu_memory else "bold red"
        lines.append(Text(
            f"peak GPU {format_bytes(peak)} of {format_bytes(gpu_memory)} ({share:.0%}), "
            f"headroom {format_bytes(gpu_memory - peak)}", style=style))
    else:
        lines.append(Text(f"peak GPU {format_bytes(peak)} (no GPU memory stated: set cluster.gpu_memory or "
                          "[cluster] preset to check the fit)"))
    cpu = f"host per node {format_bytes(result.cpu_bytes_per_node)} at {result.host_moment}"
    if cpu_memory:
        where = ("offload.cpu_memory_budget, at most the node's RAM" if budget_written
                 else "cpu_memory_budget: the node's RAM less a reserve")
        cpu += f" of {format_bytes(cpu_memory)} ({where})"
    ranked = sorted(result.host_breakdown.items(), key=lambda item: -item[1])
    largest, rest = ranked[:3], ranked[3:]
    if largest:
        cpu += ": " + ", ".join(f"{label} {format_bytes(value)}" for label, value in largest)
    if rest:  # the line names the three largest; the others add up to the total
        cpu += f", {len(rest)} more {format_bytes(sum(value for _, value in rest))}"
    lines.append(Text(cpu))
    for decision in result.decisions:
        lines.append(Text(f"offload: {decision}", style="yellow"))
    if result.fits is not None:
        lines.append(Text("fits" if result.fits else "does NOT fit", style="bold green" if result.fits else "bold red"))
    return lines


def explain_lines(result: Estimate) -> list[Text]:
    lines: list[Text] = []
    for device in result.devices:
        lines.append(Text(f"stage {device.stage}: peak at {device.peak_moment} "
                          f"({MOMENT_HELP[device.peak_moment]})", style="bold"))
        for moment in device.moments:
            mark = "  <- peak" if moment.name == device.peak_moment else ""
            lines.append(Text(f"  moment {moment.name}: {format_bytes(moment.total)}{mark}"))
        lines.append(Text(f"  terms at {device.peak_moment}:"))
        for key, terms in device.terms.items():
            for term in terms:
                formula = f" = {term.formula}" if term.formula else ""
                lines.append(Text(f"  {key}: {term.label}{formula} = {format_bytes(term.bytes)}"))
        if device.host or device.startup:
            lines.append(Text("  host memory of one rank (the node adds its ranks and a runtime allowance each):"))
            for moment, terms in (("training", device.host), ("start-up", device.startup)):
                for term in terms:
                    formula = f" = {term.formula}" if term.formula else ""
                    lines.append(Text(f"  host.{moment}: {term.label}{formula} = {format_bytes(term.bytes)}"))
    return lines


def print_estimate(console, result: Estimate, gpu_memory: int | None, cpu_memory: int | None,
                   title: str, explain: bool, timing=None, budget_written: bool = False) -> None:
    """The table, then one unwrapped line per summary item (and formula with `--explain`);
    with `timing` (core.step_time.StepTime), the time lines under the summary;
    `budget_written`: the job gives offload.cpu_memory_budget (the host limit's source)."""
    lines = estimate_table(result, gpu_memory, title) + summary_lines(result, gpu_memory, cpu_memory, budget_written)
    if timing is not None:
        from .time import time_lines

        lines += time_lines(timing)
    lines += explain_lines(result) if explain else []
    if timing is not None and explain:
        from .time import time_explain_lines

        lines += time_explain_lines(timing)
    for line in lines:
        console.print(line, soft_wrap=True)


def estimate_document(result: Estimate, gpu_memory: int | None, explain: bool, cpu_memory: int | None = None) -> dict:
    """The contract's `estimate` JSON (byte figures are integers); `cpu_memory`: the host limit
    per node `fits` is checked against (None when unknown)."""
    devices = []
    for device in result.devices:
        entry = {
            "stage": device.stage,
            "ranks": device.ranks,
            "gpu": device.gpu,
            "cpu": device.cpu,
            "peak_moment": device.peak_moment,
            "moments": device.moment_totals,
            "states": device.states,
            "saved_activations": device.saved_activations,
            "layers": device.num_layers,
            "resident_layers": device.resident_layers,
        }
        if explain:
            entry["terms"] = {
                key: [{"label": t.label, "bytes": t.bytes, "formula": t.formula} for t in terms]
                for key, terms in device.terms.items()
            }
            entry["host_terms"] = {
                moment: [{"label": t.label, "bytes": t.bytes, "formula": t.formula} for t in terms]
                for moment, terms in (("training", device.host), ("start-up", device.startup))
            }
        devices.append(entry)
    return {
        "params": result.params,
        "devices": devices,
        "peak_gpu_bytes": result.peak_gpu_bytes,
        "cpu_bytes_per_node": result.cpu_bytes_per_node,
        "host": {"per_node": result.cpu_bytes_per_node, "moment": result.host_moment,
                 "breakdown": result.host_breakdown, "limit": cpu_memory},
        "cpu_pinned": result.cpu_pinned,
        "gpu_memory": gpu_memory,
        "headroom_bytes": None if gpu_memory is None else gpu_memory - result.peak_gpu_bytes,
        "fits": result.fits,
        "decisions": result.decisions,
        "assumptions": result.assumptions,
        "warnings": result.warnings,
    }


def print_changes(console, changes, gpu_memory: int) -> None:
    """What would make the plan fit (io/to_fit.py), one line per change, fastest first."""
    if not changes:
        console.print(Text("to fit: no change of the plan fits these GPUs at this global batch; "
                           "`shardplan plan --gpus N` searches larger worlds", style="yellow"), soft_wrap=True)
        return
    timed = changes[0].step_seconds is not None
    head = "to fit, change (found by the planner's search, " + (
        "fastest first):" if timed else "ranked with H100 figures; set cluster.gpu for step times):")
    console.print(Text(head, style="bold"), soft_wrap=True)
    for change in changes:
        figures = f"peak {format_bytes(change.peak_gpu_bytes)} ({change.peak_gpu_bytes / gpu_memory:.0%})"
        if change.step_seconds is not None:
            figures += f", {change.step_seconds:.3f} s per step"
        console.print(Text(f"  {change.flags()}  ({change.lever}: {figures})"), soft_wrap=True)
