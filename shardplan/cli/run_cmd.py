"""`shardplan run FILE`: execute the plan with torch, under torchrun or by starting it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Annotated, Optional

import typer

from ..spec.errors import EXIT_BAD_INPUT, EXIT_RUNTIME, InputError, Problem
from .estimate_cmd import limits_known
from .options import JsonFlag, PlanFlags, plan_flags


def _under_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)


def _require_torch() -> None:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise InputError(Problem("", "`shardplan run` needs torch: pip install torch==2.13.0 && pip install "
                                     "'shardplan[run]'")) from None


def _spawn(nproc: int, argv: list[str]) -> int:
    """Start torchrun on this node with `nproc` workers running the same command."""
    torchrun = shutil.which("torchrun")
    command = [torchrun] if torchrun else [sys.executable, "-m", "torch.distributed.run"]
    command += ["--standalone", f"--nproc_per_node={nproc}", "-m", "shardplan", "run", *argv]
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.run(command, env=env).returncode


@plan_flags
def run(
    file: Annotated[str, typer.Argument(help="job file (TOML/JSON) or job preset name")],
    nproc: Annotated[Optional[int], typer.Option("--nproc", min=1, help="start torchrun with this many workers")] = None,
    report: Annotated[Optional[str], typer.Option("--report", help="write the run's JSON report here (rank 0)")] = None,
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
    from ..runtime.capabilities import require_supported

    require_supported(resolved)
    _require_torch()
    if not _under_torchrun():
        world = resolved.world
        if nproc is not None and nproc != world:
            raise InputError(Problem("--nproc", f"{nproc} workers, but {resolved.degrees.arithmetic()}"))
        code = _spawn(nproc or world, _worker_args(file, flags, report, verbose, json_out))
        if code:
            raise typer.Exit(EXIT_RUNTIME if code != EXIT_BAD_INPUT else EXIT_BAD_INPUT)
        return
    from ..runtime.worker import fail, run_worker

    rank = int(os.environ.get("RANK", "0"))
    try:
        result = run_worker(resolved, limits_known(resolved), report, verbose, table=not json_out)
    except Exception as exc:  # one readable line per failing rank; the exit code says the rest
        if os.environ.get("SHARDPLAN_DEBUG"):
            raise
        fail(rank, exc)
        raise typer.Exit(EXIT_RUNTIME) from None
    if json_out and result is not None:
        from ..render.output import emit_json

        emit_json(result)


def _worker_args(file: str, flags: PlanFlags, report: str | None, verbose: bool, json_out: bool) -> list[str]:
    """The command line each torchrun worker runs: the same job, flags and outputs."""
    args = [file]
    for name, value in flags.shortcuts.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    for expression in flags.sets:
        args += ["--set", expression]
    if report:
        args += ["--report", report]
    if verbose:
        args.append("--verbose")
    if json_out:
        args.append("--json")
    return args


def register(app: typer.Typer) -> None:
    app.command("run")(run)

