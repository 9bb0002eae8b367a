"""Which checkpoint `shardplan run` resumes from, and the refusals of docs/recovery.md.

Torch-free: the launcher applies the same tests before torchrun starts (cli/run_cmd.py), the
workers again where they read the checkpoint (runtime/worker.py), and both word a restart
the same way. The folder's layout is runtime/checkpoint.py's.
"""

from __future__ import annotations

import re
from pathlib import Path

from ..spec.errors import RunFailure

META = "shardplan.json"  # written last: only a complete checkpoint has it
PARTIAL = ".partial"  # the suffix of a checkpoint being written (or abandoned while written)
_COMPLETE = re.compile(r"^step-(\d{8})$")
# What DCP and runtime/checkpoint.py write into a checkpoint besides META: a folder holding
# some of them and no META was left by a run that stopped while saving.
_SHARDS = (".metadata", "*.distcp", "rng-*.pt", "offload-*.pt")


def checkpoint_name(step: int) -> str:
    return f"step-{step:08d}"


def complete_checkpoints(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoints in `folder`, oldest first."""
    if not folder.is_dir():
        return []
    found = []
    for entry in folder.iterdir():
        match = _COMPLETE.match(entry.name)
        if match and (entry / META).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _holds_shards(path: Path) -> bool:
    return any(next(path.glob(pattern), None) is not None for pattern in _SHARDS)


def find(folder: Path, requested: str) -> Path:
    """The checkpoint to resume: the latest complete one in `folder` (`requested` "latest"),
    or the path given. Refusals are docs/recovery.md's table (RunFailure: exit 3)."""
    if requested == "latest":
        complete = complete_checkpoints(folder)
        if not complete:
            partial = sorted(e.name for e in folder.iterdir() if e.name.endswith(PARTIAL)) if folder.is_dir() else []
            why = f" (only the unfinished {', '.join(partial)})" if partial else ""
            raise RunFailure(f"checkpoint: no complete checkpoint in {folder}{why}")
        return complete[-1][1]
    path = Path(requested)
    if path.is_dir() and (path.name.endswith(PARTIAL) or (not (path / META).is_file() and _holds_shards(path))):
        raise RunFailure(f"checkpoint: {requested} is incomplete (written by a run that stopped while saving)")
    if not path.is_dir() or not (path / META).is_file():
        inside = complete_checkpoints(path)  # the folder of [checkpoint] dir, given for one of its checkpoints
        hint = f" (it holds checkpoints: --resume={inside[-1][1]} is its latest)" if inside else ""
        raise RunFailure(f"checkpoint: {requested} is not a checkpoint folder{hint}")
    return path


def resume_request(folder: str, requested: str | None, restarted: bool) -> str | None:
    """What a worker resumes from: `--resume`'s value ("latest", a path, None: start afresh);
    a worker restarted by torchrun (--max-restarts) takes the latest complete checkpoint in
    `[checkpoint] dir` when there is one and it is further on than a `--resume=PATH` the run
    began from (a step number the name `step-N` gives); else what the run began from."""
    if not (restarted and folder):
        return requested
    complete = complete_checkpoints(Path(folder))
    if not complete:
        return requested
    began = _COMPLETE.match(Path(requested).name) if requested not in (None, "latest") else None
    if began is not None and complete[-1][0] <= int(began.group(1)):
        return requested
    return "latest"


def restart_line(restart: int, max_restarts: int, folder: str, requested: str | None, cause: str = "") -> str:
    """The one line that says torchrun restarted the workers, what after (`cause`, when the
    caller knows it) and where the restarted run starts."""
    request = resume_request(folder, requested, restarted=True)
    if request == "latest":
        step, path = complete_checkpoints(Path(folder))[-1]
        start = f"resuming from {path} after step {step}"
    elif request is not None:
        start = f"resuming from {request}"
    elif folder:
        start = f"no complete checkpoint in {folder} yet: training from step 1"
    else:
        start = "the job writes no checkpoints ([checkpoint] dir): training from step 1"
    after = f" (after {cause})" if cause else ""
    return f"restart {restart} of {max_restarts}{after}: {start}"
