"""The body of one torchrun worker: start, check, resume, train, checkpoint, measure, report."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.estimate import rank_coordinates, rank_estimate
from ..core.memory import estimate_memory
from ..core.estimate_inputs import inputs_from_job
from ..core.params import count_params
from ..io.job import ResolvedJob
from ..io.progress import PROGRESS_ENV, ProgressFile
from ..render.output import emit_diagnostics, emit_line, stdout_console
from ..render.run import progress_bar, run_table
from ..spec.errors import InputError, Problem, RunFailure, ShardplanError
from . import checkpoint, faults, preflight, resume
from .capabilities import decided_offload_unsupported
from .dist import Runtime, start, stop
from .measure import PROFILE_ENV, CudaMemory, ProcessMemory, SavedTensorTracker, profiler, write_profile
from .lora import preload_libraries
from .train import Trainer, global_loss, mfu, rank_estimates

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


@dataclass(frozen=True)
class RunOptions:
    report_path: str | None = None
    verbose: bool = False
    table: bool = True
    resume: str | None = None  # "latest" or a checkpoint path
    force: bool = False


class Phase:
    """What this rank is doing, so a failure can say where it happened: set as each phase
    begins (`describe_failure` names it)."""

    current = "starting"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def plan_record(resolved: ResolvedJob, runtime: Runtime) -> dict:
    """What a checkpoint records about the plan that wrote it."""
    job, degrees = resolved.job, resolved.degrees
    return {
        "model": resolved.shape.to_table(),
        "params": count_params(resolved.shape).total,
        "degrees": {"dp": degrees.dp, "tp": degrees.tp, "pp": degrees.pp, "cp": degrees.cp},
        "zero_stage": job.zero.stage,
        "order": job.parallel.order,
        "world_size": runtime.world,
        "job": job.model_dump(mode="json", exclude_none=True),
    }


def dp_split(job) -> str | None:
    """The 2-D data-parallel mesh FSDP2 needs: hybrid sharding, or stage 0's replication."""
    if job.zero.hybrid:
        return "hybrid"
    return "replicate" if job.zero.stage == 0 else None


def run_worker(resolved: ResolvedJob, limits_known: bool, options: RunOptions) -> dict | None:
    """Train the job on this rank; rank 0 returns (and prints) the report."""
    job = resolved.job
    if os.environ.get("RANK", "0") != "0" and not options.verbose:
        warnings.simplefilter("ignore")
    Phase.current = "joining the process group"
    runtime = start(resolved.degrees, job.parallel.order, job.cluster.gpus_per_node,
                    job.parallel.communication_timeout, dp_split=dp_split(job))
    try:
        report = _train(resolved, runtime, limits_known, options)
    except BaseException:
        stop(together=False)  # the others may be gone: no barrier
        raise
    stop()
    return report


def _restart() -> int:
    """Which restart of torchrun's (--max-restarts) this attempt is; 0 for the first attempt."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _resume_point(resolved: ResolvedJob, options: RunOptions, plan: dict, rank0: bool):
    """(checkpoint path, meta, resharding note) to resume from, or None to start afresh.

    `--resume` asks for it; a worker restarted by torchrun (--max-restarts) resumes from the
    latest complete checkpoint by itself, and rank 0 says so in one line (the launcher that
    started torchrun says it on the user's terminal instead: cli/run_cmd.py)."""
    folder = resolved.job.checkpoint.dir
    restart = _restart()
    if restart and rank0:
        emit_diagnostics([resume.restart_line(restart, int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", restart)),
                                              folder, options.resume)])
    requested = resume.resume_request(folder, options.resume, restarted=restart > 0)
    if requested is None:
        return None
    if requested == "latest" and not folder:
        raise RunFailure("--resume: the job has no [checkpoint] dir to resume from")
    path = checkpoint.find(Path(folder or "."), requested)
    meta = checkpoint.read_meta(path)
    return path, meta, checkpoint.check_compatible(meta, plan, path)


def _train(resolved: ResolvedJob, runtime: Runtime, limits_known: bool, options: RunOptions) -> dict | None:
    job = resolved.job
    rank0 = runtime.rank == 0
    # The offload strategy's decision (what is offloaded, how many layers stay resident) is
    # the plan this rank builds, checks before starting and reports beside its measurements.
    Phase.current = "preflight"
    decided = estimate_memory(replace(inputs_from_job(job, resolved.shape, limits_known), on_gpu=runtime.on_gpu))
    inputs = decided.inputs
    # The launcher checked the decision the estimate makes (runtime/capabilities.py); this
    # rank's own, on its device, is checked again.
    refused = decided_offload_unsupported(job, inputs.offload_optimizer, inputs.offload_params)
    if refused:
        raise InputError([Problem(path, message) for path, message in refused])
    mine = rank_estimate(inputs, rank_coordinates(inputs, runtime.rank), [runtime.rank])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    preflight.check(mine, runtime.on_gpu, runtime.device.index, local_world, options.force)
    plan = plan_record(resolved, runtime)
    Phase.current = "reading the checkpoint"
    resume_at = _resume_point(resolved, options, plan, rank0)
    if resume_at is not None and resume_at[1]["step"] >= job.train.steps:
        return _already_complete(resume_at[0], resume_at[1]["step"], job.train.steps, rank0, options)
    Phase.current = "loading the fine-tuning libraries"
    preload_libraries(job)  # their import is not the model's memory
    process = ProcessMemory()
    cuda = CudaMemory(runtime.device) if runtime.on_gpu else None
    if cuda is not None:
        torch.cuda.reset_peak_memory_stats(runtime.device)
    else:
        process.start()  # on CPU, host and device memory are one: the process's growth
    Phase.current = "building the model"
    trainer = Trainer(resolved, runtime, inputs, mine.resident_layers)
    first_step, resumed = 0, None
    if resume_at is not None:
        path, meta, resharded = resume_at
        Phase.current = f"loading {path}"
        saved_lr = checkpoint.load(path, [m for _, m in trainer.modules], trainer.optimizer,
                                   same_layout=resharded is None, lr=job.train.lr)
        first_step = meta["step"]
        resumed = {"step": first_step, "path": str(path), "resharded": resharded,
                   "lr": job.train.lr, "checkpoint_lr": saved_lr}
        if rank0 and not _restart():  # a restart said where it resumes already
            emit_diagnostics([f"resuming from {path} after step {first_step}" + (f", {resharded}" if resharded else "")])
    if rank0 and decided.decisions and options.verbose:
        emit_diagnostics(f"offload: {d}" for d in decided.decisions)
    report = _loop(resolved, runtime, trainer, first_step, plan, options, cuda)
    report["resumed_from"] = resumed
    report["offload_decisions"] = decided.decisions
    report["ranks"] = _gather(runtime, trainer, report.pop("_tracker"), report.pop("_states"), mine, process, cuda)
    if not rank0:
        return None
    if options.table:
        stdout_console().print(run_table(report, resolved.model_name))
    if options.report_path:
        Phase.current = f"writing the report {options.report_path}"
        Path(options.report_path).write_text(json.dumps({"schema_version": 1, **report}, indent=2) + "\n",
                                             encoding="utf-8")
    return report


def _already_complete(path: Path, step: int, steps: int, rank0: bool, options: RunOptions) -> dict | None:
    """Resuming a run whose checkpoint has every step: nothing to train, nothing measured.
    Rank 0 says so on stdout (the launcher's terminal; stderr goes to a log) and returns
    the `--json` document."""
    if not rank0:
        return None
    where = f"{step} of {steps}" if step == steps else f"{step}, past train.steps ({steps})"
    if options.table:
        emit_line(f"run complete: {path} is at step {where}; nothing to train "
                  f"(raise train.steps to train further, e.g. --set train.steps={step + steps})")
    return {"complete": True, "checkpoint": str(path), "step": step, "steps": []}


def _loop(resolved, runtime, trainer, first_step, plan, options, cuda) -> dict:
    job = resolved.job
    rank0 = runtime.rank == 0
    tracker = SavedTensorTracker(trainer.params)
    steps, states = [], None
    # Saved activations are measured in the run's second step when there is one: the first
    # step of a pipeline also runs torch's shape inference, whose graph stays alive meanwhile.
    measured = first_step + (1 if job.train.steps - first_step > 1 else 0)
    tokens_per_step = trainer.batching.global_batch * job.train.seq_len
    profiled = measured + 1 if rank0 and os.environ.get(PROFILE_ENV) and measured + 1 < job.train.steps else -1
    folder = Path(job.checkpoint.dir) if job.checkpoint.dir else None
    bar = _progress(rank0, options.table, job.train.steps, first_step)
    with bar if bar else contextlib.nullcontext():
        for step in range(first_step, job.train.steps):
            faults.maybe("step", step + 1, runtime.rank)
            _sync(runtime.device)
            start_time = time.perf_counter()
            Phase.current = f"step {step + 1} (forward, backward, optimizer)"
            # The measured step also reads the allocator's peak of each phase (CUDA, no pipeline).
            phases = cuda if step == measured and trainer.pp == 1 else None
            profiling = profiler(runtime.device) if step == profiled else contextlib.nullcontext()
            with profiling as prof:
                local = trainer.step(step, tracker if step == measured else None, phases)
            Phase.current = f"step {step + 1} (loss all-reduce)"
            loss = global_loss(local, trainer)
            _sync(runtime.device)
            seconds = time.perf_counter() - start_time
            if states is None:
                states = trainer.measure_states()
            steps.append({"step": step + 1, "loss": loss, "seconds": seconds})
            if step == profiled:
                write_profile(prof, os.environ[PROFILE_ENV])
            if bar:
                bar.advance(step + 1, loss, tokens_per_step / seconds)
            done = step + 1
            if folder and (done % job.checkpoint.every == 0 or done == job.train.steps):
                Phase.current = f"checkpoint of step {done}"
                checkpoint.save(folder, done, [m for _, m in trainer.modules], trainer.optimizer, plan,
                                job.checkpoint.keep)
    # The first step pays for warm-up (allocations, kernel selection); the measured step for
    # its hooks and synchronisations, a profiled one for its profiler. The others are timed
    # where there are any.
    timed_steps = [s for s in steps[1:] if s["step"] not in (measured + 1, profiled + 1)] or steps[1:] or steps
    step_time = sum(s["seconds"] for s in timed_steps) / max(1, len(timed_steps))
    tokens_per_second = tokens_per_step / step_time if step_time else 0.0
    return {
        "world_size": runtime.world,
        "device": runtime.device.type,
        "torch_version": torch.__version__,
        "cpu_threads": torch.get_num_threads(),  # the launcher's OMP_NUM_THREADS (cli/run_cmd.py)
        "pipeline_schedule": trainer.schedule_name,
        "steps": steps,
        "step_seconds": step_time,
        "tokens_per_second": tokens_per_second,
        "mfu": mfu(tokens_per_second, resolved, runtime),
        "_tracker": tracker,
        "_states": states or trainer.measure_states(),
    }


def _progress(rank0: bool, table: bool, total: int, completed: int):
    """Rank 0's progress: to the launcher that started torchrun (it draws the bar on its
    terminal), else a bar on this worker's terminal; quiet off a terminal and with --json."""
    if not rank0:
        return None
    path = os.environ.get(PROGRESS_ENV)
    if path:
        return ProgressFile(path, total, completed)
    if table and sys.stderr.isatty():
        return progress_bar(total, completed)
    return None


def _gather(runtime, trainer, tracker, states, mine, process, cuda) -> list[dict]:
    Phase.current = "gathering the measurements"
    measured = {kind: sum(states[kind].values()) for kind in ("params", "grads", "optimizer")}
    measured["placement"] = states
    measured["activations"] = tracker.peak
    if cuda is not None:
        # peak_device, reserved_device, device_used, context, device_capacity, phases
        measured.update(cuda.figures())
    else:
        measured["peak_device"] = process.growth()
    measured["resident_layers"] = trainer.resident_blocks()
    entry = {
        "rank": runtime.rank,
        "coords": runtime.coords(),
        "measured": measured,
        "weight_copies": tracker.copies_peak,
        # On a GPU: seconds the offload engine's copies were not hidden behind compute
        # (host waits for gradient copies, compute-stream waits for parameter copies).
        "exposed_copy_seconds": trainer.engine.exposed_copy_seconds() if trainer.engine is not None else None,
        "estimated": rank_estimates(mine, runtime.on_gpu),
    }
    entries = [None] * runtime.world
    dist.all_gather_object(entries, entry)
    return entries


def describe_failure(rank: int, exc: BaseException, timeout: float) -> str:
    """One line for the user: which rank, doing what, what failed."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, ShardplanError):
        return f"rank {rank}: {text}"
    lowered = str(exc).lower()
    if "timed out" in lowered or "timeout" in lowered:
        return (f"rank {rank}: a collective did not complete within communication_timeout "
                f"({timeout:g} s) during {Phase.current}: {text}")
    return f"rank {rank}: {type(exc).__name__} during {Phase.current}: {text}"


def fail(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
