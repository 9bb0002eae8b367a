"""`shardplan validate FILE... [--world N]`: every problem of every file, one line each."""

from __future__ import annotations

from typing import Annotated, List

import typer

from ..core.estimate_inputs import lora_plan
from ..core.lora import lora_counts
from ..core.params import count_params
from ..io.job import ResolvedJob
from ..render.output import emit_diagnostics, emit_json, emit_line, error_document
from ..render.summary import job_summary_line
from ..runtime.capabilities import refusal_warnings
from ..spec.errors import EXIT_BAD_INPUT, InputError
from .options import JsonFlag, PlanFlags, WorldOption, plan_flags


def _summary(resolved: ResolvedJob) -> dict:
    job = resolved.job
    degrees = resolved.degrees
    params = count_params(resolved.shape).total if resolved.shape else resolved.params_only
    summary = {
        "model": resolved.model_name or None,
        "params": params,
        "world_size": degrees.world,
        "degrees": {"dp": degrees.dp, "tp": degrees.tp, "pp": degrees.pp, "cp": degrees.cp},
        "nodes": -(-degrees.world // job.cluster.gpus_per_node),
        "gpus_per_node": job.cluster.gpus_per_node,
    }
    lora = lora_plan(job) if resolved.shape else None
    if lora is not None:  # `params` is the base model's; estimate's parameters add the adapters
        summary["lora_params"] = lora_counts(resolved.shape, lora).trainable
    return summary


@plan_flags
def validate(
    files: Annotated[List[str], typer.Argument(help="job, model or cluster files (TOML or JSON), or job preset names")],
    world: WorldOption = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """Check job files and list every problem: file, line, dotted key, what is wrong."""
    reports, errors = [], []
    for file in files:
        try:
            resolved = flags.load(file, world=world, check_paths=True)
        except InputError as exc:
            errors += exc.problems
            emit_diagnostics(exc.lines())
            reports.append({"file": file, "valid": False, "problems": [p.to_json() for p in exc.problems]})
            continue
        warnings = resolved.warnings + refusal_warnings(resolved)
        emit_diagnostics(warnings)
        summary = _summary(resolved)
        reports.append({
            "file": file, "valid": True, "problems": [p.to_json() for p in warnings], **summary,
        })
        if not json_out:
            emit_line(job_summary_line(file, summary))
    if json_out:  # invalid: the report, and the CONTRACT's error document in the same object
        error = error_document(errors, EXIT_BAD_INPUT) if errors else {}
        emit_json({"valid": not errors, "files": reports, **error})
    if errors:
        raise typer.Exit(EXIT_BAD_INPUT)


def register(app: typer.Typer) -> None:
    app.command("validate")(validate)
