"""`shardplan export FILE --to deepspeed|torchtitan|accelerate|megatron [-o F]`: the same
plan in another framework's config format; what it cannot express goes to stderr."""

from __future__ import annotations

import importlib
import sys
from typing import Annotated, Optional

import typer

from ..core.degrees import Degrees
from ..core.estimate_inputs import inputs_from_job
from ..core.layout import Layout, shard_group_size
from ..core.memory import estimate_memory
from ..io.interop import TARGETS
from ..io.interop.common import Plan
from ..io.interop.offload import decided_offload
from ..io.job import ResolvedJob
from ..io.problems import did_you_mean
from ..io.writing import output_target, refuse_overwriting_input, write_text
from ..render.output import emit_diagnostics, emit_json
from ..spec.errors import EXIT_INFEASIBLE, InputError, PlanError, Problem
from .estimate_cmd import limits_known
from .options import JsonFlag, PlanFlags, plan_flags


def plan_of(resolved: ResolvedJob) -> Plan:
    """The exporters' view of a validated job (core decides the shard group and nodes, and the
    estimate what its offload strategy adds: the plan fits only as `estimate` decided it)."""
    job = resolved.job
    par, cluster = job.parallel, job.cluster
    degrees = Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    try:
        layout = Layout(degrees, par.order, cluster.gpus_per_node)
        group = shard_group_size(layout, job.zero.hybrid and job.zero.stage >= 2)
    except PlanError as exc:
        raise InputError(Problem("zero.hybrid", str(exc), file=resolved.file or None)) from None
    nodes = cluster.nodes or -(-degrees.world // cluster.gpus_per_node)
    estimate = None
    if resolved.shape is not None or resolved.params_only is not None:
        estimate = estimate_memory(inputs_from_job(job, resolved.shape, limits_known(resolved)))
    return Plan(job, resolved.shape, group, nodes, decided_offload(job, estimate))


@plan_flags
def export(
    file: Annotated[Optional[str], typer.Argument(help="job file (TOML/JSON) or job preset name")] = None,
    to: Annotated[str, typer.Option("--to", help=f"target format (required): {', '.join(TARGETS)}")] = "",
    output: Annotated[Optional[str], typer.Option("-o", "--output", help="write the config here (default, or -: stdout)")] = None,
    strict: Annotated[bool, typer.Option("--strict", help="exit 1 when a note says a run of the written config fails "
                                                          "(the target refuses it, or it runs out of memory)")] = False,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """The same plan as a DeepSpeed, torchtitan, accelerate or Megatron-LM config.

    DeepSpeed: config JSON; torchtitan: job config TOML; accelerate: config YAML (FSDP2);
    Megatron-LM: command-line arguments. Every key the target cannot express is named on
    stderr, one line each.
    """
    target = to.strip().lower()
    if not target:
        raise InputError(Problem("--to", f"required: the target format, one of {', '.join(TARGETS)}"))
    if target not in TARGETS:
        raise InputError(Problem("--to", f"must be one of {', '.join(TARGETS)} (got {to!r}){did_you_mean(target, TARGETS)}"))
    output = output_target(output, "--output")
    resolved = flags.load(file)
    refuse_overwriting_input(output, resolved.file, "--output", f"the {target} config")
    emit_diagnostics(resolved.warnings)
    module = importlib.import_module(f"..io.interop.{target}", __package__)
    exported = getattr(module, f"to_{target}")(plan_of(resolved))
    text = module.dumps(exported.config)
    if output:
        write_text(output, text, "--output")
    if json_out:
        config = {"args": exported.config} if isinstance(exported.config, list) else exported.config
        emit_json({"target": target, "file": output, "config": config,
                   "notes": [{"path": n.path, "message": n.message, "fails": n.fails} for n in exported.notes]})
    elif not output:
        sys.stdout.write(text)
    emit_diagnostics(f"export: {n.path}: {n.message}" for n in exported.notes)
    if strict and any(n.fails for n in exported.notes):
        raise typer.Exit(EXIT_INFEASIBLE)


def register(app: typer.Typer) -> None:
    app.command("export")(export)
