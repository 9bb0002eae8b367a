"""The body of one torchrun worker: start, train, measure, gather, report."""

from __future__ import annotations

import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from ..core.estimate_inputs import inputs_from_job
from ..io.job import ResolvedJob
from ..render.output import emit_diagnostics, stdout_console
from ..render.run import progress_bar, run_table
from ..spec.errors import RunFailure
from .dist import start, stop
from .measure import SavedTensorTracker
from .train import Trainer, global_loss, mfu, rank_estimates

warnings.filterwarnings("ignore", message="Failed to initialize NumPy")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_worker(resolved: ResolvedJob, limits_known: bool,
               report_path: str | None, verbose: bool, table: bool = True) -> dict | None:
    """Train the job on this rank; rank 0 returns (and prints) the report."""
    job = resolved.job
    runtime = start(resolved.degrees, job.parallel.order, job.cluster.gpus_per_node,
                    job.parallel.communication_timeout)
    try:
        return _train(resolved, runtime, limits_known, report_path, verbose, table)
    finally:
        stop()


def _train(resolved, runtime, limits_known, report_path, verbose, table) -> dict | None:
    job = resolved.job
    inputs = replace(inputs_from_job(job, resolved.shape, limits_known), on_gpu=runtime.on_gpu)
    if runtime.on_gpu:
        torch.cuda.reset_peak_memory_stats(runtime.device)
    trainer = Trainer(resolved, runtime, inputs)
    rank0 = runtime.rank == 0
    if rank0 and trainer.decisions and verbose:
        emit_diagnostics(f"offload: {d}" for d in trainer.decisions)
    tracker = SavedTensorTracker(trainer.params)
    steps, states = [], None
    # Saved activations are measured in the second step when there is one: the first step
    # of a pipeline also runs torch's shape inference, whose graph stays alive meanwhile.
    measured_step = 1 if job.train.steps > 1 else 0
    tokens_per_step = trainer.batching.global_batch * job.train.seq_len
    bar = progress_bar(job.train.steps) if rank0 else None
    with bar if bar else _Null():
        for step in range(job.train.steps):
            _sync(runtime.device)
            start_time = time.perf_counter()
            local = trainer.step(step, tracker if step == measured_step else None)
            loss = global_loss(local, trainer)
            _sync(runtime.device)
            seconds = time.perf_counter() - start_time
            if step == 0:
                states = trainer.measure_states()
            steps.append({"step": step + 1, "loss": loss, "seconds": seconds})
            if bar:
                bar.advance(step + 1, loss, tokens_per_step / seconds)
    timed_steps = steps[1:] or steps
    step_time = sum(s["seconds"] for s in timed_steps) / len(timed_steps)
    tokens_per_second = tokens_per_step / step_time
    measured = {
        kind: sum(states[kind].values()) for kind in ("params", "grads", "optimizer")
    }
    measured["activations"] = tracker.peak
    measured["peak_device"] = torch.cuda.max_memory_allocated(runtime.device) if runtime.on_gpu else None
    entry = {
        "rank": runtime.rank,
        "coords": runtime.coords(),
        "measured": measured,
        "measured_by_device": states,
        "weight_copies": tracker.copies_peak,
        "estimated": rank_estimates(inputs, runtime),
    }
    entries = [None] * runtime.world
    dist.all_gather_object(entries, entry)
    if not rank0:
        return None
    report = {
        "world_size": runtime.world,
        "device": runtime.device.type,
        "torch_version": torch.__version__,
        "pipeline_schedule": trainer.schedule_name,
        "steps": steps,
        "step_seconds": step_time,
        "tokens_per_second": tokens_per_second,
        "mfu": mfu(tokens_per_second, resolved, runtime),
        "offload_decisions": trainer.decisions,
        "ranks": entries,
    }
    if table:
        stdout_console().print(run_table(report, resolved.model_name))
    if report_path:
        Path(report_path).write_text(json.dumps({"schema_version": 1, **report}, indent=2) + "\n", encoding="utf-8")
    return report


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def fail(rank: int, exc: BaseException) -> None:
    """One line for the user: which rank, what failed."""
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    sys.stderr.write(f"rank {rank}: {type(exc).__name__ if not isinstance(exc, RunFailure) else 'error'}: {message}\n")
