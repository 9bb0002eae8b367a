"""`shardplan run` output: the progress bar and the estimate-vs-measured table."""

from __future__ import annotations

import sys

from rich.console import Console, Group
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from ..spec.units import format_bytes

KINDS = ("params", "grads", "optimizer", "activations")


class StepProgress:
    """A rich progress bar on stderr: step, loss, tokens per second. Without a total yet (the
    workers are starting), the bar pulses."""

    def __init__(self, total: int | None, completed: int = 0):
        self.progress = Progress(
            TextColumn("training"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[speed]} tokens/s"),
            TimeElapsedColumn(), console=Console(file=sys.stderr), transient=False,
        )
        self.task = self.progress.add_task("train", total=total, completed=completed, loss="-", speed="-")

    def __enter__(self) -> StepProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> bool:
        self.progress.__exit__(*exc)
        return False

    def advance(self, step: int, loss: float, tokens_per_second: float) -> None:
        self.progress.update(self.task, completed=step, loss=f"{loss:.4f}", speed=f"{tokens_per_second:,.0f}")

    def show(self, records: list[dict]) -> None:
        """Records of `io.progress`: a header (re)starts the count, a step advances it."""
        for record in records:
            if "total" in record:
                self.progress.update(self.task, total=record["total"], completed=record["completed"])
            elif "step" in record:
                self.advance(record["step"], record["loss"], record["tokens_per_second"])


def progress_bar(total: int | None, completed: int = 0) -> StepProgress:
    return StepProgress(total, completed)


def difference(estimated: int, measured: int) -> str:
    if measured == 0:
        return "exact" if estimated == 0 else "n/a"
    if estimated == measured:
        return "exact"
    return f"{(estimated - measured) / measured:+.1%}"


def run_table(report: dict, model: str) -> Group:
    """One row per rank and kind: estimate, measurement, difference; with offload, the
    measured share in host memory (and the estimate's where it differs)."""
    table = Table(title=f"{model}: estimate vs measured per rank", title_justify="left")
    offloaded = any(entry["measured"].get("placement", {}).get(kind, {}).get("host")
                    for entry in report["ranks"] for kind in KINDS)
    columns = [("rank", "right"), ("coords", "left"), ("kind", "left"),
               ("estimated", "right"), ("measured", "right"), ("diff", "right")]
    if offloaded:
        columns.append(("on host", "right"))
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for entry in report["ranks"]:
        c = entry["coords"]
        coords = f"dp{c['dp']} tp{c['tp']} pp{c['pp']}"
        for index, kind in enumerate(KINDS):
            est, meas = entry["estimated"][kind], entry["measured"][kind]
            first = index == 0
            cells = [str(entry["rank"]) if first else "", coords if first else "", kind,
                     format_bytes(est), format_bytes(meas), difference(est, meas)]
            if offloaded:
                host = [side.get("placement", {}).get(kind, {}).get("host") for side in (entry["estimated"], entry["measured"])]
                cells.append("" if host[0] is None else format_bytes(host[1] or 0) if host[0] == host[1]
                             else f"{format_bytes(host[1] or 0)} (est. {format_bytes(host[0])})")
            table.add_row(*cells, end_section=index == len(KINDS) - 1)
        if entry["measured"].get("peak_device") is not None:
            est, meas = entry["estimated"]["peak_device"], entry["measured"]["peak_device"]
            what = "peak allocated" if report["device"] == "cuda" else "peak process growth"
            table.add_row("", "", f"{what} ({entry['estimated'].get('peak_moment', '')})", format_bytes(est),
                          format_bytes(meas), difference(est, meas), *([""] if offloaded else []), end_section=True)
    steps = report["steps"] or [{"loss": float("nan")}]
    lines = [
        Text(f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f} over {len(steps)} steps; "
             f"{report['step_seconds']:.3f} s/step, {report['tokens_per_second']:,.0f} tokens/s"
             + (f", MFU {report['mfu']:.1%}" if report.get("mfu") else "")),
    ]
    exposed = [e.get("exposed_copy_seconds") for e in report["ranks"] if e.get("exposed_copy_seconds") is not None]
    if exposed and report["steps"]:
        lines.append(Text(f"offload copies not hidden behind compute: {max(exposed) / len(report['steps']):.3f} s/step "
                          "(the slowest rank)"))
    if report.get("pipeline_schedule"):
        lines.append(Text(f"pipeline schedule: torch {report['pipeline_schedule']}"))
    resumed = report.get("resumed_from")
    if resumed:
        note = f", {resumed['resharded']}" if resumed.get("resharded") else ""
        lines.append(Text(f"resumed from {resumed['path']} after step {resumed['step']}{note}"))
        if resumed.get("checkpoint_lr") is not None:
            lines.append(Text(f"learning rate: the job's {resumed['lr']:g}; the checkpoint's optimizer had "
                              f"{resumed['checkpoint_lr']:g}"))
    return Group(table, *lines)
