"""`shardplan plan [FILE] [--gpus N | --nodes N] [--global-batch B] [--top K] [--write F]`:
the plans that fit, fastest first."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..spec.common import MAX_WORLD_SIZE
from ..spec.errors import EXIT_INFEASIBLE, InputError, Problem
from .options import JsonFlag, PlanFlags, plan_flags

# Job keys the search sets: their cross-field problems in the job as written (defaults such
# as one microbatch with pp > 1) are the search's to solve, not the user's.
SEARCHED_PATHS = ("parallel", "zero.stage", "zero.hybrid", "train.global_batch_size",
                  "train.activation_checkpointing", "cluster.gpus_per_node", "cluster.nodes")


def _searched(problem: Problem) -> bool:
    return problem.path == "parallel" or problem.path.startswith(("parallel.",)) or problem.path in SEARCHED_PATHS


@plan_flags
def plan(
    file: Annotated[Optional[str], typer.Argument(help="job file (TOML/JSON) or job preset name")] = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", min=1, max=MAX_WORLD_SIZE,
                                                help="GPUs (ranks) to plan for")] = None,
    nodes: Annotated[Optional[int], typer.Option("--nodes", min=1, max=MAX_WORLD_SIZE,
                                                help="nodes to plan for (x gpus_per_node)")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", min=1, max=2**31,
                                                        help="sequences per optimizer step")] = None,
    top: Annotated[int, typer.Option("--top", min=1, max=100, help="plans to show")] = 5,
    write: Annotated[Optional[str], typer.Option("--write", help="write the best plan as a job file")] = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """Search the plans that fit, fastest first: degrees, sharding, recomputation, micro
    batches, schedule and offload; keys the job gives stay fixed."""
    from ..io.plan_search import run_plan_search
    from ..io.writing import output_target, refuse_overwriting_input
    from ..render.output import emit_diagnostics, emit_json, stdout_console
    from ..render.plan import plan_document, print_plans

    if gpus is not None and nodes is not None:
        raise InputError(Problem("--gpus", "give --gpus or --nodes, not both"))
    # A path that cannot be written fails now, not after the search.
    write = output_target(write, "--write", "the table of plans" if not json_out else "the JSON document")
    try:
        resolved = flags.load(file, warn_only=_searched)
    except InputError as exc:  # the warnings about keys the search sets are not the user's
        raise InputError([p for p in exc.problems if p.severity == "error" or not _searched(p)]) from None
    refuse_overwriting_input(write, resolved.file, "--write", "the best plan")
    emit_diagnostics(p for p in resolved.warnings if not _searched(p))
    outcome = run_plan_search(resolved, gpus=gpus, nodes=nodes, global_batch=global_batch, top=top,
                              progress=not json_out, overrides=flags.overrides())
    if outcome.found and write is not None:  # before the output: a failed write prints one document, the error
        outcome.write_best(write, "--write")
    if json_out:
        emit_json(plan_document(outcome))
    else:
        print_plans(stdout_console(), outcome)
    if not outcome.found:
        emit_diagnostics(outcome.miss_lines())
        raise typer.Exit(EXIT_INFEASIBLE)
    emit_diagnostics(f"plan: {note}" for note in outcome.notes)
    if write is not None:
        emit_diagnostics([f"wrote the best plan to {write}"])


def register(app: typer.Typer) -> None:
    app.command("plan")(plan)
