"""`shardplan run FILE`: execute the plan with torch, under torchrun or by starting it."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Annotated, Optional

import typer

from ..io.progress import PROGRESS_ENV
from ..spec.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, InputError, Problem, ShardplanError
from ..spec.units import counted
from .estimate_cmd import limits_known
from .options import JsonFlag, PlanFlags, plan_flags

# A worker's failure line (runtime/worker.py `describe_failure`).
_FAILURE = re.compile(r"^rank (\d+): (.*)$")
# The log folder torchrun makes for each attempt; attempt_<n> for n >= 1 is the n-th restart.
_ATTEMPT = re.compile(r"^attempt_(\d+)$")
# How often the launcher looks for rank 0's next step: a bar that moves at once, for a
# file read that costs microseconds.
PROGRESS_POLL_SECONDS = 0.1


def under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


# PyTorch's own index of CPU-only wheels (pytorch.org, "Get started": "Compute Platform: CPU");
# PyPI's Linux wheels are the CUDA build, several GB of NVIDIA libraries.
CPU_WHEELS = "https://download.pytorch.org/whl/cpu"


def source_checkout() -> Path | None:
    """The clone this shardplan runs from (an editable install), or None for an installed
    wheel: pip takes the `run` extra from the checkout's folder there, not by name."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "pyproject.toml").is_file() else None


def extra_command(extra: str) -> str:
    """The command that installs one of shardplan's extras for this installation."""
    checkout = source_checkout()
    return f"pip install -e '{checkout}[{extra}]'" if checkout else f"pip install 'shardplan[{extra}]'"


def install_hint() -> str:
    """The command that installs the `run` extra for this installation."""
    return f"{extra_command('run')} (on a machine without a GPU, first: pip install torch --index-url {CPU_WHEELS})"


def _require_torch(job) -> None:
    # find_spec, not import: the parent that starts torchrun never needs torch itself (1 s).
    # numpy too: torch.distributed's object collectives (checkpoint planning, gathering the
    # measurements) call Tensor.numpy() and fail mid-run without it.
    missing = [name for name in ("torch", "numpy") if importlib.util.find_spec(name) is None]
    if missing:
        raise InputError(Problem("", f"`shardplan run` needs {' and '.join(missing)}: {install_hint()}"))
    # Fine-tuning's libraries (the `finetune` extra): peft for LoRA, torchao for NF4 and 8-bit AdamW.
    needed = []
    if job.lora is not None:
        needed.append(("peft", "lora"))
        if job.lora.base_dtype == "nf4":
            needed.append(("torchao", "lora.base_dtype"))
    if job.train.optimizer == "adamw8bit":
        needed.append(("torchao", "train.optimizer"))
    lacking = [(name, key) for name, key in needed if importlib.util.find_spec(name) is None]
    if lacking:
        raise InputError([Problem(key, f"`shardplan run` needs {name} for this: {extra_command('finetune')}")
                          for name, key in lacking])


def _check_report_path(report: str | None) -> None:
    """`--report` is written by rank 0 after the last step: a path it cannot write would
    lose the whole run, so it is checked before anything starts (io/writing.py). `-` is
    refused: stdout holds the run's own output."""
    if report is not None:
        from ..io.writing import output_target

        output_target(report, "--report", "the run's output")


def _check_resume_path(resume: str | None, folder: str) -> None:
    """`--resume` needs a complete checkpoint in `[checkpoint] dir`, `--resume=PATH` one at
    PATH: the workers' own test (runtime/resume.py `find`), run here before torchrun starts
    them. Refused as docs/recovery.md says: one `checkpoint: ...` line, exit 3."""
    if resume is None:
        return
    from ..runtime.resume import find  # torch-free

    find(Path(folder), resume)  # raises RunFailure


def _check_checkpoint_dir(resolved) -> None:
    """`[checkpoint] dir` must be a folder, or one that can be made: a file there (or above it)
    would fail the first save, `checkpoint.every` steps into the run. Bad input, exit 2."""
    if not resolved.job.checkpoint.dir:
        return
    from ..io.writing import folder_problem

    problem = folder_problem(resolved.job.checkpoint.dir)
    if problem:
        raise InputError(resolved.locate([Problem("checkpoint.dir", problem)]))


def _check_data_file(resolved) -> None:
    """`[data] path` must hold whole token ids of the vocabulary, at least a sequence of them:
    the ranks' own test (runtime/token_file.py), run here so that a bad file is bad input
    (exit 2) before torchrun starts rather than a failure of every rank."""
    job = resolved.job
    if not job.data.path or resolved.shape is None:
        return
    from ..runtime.token_file import check

    problem = check(resolved.data_file or job.data.path, repr(job.data.path), job.data.dtype,
                    resolved.shape.vocab_size, job.train.seq_len)
    if problem:
        raise InputError(resolved.locate([Problem("data.path", problem)]))


def _worker_args(file: str, flags: PlanFlags, options: dict) -> list[str]:
    """The command line each torchrun worker runs: the same job, flags and outputs."""
    args = [file]
    for name, value in flags.shortcuts.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    for expression in flags.sets:
        args += ["--set", expression]
    for name, value in options.items():
        if value is True:
            args.append(f"--{name}")
        elif value not in (None, False):
            args.append(f"--{name}={value}")
    return args


class WorkersFailed(ShardplanError):
    """The workers' failure, summarised by the launcher: one line per rank."""

    def __init__(self, lines: list[str], exit_code: int):
        super().__init__("; ".join(lines))
        self.summary = lines
        self.exit_code = exit_code

    def lines(self) -> list[str]:
        return self.summary


def _drain(stream, into: list[str], echo: bool = False) -> threading.Thread:
    """Read a child's stream to its end on a thread (a full pipe would block the child);
    with `echo`, each line also goes to this process's stderr, looked up per line so that a
    live progress bar (which redirects it) prints it above the bar."""

    def read() -> None:
        for line in stream:
            into.append(line)
            if echo:
                sys.stderr.write(line)

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


class Restarts:
    """torchrun's restarts of the workers (`--max-restarts`), seen as torchrun makes each
    attempt's log folder (torch/distributed/elastic/multiprocessing/api.py `DefaultLogsSpecs`:
    `<log-dir>/<run id>/attempt_<restart>/<local rank>/stderr.log`). Each is announced in one
    line on stderr: what failed and where the restarted workers resume (runtime/resume.py,
    the rule the workers follow). The workers' stderr goes to those logs, so without this a
    restart would pass unseen."""

    def __init__(self, logs: Path, max_restarts: int, captured: list[str], folder: str, resume: str | None):
        self.logs, self.max_restarts, self.captured = logs, max_restarts, captured
        self.folder, self.resume = folder, resume
        self.announced = 0
        self.start = 0  # the first of torchrun's stderr lines of the current attempt

    def _attempts(self) -> dict[int, Path]:
        found = {}
        for path in self.logs.glob("*/attempt_*"):
            match = _ATTEMPT.match(path.name)
            if match:
                found[int(match.group(1))] = path
        return found

    def poll(self) -> None:
        """Announce the restarts that happened since the last call."""
        from ..runtime.resume import restart_line

        attempts = self._attempts()
        for restart in sorted(n for n in attempts if n > self.announced):
            end = len(self.captured)  # the drain thread appends meanwhile
            failed = attempts.get(restart - 1)
            cause = _signal_lines("".join(self.captured[self.start:end])) + (_failure_lines(failed) if failed else [])
            self.start, self.announced = end, restart
            sys.stderr.write(restart_line(restart, self.max_restarts, self.folder, self.resume, "; ".join(cause)) + "\n")
            sys.stderr.flush()

    def last_attempt(self, logs: Path) -> tuple[Path, str]:
        """The log folder and torchrun's stderr of the last attempt: a final failure is its."""
        text = "".join(self.captured[self.start:])
        return self._attempts().get(self.announced, logs), text


def _watch(proc: subprocess.Popen, progress_path: Path | None, restarts: Restarts | None) -> None:
    """Until torchrun exits: draw rank 0's progress on this terminal (with `progress_path`),
    and announce torchrun's restarts (above the bar when there is one)."""
    if progress_path is None and restarts is None:
        return
    from ..io.progress import ProgressReader
    from ..render.run import progress_bar

    reader = ProgressReader(progress_path) if progress_path else None
    with progress_bar(None) if reader else contextlib.nullcontext() as bar:
        while proc.poll() is None:
            if reader:
                bar.show(reader.poll())
            if restarts:
                restarts.poll()
            time.sleep(PROGRESS_POLL_SECONDS)
        if reader:
            bar.show(reader.poll())


def threads_per_worker(nproc: int) -> int:
    """CPU threads each worker's torch may use: the cores this process may run on, shared
    evenly among the node's workers (at least one). torchrun's own default is one thread per
    worker (OMP_NUM_THREADS=1 whenever nproc_per_node > 1), which leaves an offload plan's host
    optimizer and its state encoding on one core; the time model counts that optimizer bound
    by the node's memory bandwidth (docs/time.md), which takes several cores. DeepSpeed's
    launcher shares the cores the same way (`--bind_cores_to_rank`: OMP_NUM_THREADS = cores
    per rank). A user's own OMP_NUM_THREADS is kept."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        cores = os.cpu_count() or 1
    return max(1, cores // nproc)


def _spawn(nproc: int, max_restarts: int, argv: list[str], verbose: bool, live: bool,
           checkpoint_dir: str = "", resume: str | None = None) -> None:
    """torchrun on this node; a failure raises `WorkersFailed` with the workers' exit code
    (torchrun's own is 1 for any failure). Workers' stderr goes to files and their failure
    lines come back as one summary instead of every rank's traceback and torchrun's report;
    `--verbose` shows everything. With `live` (a terminal, no --json) this process draws rank
    0's progress and prints the workers' output once the bar is done. Each restart (with
    `max_restarts`) is announced in one line (`Restarts`; under --verbose rank 0 says it);
    the workers resume from `checkpoint_dir` or `resume` as runtime/resume.py decides."""
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(nproc)))
    with tempfile.TemporaryDirectory(prefix="shardplan-logs-") as logs:
        progress_path = Path(logs) / "progress.jsonl"
        env.pop(PROGRESS_ENV, None)
        if live:
            env[PROGRESS_ENV] = str(progress_path)
        command += ["--standalone", f"--nproc_per_node={nproc}", f"--max-restarts={max_restarts}"]
        if not verbose:
            command += ["--redirects=2", f"--log-dir={logs}"]
        command += ["-m", "shardplan", "run", *argv]
        proc = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, stdout=subprocess.PIPE if live else None,
                                text=True)
        captured, output = [], []
        readers = [_drain(proc.stderr, captured, echo=verbose)]
        if live:
            readers.append(_drain(proc.stdout, output))
        restarts = Restarts(Path(logs), max_restarts, captured, checkpoint_dir, resume) \
            if max_restarts and not verbose else None
        with _terminated_as_interrupt():
            try:
                _watch(proc, progress_path if live else None, restarts)
                proc.wait()
            except KeyboardInterrupt as interrupt:
                raise WorkersFailed(_stopped(proc, checkpoint_dir, interrupt), _signal_exit(interrupt)) from None
        for reader in readers:
            reader.join()
        if restarts:
            restarts.poll()  # one torchrun made after the last look
        sys.stdout.write("".join(output))
        if proc.returncode == 0:
            return
        attempt_logs, text = restarts.last_attempt(Path(logs)) if restarts else (Path(logs), "".join(captured))
        lines = _signal_lines(text) + _failure_lines(attempt_logs) or _tail(text)
        raise WorkersFailed(lines, _worker_exit_code(text))


class _Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's stop, `kill`) taken as an interrupt of the launcher."""


@contextlib.contextmanager
def _terminated_as_interrupt():
    """While torchrun runs, SIGTERM raises `_Terminated` in this process as SIGINT raises
    KeyboardInterrupt, so that both stop torchrun and say where the run can resume."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


# How long torchrun gets to stop its workers after the signal is passed on (torch 2.13's
# torchrun forwards SIGINT and SIGTERM to them, `--signals-to-handle`, and kills them after
# `--shutdown-timeout`, 30 s by default).
STOP_SECONDS = 45


def _signal_of(interrupt: KeyboardInterrupt) -> signal.Signals:
    return signal.SIGTERM if isinstance(interrupt, _Terminated) else signal.SIGINT


def _signal_exit(interrupt: KeyboardInterrupt) -> int:
    """The shell's exit status of a process a signal stopped: 128 + the signal's number."""
    return 128 + _signal_of(interrupt)


def _stopped(proc: subprocess.Popen, checkpoint_dir: str, interrupt: KeyboardInterrupt) -> list[str]:
    """Stop torchrun (a terminal's Ctrl-C reaches it too; a signal sent to this process alone
    does not) and say what a resume continues from."""
    name = _signal_of(interrupt).name
    if proc.poll() is None:
        proc.send_signal(_signal_of(interrupt))
        try:
            proc.wait(timeout=STOP_SECONDS)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    from ..runtime.resume import complete_checkpoints  # torch-free

    found = complete_checkpoints(Path(checkpoint_dir)) if checkpoint_dir else []
    if found:
        step, path = found[-1]
        return [f"run: stopped by {name}; the latest complete checkpoint is {path} (step {step}): "
                "the same command with --resume continues from it"]
    where = "no checkpoint was written" if checkpoint_dir else "the job writes no checkpoints ([checkpoint] dir)"
    return [f"run: stopped by {name}; {where}, so a new run starts from step 0"]


def _worker_exit_code(torchrun_stderr: str) -> int:
    """The most telling worker exit code torchrun reported: bad input (2), then infeasible
    (1), else a runtime failure (3)."""
    codes = {int(code) for code in re.findall(r"exitcode: (-?\d+)", torchrun_stderr)}
    for code in (EXIT_BAD_INPUT, 1):
        if code in codes:
            return code
    return EXIT_RUNTIME


def _signal_lines(torchrun_stderr: str) -> list[str]:
    """Workers killed by a signal print nothing themselves; torchrun names them."""
    lines = []
    for code, local_rank in re.findall(r"failed \(exitcode: (-\d+)\) local_rank: (\d+)", torchrun_stderr):
        number = -int(code)
        try:
            name = signal.Signals(number).name
        except ValueError:
            name = f"signal {number}"
        lines.append(f"local rank {local_rank}: killed by {name}")
    return lines


def _failure_lines(logs: Path) -> list[str]:
    """The workers' failure lines, identical messages merged: `ranks 0-3: ...`."""
    by_message: dict[str, list[int]] = {}
    for path in sorted(logs.rglob("stderr.log")):
        for line in path.read_text(errors="replace").splitlines():
            match = _FAILURE.match(line.strip())
            if match:
                by_message.setdefault(match.group(2), []).append(int(match.group(1)))
    lines = []
    for message, ranks in by_message.items():
        ranks = sorted(set(ranks))
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))}"
        lines.append(f"{who}: {message}")
    return lines


def _tail(text: str | None) -> list[str]:
    """Without a worker's own line (e.g. a worker killed by a signal): torchrun's reason."""
    lines = [l for l in (text or "").splitlines() if l.strip()]
    reasons = [l.strip() for l in lines if "exitcode" in l or "Signal" in l or "error" in l.lower()]
    return [f"torchrun: {r}" for r in reasons[-3:]] or ["torchrun: a worker failed (rerun with --verbose)"]


@plan_flags
def run(
    file: Annotated[str, typer.Argument(help="job file (TOML/JSON) or job preset name")],
    nproc: Annotated[Optional[int], typer.Option("--nproc", min=1, help="start torchrun with this many workers")] = None,
    report: Annotated[Optional[str], typer.Option("--report", help="write the run's JSON report here (rank 0)")] = None,
    resume: Annotated[Optional[str], typer.Option(
        "--resume", help="continue from the latest complete checkpoint (`--resume`) or one (`--resume=PATH`)")] = None,
    max_restarts: Annotated[int, typer.Option(
        "--max-restarts", min=0, help="let torchrun restart failed workers from the last checkpoint")] = 0,
    force: Annotated[bool, typer.Option("--force", help="run even when the estimate says it does not fit")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", help="let every rank log, not only rank 0")] = False,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """Train the plan with PyTorch and print measured memory and speed beside the estimate.

    Under torchrun it runs as one worker; otherwise it starts torchrun itself on this node
    (`--nproc`, default: the plan's world size).
    """
    resolved = flags.load(file, check_paths=True)
    if resume == "latest" and not resolved.job.checkpoint.dir:  # before torchrun starts, not after
        raise InputError(Problem("--resume", "the job has no [checkpoint] dir to resume from (set checkpoint.dir, "
                                             "or name a checkpoint: --resume=PATH)"))
    from ..runtime.capabilities import require_supported

    require_supported(resolved)
    _require_torch(resolved.job)
    if not under_torchrun():
        _check_report_path(report)  # before torchrun starts: not after the whole run
        _check_checkpoint_dir(resolved)
        _check_resume_path(resume, resolved.job.checkpoint.dir)
        _check_data_file(resolved)
        world = resolved.world
        if nproc is not None and nproc != world:
            raise InputError(Problem("--nproc", f"{counted(nproc, 'worker')}, but {resolved.degrees.arithmetic()}"))
        options = {"report": report, "resume": resume, "force": force, "verbose": verbose, "json": json_out}
        live = not json_out and sys.stderr.isatty()
        _spawn(nproc or world, max_restarts, _worker_args(file, flags, options), verbose, live,
               resolved.job.checkpoint.dir, resume)
        return
    from ..runtime.worker import RunOptions, describe_failure, fail, run_worker

    rank = int(os.environ.get("RANK", "0"))
    options = RunOptions(report, verbose, table=not json_out, resume=resume, force=force)
    try:
        result = run_worker(resolved, limits_known(resolved), options)
    except Exception as exc:  # one readable line per failing rank; the exit code says the rest
        from .app import show_traceback  # under --debug, the traceback too; the same exit code

        show_traceback(exc)
        fail(describe_failure(rank, exc, resolved.job.parallel.communication_timeout))
        code = exc.exit_code if isinstance(exc, ShardplanError) else EXIT_RUNTIME
        raise typer.Exit(code) from None
    if json_out and result is not None:
        from ..render.output import emit_json

        emit_json(result)


def register(app: typer.Typer) -> None:
    app.command("run")(run)
