"""`shardplan layout [FILE] [--dp --tp --pp --cp] [--order] [--gpus-per-node] [--rank R]`."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..core.degrees import Degrees
from ..core.layout import Layout, layout_warnings
from ..io.overrides import Override, flag_label, set_key
from ..render.layout import layout_document, layout_picture, rank_document, rank_text
from ..render.output import write_document
from ..render.output import emit_diagnostics, stdout_console
from ..spec.errors import InputError, PlanError, Problem
from ..spec.job import JobSpec
from .options import JsonFlag, PlanFlags, WorldOption, load_job_checked, plan_flags

# Job-file fields whose cross-field rules do not move a rank: the pipeline schedule, the
# training step, ZeRO/offload and run-time settings. A job that breaks only those still has
# a layout, and `layout` shows their problems as warnings; every other error (degrees,
# order, world, cluster, the model) stops it, as bad input.
NOT_PLACEMENT = (
    "parallel.num_microbatches", "parallel.virtual_stages", "parallel.pipeline_schedule",
    "parallel.sequence_parallel", "parallel.micro_batch_size", "train.", "zero.", "offload.",
    "data.", "checkpoint.",
)


def _moves_ranks(problem: Problem) -> bool:
    return not problem.path.startswith(NOT_PLACEMENT)


def load_placement(
    file: str | None, overrides: list[Override], labels: dict[str, str], world: int | None
) -> tuple[JobSpec, list[Problem]]:
    """The job's tables and the problems to show as warnings; errors that matter for
    placement stop it (every problem of the file is then listed, as `validate` would)."""
    resolved = load_job_checked(file, overrides, world=world, flag_labels=labels,
                                warn_only=lambda problem: not _moves_ranks(problem))
    return resolved.job, resolved.warnings


@plan_flags
def layout(
    file: Annotated[Optional[str], typer.Argument(help="job file (TOML or JSON) or job preset name")] = None,
    order: Annotated[
        Optional[str],
        typer.Option("--order", help="rank order, fastest axis first, e.g. tp-cp-dp-pp (sets parallel.order)"),
    ] = None,
    rank: Annotated[Optional[int], typer.Option("--rank", help="show one rank: coordinates, node, groups")] = None,
    world: WorldOption = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """Rank grid, process groups and node placement: which rank does what."""
    overrides, labels = flags.overrides(), flags.labels()
    ordered = {}
    if order is not None:  # as a shortcut flag: a `--set parallel.order=...` wins over it
        ordered["parallel.order"] = (order, flag_label("order", order))
        overrides.insert(0, ("parallel.order", order))
        if not any(set_key(expression) == "parallel.order" for expression in flags.sets):
            labels["parallel.order"] = ordered["parallel.order"][1]
    job, problems = load_placement(file, overrides, labels, world)
    problems[:0] = flags.override_warnings(ordered)
    par = job.parallel
    degrees = Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    grid = Layout(degrees, par.order, job.cluster.gpus_per_node)
    if rank is not None:
        try:
            grid.check_rank(rank)
        except PlanError as exc:
            raise InputError(Problem("--rank", str(exc))) from None
    warnings = layout_warnings(grid)
    # The job's placement warnings are the layout's own: say each once.
    problems = [p for p in problems if p.message not in warnings]
    emit_diagnostics([*problems, *(f"warning: {w}" for w in warnings)])
    if rank is not None:
        document = rank_document(grid, rank, warnings)
        if json_out:
            write_document(document)
        else:
            stdout_console().print(rank_text(document), soft_wrap=True)
        return
    if json_out:
        write_document(layout_document(grid, warnings))
    else:
        stdout_console().print(layout_picture(grid), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("layout")(layout)
