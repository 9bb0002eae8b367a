"""`shardplan schedule [FILE] --pp P --microbatches M --schedule S [--virtual V] [--svg F]`.

Builds the pipeline schedule, simulates it with the given costs, and shows the timeline,
the bubble and the microbatches each rank holds. A job FILE (or job preset) supplies
parallel.pp, num_microbatches, pipeline_schedule and virtual_stages; flags override it.
"""

from __future__ import annotations

from typing import Annotated, List, Optional

import typer

from ..core.schedule import ScheduleInputError, default_costs, one_chunk_interleaved, plan_schedule
from ..core.schedule_sim import Costs
from ..render.output import emit_diagnostics, emit_json, stdout_console
from ..spec.errors import InputError, Problem
from .options import JsonFlag

# Each input: its flag, and the job-file key it can come from.
INPUTS = {
    "pp": ("--pp", "parallel.pp"),
    "microbatches": ("--microbatches", "parallel.num_microbatches"),
    "schedule": ("--schedule", "parallel.pipeline_schedule"),
    "virtual": ("--virtual", "parallel.virtual_stages"),
    "cost_f": ("--cost-f", None),
    "cost_b": ("--cost-b", None),
    "cost_w": ("--cost-w", None),
}
REQUIRED = ("pp", "microbatches", "schedule")


def _problem(field: str | None, message: str, from_file: dict[str, str]) -> Problem:
    """Blame the flag that set `field`, else the job file's key, else nobody in particular."""
    if field is None:
        return Problem("", message)
    flag, key = INPUTS[field]
    if field in from_file:
        return Problem(key or flag, message, file=from_file[field])
    return Problem(flag, message)


def _resolve(job: str | None, flags: dict[str, object],
             sets: list[str]) -> tuple[dict[str, object], dict[str, str], list[Problem]]:
    """The inputs, file values first and flags over them; where the ones that are not flags
    came from (the job file, or `--set`); and a warning for each flag a `--set` overrides.

    The flags are written into the job before it is read (as every command does), a `--set`
    of the same key after them (it wins, as over a shortcut flag elsewhere); of the job's
    cross-field rules only those of the pipeline keys stop it."""
    values: dict[str, object] = {"virtual": 1}
    from_file: dict[str, str] = {}
    warnings: list[Problem] = []
    if job is not None or sets:
        from ..io.overrides import flag_label, override_warnings, parse_set
        from .options import load_job_checked  # only with a job: a schedule from flags needs no pydantic

        parsed = [parse_set(s) for s in sets]
        set_keys = {key for key, _ in parsed}
        flagged = {INPUTS[field][1]: (value, flag_label(INPUTS[field][0][2:], value)) for field, value in flags.items()
                   if value is not None and INPUTS[field][1] is not None}
        warnings = override_warnings({}, sets, flagged)
        flags = {field: value for field, value in flags.items() if INPUTS[field][1] not in set_keys}
        overrides = [(INPUTS[field][1], value) for field, value in flags.items()
                     if value is not None and INPUTS[field][1] is not None]
        # The file's pipeline keys are checked here, with their lines; keys a flag set are
        # checked by the schedule itself, which names the flag.
        file_keys = tuple(key for _, key in INPUTS.values() if key and key not in dict(overrides))
        par = load_job_checked(job, overrides + parsed, env={},
                               warn_only=lambda problem: not file_keys or not problem.path.startswith(file_keys)).job.parallel
        values.update(pp=par.pp, microbatches=par.num_microbatches,
                      schedule=par.pipeline_schedule, virtual=par.virtual_stages)
        for field in ("pp", "microbatches", "schedule", "virtual"):
            if INPUTS[field][1] in set_keys:
                from_file[field] = "--set"
            elif job is not None:
                from_file[field] = job
    for field, value in flags.items():
        if value is not None:
            values[field] = value
            from_file.pop(field, None)
    missing = [field for field in REQUIRED if field not in values]
    if missing:
        raise InputError([
            Problem(INPUTS[f][0], f"required (or give a job FILE that sets {INPUTS[f][1]})") for f in missing
        ])
    return values, from_file, warnings


def schedule(
    job: Annotated[Optional[str], typer.Argument(
        help="job file or job preset to read parallel.pp, num_microbatches, pipeline_schedule, "
        "virtual_stages from", show_default=False)] = None,
    pp: Annotated[Optional[int], typer.Option("--pp", help="pipeline ranks", show_default=False)] = None,
    microbatches: Annotated[Optional[int], typer.Option(
        "--microbatches", help="microbatches per step", show_default=False)] = None,
    schedule_name: Annotated[Optional[str], typer.Option(
        "--schedule", help="gpipe | 1f1b | interleaved-1f1b | zero-bubble | round-robin",
        show_default=False)] = None,
    virtual: Annotated[Optional[int], typer.Option(
        "--virtual", help="model chunks per rank, for interleaved-1f1b and round-robin (default 1)",
        show_default=False)] = None,
    svg: Annotated[Optional[str], typer.Option(
        "--svg", help="also write the timeline as a standalone SVG file", show_default=False)] = None,
    cost_f: Annotated[Optional[int], typer.Option(
        "--cost-f", help="time units of a forward (default 1)", show_default=False)] = None,
    cost_b: Annotated[Optional[int], typer.Option(
        "--cost-b", help="time units of a backward; for zero-bubble its input-gradient part "
        "(default 2; zero-bubble 1)", show_default=False)] = None,
    cost_w: Annotated[Optional[int], typer.Option(
        "--cost-w", help="time units of a weight gradient, zero-bubble only (default 1)",
        show_default=False)] = None,
    sets: Annotated[Optional[List[str]], typer.Option(
        "--set", help="override a job-file key: section.key=value (repeatable)", show_default=False)] = None,
    json_out: JsonFlag = False,
) -> None:
    """Build a pipeline schedule and simulate it: per-rank timeline, bubble, microbatches in flight."""
    from ..io.writing import output_target, write_text
    from ..render.schedule import print_schedule, schedule_document, schedule_svg

    flags = {"pp": pp, "microbatches": microbatches, "schedule": schedule_name, "virtual": virtual,
             "cost_f": cost_f, "cost_b": cost_b, "cost_w": cost_w}
    svg = output_target(svg, "--svg", "the schedule" if not json_out else "the JSON document")
    values, from_file, warnings = _resolve(job, flags, sets or [])
    emit_diagnostics(warnings)
    name = values["schedule"]
    defaults = default_costs(name)
    costs = Costs(
        forward=defaults.forward if cost_f is None else cost_f,
        backward=defaults.backward if cost_b is None else cost_b,
        weight=defaults.weight if cost_w is None else cost_w,
    )
    try:
        plan = plan_schedule(name, values["pp"], values["microbatches"], values["virtual"], costs)
    except ScheduleInputError as exc:
        raise InputError(_problem(exc.field, exc.message, from_file)) from None
    # (with a job file or --set the job's own check has said it)
    message = one_chunk_interleaved(name, values["pp"], values["virtual"], values["microbatches"])
    if message and "virtual" not in from_file:
        emit_diagnostics([Problem("--virtual", message, severity="warning")])
    if svg is not None:
        write_text(svg, schedule_svg(plan), "--svg")
    if json_out:
        emit_json(schedule_document(plan))
    else:
        print_schedule(stdout_console(), plan)
    if svg is not None:
        emit_diagnostics([f"wrote {svg}"])


def register(app: typer.Typer) -> None:
    app.command("schedule")(schedule)
