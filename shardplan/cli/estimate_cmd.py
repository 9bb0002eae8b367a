"""`shardplan estimate [FILE] [--params N] [plan flags]`: per-device and per-node memory."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..core.estimate_inputs import inputs_from_job
from ..core.memory import cpu_limit, estimate_memory
from ..io.job import ResolvedJob
from ..render.output import emit_diagnostics, emit_json, stdout_console
from ..spec.errors import EXIT_INFEASIBLE, InputError, Problem
from .options import JsonFlag, PlanFlags, WorldOption, plan_flags


def limits_known(resolved: ResolvedJob) -> bool:
    """The fit is checked only against a GPU memory the job states (`[cluster] gpu_memory`,
    directly or through a cluster preset)."""
    return "gpu_memory" in resolved.job.cluster.model_fields_set


def step_time_of(resolved: ResolvedJob, inputs):
    """The predicted step (core/step_time.py) when the hardware and the architecture are
    known, else None (no `time` in the output)."""
    from ..io.hardware import hardware_of, lora_of

    hardware = hardware_of(resolved.job.cluster)
    if hardware is None or inputs.shape is None:
        return None
    from ..core.step_time import step_time

    return step_time(inputs, hardware, lora=lora_of(resolved.job.lora))


@plan_flags
def estimate(
    file: Annotated[Optional[str], typer.Argument(help="job file (TOML/JSON) or job preset name")] = None,
    explain: Annotated[bool, typer.Option("--explain", help="print every formula with its numbers")] = False,
    world: WorldOption = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """Per-device GPU memory and per-node CPU memory, with offload; exit 1 when it does not fit.

    Parameters, gradients, optimizer states, activations and buffers per pipeline stage,
    headroom against the cluster, and `--explain` for every formula with its numbers.
    """
    from ..render.estimate import estimate_document, print_estimate

    resolved = flags.load(file, world=world)
    if resolved.shape is None and resolved.params_only is None:
        raise InputError(Problem("model", "no model: set model.preset, model.hf_config, an inline shape, or --params",
                                 file=file))
    emit_diagnostics(resolved.warnings)
    cluster = resolved.job.cluster
    known = limits_known(resolved)
    inputs = inputs_from_job(resolved.job, resolved.shape, known)
    result = estimate_memory(inputs)
    gpu_memory = cluster.gpu_memory if known else None
    cpu_memory = cpu_limit(inputs) if known else None  # the limit `fits` is checked against
    timing = step_time_of(resolved, result.inputs or inputs)
    changes = None
    if result.fits is False:
        from ..io.hardware import hardware_of, lora_of
        from ..io.to_fit import changes_to_fit

        changes = changes_to_fit(inputs, hardware_of(cluster), lora_of(resolved.job.lora))
    if json_out:
        document = estimate_document(result, gpu_memory, explain, cpu_memory)
        if timing is not None:
            from ..render.time import time_document

            document["time"] = time_document(timing, explain)
        if changes is not None:
            document["to_fit"] = [{"lever": c.lever, "set": c.settings, "peak_gpu_bytes": c.peak_gpu_bytes,
                                   "cpu_bytes_per_node": c.cpu_bytes_per_node, "step_seconds": c.step_seconds}
                                  for c in changes]
        emit_json(document)
    else:
        title = f"{resolved.model_name or 'model'}: memory per device"
        console = stdout_console()
        written = "cpu_memory_budget" in resolved.job.offload.model_fields_set
        print_estimate(console, result, gpu_memory, cpu_memory, title, explain, timing, written)
        if changes is not None:
            from ..render.estimate import print_changes

            print_changes(console, changes, gpu_memory)
    emit_diagnostics(f"warning: {w}" for w in result.warnings)
    if resolved.shape is None and timing is None:
        from ..io.hardware import hardware_of

        if hardware_of(cluster) is not None:  # the GPU is known: say why there is no time
            emit_diagnostics(["warning: no architecture: no step time (the time model counts each layer's matmuls "
                              "and collectives)"])
    if resolved.shape is not None:
        from ..runtime.capabilities import offload_refusals

        decided = result.inputs or inputs
        emit_diagnostics(f"warning: {path}: `shardplan run` would refuse this offload: {message}" for path, message
                         in offload_refusals(resolved.job, decided.offload_optimizer, decided.offload_params))
    if result.fits is False:
        raise typer.Exit(EXIT_INFEASIBLE)


def register(app: typer.Typer) -> None:
    app.command("estimate")(estimate)
