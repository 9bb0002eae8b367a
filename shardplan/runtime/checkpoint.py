"""Sharded checkpoints that a crash at any moment cannot break.

Layout of `[checkpoint] dir` (docs/recovery.md):

    step-00000040/            a complete checkpoint (only complete ones have this name)
        .metadata, *.distcp   torch.distributed.checkpoint shards: model and optimizer
        rng-<rank>.pt         each rank's RNG states
        offload-<rank>.pt     compressed host optimizer states as stored (same-layout resume)
        shardplan.json        step, plan, model shape, world, layout: written last
    step-00000050.partial/    a checkpoint being written (or abandoned by a crash)

Every rank writes into `<name>.partial`; after a barrier rank 0 writes `shardplan.json` and
renames the folder to its final name (one atomic rename), then a second barrier; only then
are checkpoints beyond `keep` deleted. A crash before the rename leaves the previous
checkpoint untouched and a `.partial` folder that the next save removes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..spec.errors import RunFailure
from . import faults
from .resume import META, PARTIAL, complete_checkpoints, find  # noqa: F401 - find: the workers' resume test
from .resume import checkpoint_name as _name

FORMAT_VERSION = 1


class _WholeModel(nn.Module):
    """The stages one rank holds, as one module whose parameter names are the full model's
    (`layers.<global index>`, `embed`, `lm_head`, ...), so a checkpoint does not depend on how
    the layers were cut into stages."""

    def __init__(self, stages: list[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleDict()
        for stage in stages:
            stage = getattr(stage, "module", stage)  # DistributedDataParallel's wrapped module
            for name, child in stage.named_children():
                if name == "layers":
                    for index, block in child.items():
                        self.layers[index] = block
                elif child is not None:
                    self.add_module(name, child)


def checkpoint_module(modules: list[nn.Module]) -> nn.Module:
    """The module whose state a checkpoint holds."""
    return modules[0] if len(modules) == 1 else _WholeModel(modules)


def _optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers a checkpoint holds: a device and a host one under offload."""
    return list(getattr(optimizer, "members", [optimizer]))


def _model_state(modules: list[nn.Module], optimizer) -> dict:
    model_state, optim_state = get_state_dict(checkpoint_module(modules), _optimizers(optimizer))
    return {"model": model_state, "optim": optim_state}


def _exact_states(optimizer) -> dict:
    """Compressed host optimizer states as stored (runtime/offload.py `exact_state`)."""
    host = [o for o in _optimizers(optimizer) if hasattr(o, "exact_state") and o.config.compression != "none"]
    return host[0].exact_state() if host else {}


def save(folder: Path, step: int, modules: list[nn.Module], optimizer: torch.optim.Optimizer,
         plan: dict, keep: int) -> Path:
    """Write the checkpoint of `step` (every rank calls this); returns its final path."""
    rank = dist.get_rank()
    final = folder / _name(step)
    partial = folder / f"{_name(step)}{PARTIAL}"
    if rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
        if partial.exists():
            shutil.rmtree(partial)
    dist.barrier()
    try:
        dcp.save(_model_state(modules, optimizer), checkpoint_id=str(partial))
    except CheckpointException as exc:  # a BaseException: make it an ordinary failure
        raise RunFailure(f"checkpoint: cannot write {partial}: {_reason(exc)}") from None
    torch.save(_rng_state(), partial / f"rng-{rank}.pt")
    exact = _exact_states(optimizer)
    if exact:
        torch.save(exact, partial / f"offload-{rank}.pt")
    faults.maybe("checkpoint", step, rank)
    dist.barrier()
    if rank == 0:
        meta = {"format": FORMAT_VERSION, "step": step, **plan}
        (partial / META).write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
        if final.exists():  # the same step written again (a rerun): replace it whole
            shutil.rmtree(final)
        os.replace(partial, final)
        _prune(folder, keep)
    dist.barrier()
    return final


def _reason(exc: BaseException) -> str:
    """The underlying error of a DCP failure, in one line."""
    failures = getattr(exc, "failures", None)
    if failures:
        rank, inner = next(iter(failures.items()))
        if isinstance(inner, tuple):  # (exception, traceback summary)
            inner = inner[0]
        text = str(inner).strip().splitlines()[0] if str(inner).strip() else type(inner).__name__
        text = text.split(". ")[0]
        return f"{type(inner).__name__} on rank {rank}: {text}"
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text}"


def _prune(folder: Path, keep: int) -> None:
    """Delete complete checkpoints beyond the newest `keep`, and abandoned partial ones."""
    complete = complete_checkpoints(folder)
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    for entry in folder.iterdir():
        if entry.name.endswith(PARTIAL):
            shutil.rmtree(entry, ignore_errors=True)


def _rng_state() -> dict:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def read_meta(path: Path) -> dict:
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise RunFailure(f"checkpoint: {path / META} is unreadable: {exc}") from None
    if meta.get("format") != FORMAT_VERSION:
        raise RunFailure(f"checkpoint: {path} has format {meta.get('format')!r}, expected {FORMAT_VERSION}")
    return meta


def check_compatible(meta: dict, plan: dict, path: Path) -> str | None:
    """The same model is required; another layout is resharded (returns how)."""
    if meta.get("model") != plan["model"]:
        written = meta.get("model", {}).get("name") or meta.get("model", {}).get("family")
        raise RunFailure(
            f"checkpoint: {path} was written for another model ({written}, "
            f"{meta.get('params'):,} parameters); this job trains {plan['model'].get('name') or plan['model'].get('family')} "
            f"({plan['params']:,} parameters)"
        )
    if meta.get("degrees") != plan["degrees"] or meta.get("zero_stage") != plan["zero_stage"]:
        old, new = meta.get("degrees", {}), plan["degrees"]
        describe = lambda d: " x ".join(f"{a}{d[a]}" for a in ("dp", "tp", "pp", "cp") if d.get(a, 1) > 1) or "1 rank"
        return (f"resharding from {describe(old)} (ZeRO {meta.get('zero_stage')}) to {describe(new)} "
                f"(ZeRO {plan['zero_stage']})")
    return None


def load(path: Path, modules: list[nn.Module], optimizer: torch.optim.Optimizer, same_layout: bool) -> None:
    """Load model and optimizer states (resharding through DCP) and, on the same layout,
    this rank's RNG states."""
    state = _model_state(modules, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise RunFailure(f"checkpoint: cannot load {path}: {_reason(exc)}") from None
    set_state_dict(checkpoint_module(modules), _optimizers(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    exact = path / f"offload-{dist.get_rank()}.pt"
    host = [o for o in _optimizers(optimizer) if hasattr(o, "load_exact_state")]
    if same_layout and exact.is_file() and host and host[0].config.compression != "none":
        host[0].load_exact_state(torch.load(exact, weights_only=True))
    rng = path / f"rng-{dist.get_rank()}.pt"
    if same_layout and rng.is_file():
        saved = torch.load(rng, weights_only=True)
        torch.set_rng_state(saved["cpu"])
        if "cuda" in saved and torch.cuda.is_available():
            torch.cuda.set_rng_state(saved["cuda"])
