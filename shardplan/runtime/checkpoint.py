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
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..spec.errors import RunFailure
from . import faults
from .resume import META, PARTIAL, complete_checkpoints, find  # noqa: F401 - find: the workers' resume test
from .resume import checkpoint_name as _name

# 2: the optimizer state flattened by parameter name (format 1 kept param_groups by index,
# which the ranks of a pipeline each number from 0: saved, one rank's overwrote the others').
FORMAT_VERSION = 2

# Optimizer states and hyperparameters keyed by each parameter's name (`state.<fqn>.exp_avg`,
# `param_groups.<fqn>.lr`): pipeline ranks hold different parameters, and a param_groups list
# indexed from 0 on every rank collides in the checkpoint. torch's flattening (pytorch PR
# #127071), as torchtitan uses it for pipeline parallel (components/checkpoint.py,
# CheckpointManager's note; components/optimizer.py).
_OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


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
    model_state, optim_state = get_state_dict(checkpoint_module(modules), _optimizers(optimizer), options=_OPTIONS)
    return {"model": model_state, "optim": optim_state}


# A tied embedding's head: one tensor without a pipeline (the model has no `lm_head`), the last
# stage's own copy with one (runtime/pipeline.py `stage_module`), kept equal to the embedding
# with the same gradient, so the same optimizer states. A checkpoint written without a
# pipeline holds the embedding's name only; a pipeline's last stage loads its copy from it.
_HEAD, _EMBEDDING = "lm_head.weight", "embed.weight"


def _tied_head_aliases(state: dict, stored: set[str]) -> dict[tuple[str, str], str]:
    """{(part, key this rank holds): the stored key it is loaded from} for the head copy's
    entries that the checkpoint lacks and holds under the embedding's name (`model.`,
    `optim.state.`, `optim.param_groups.` prefixes, as DCP flattens the nested dict)."""
    aliases = {}
    for part, entries in state.items():
        for key in entries:
            if _HEAD not in key or f"{part}.{key}" in stored:
                continue
            source = key.replace(_HEAD, _EMBEDDING)
            # A rank holding the embedding too (no schedule `run` executes puts the first and
            # the last stage on one rank) is left to DCP's missing-key error.
            if f"{part}.{source}" in stored and source not in entries:
                aliases[(part, key)] = source
    return aliases


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


def load(path: Path, modules: list[nn.Module], optimizer: torch.optim.Optimizer, same_layout: bool,
         lr: float | None = None) -> float | None:
    """Load model and optimizer states (resharding through DCP) and, on the same layout,
    this rank's RNG states. The optimizer's learning rate is the job's (`lr`), not the one
    saved with its states (a resume after a divergence lowers it); returns the saved one
    where it differs, else None."""
    state = _model_state(modules, optimizer)
    try:
        stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
        aliases = _tied_head_aliases(state, stored)
        # The head copy's entries loaded under the embedding's stored names (DCP loads tensors
        # in place and replaces other values), then put back under their own.
        wanted = {part: dict(entries) for part, entries in state.items()}
        for (part, key), source in aliases.items():
            wanted[part][source] = wanted[part].pop(key)
        dcp.load(wanted, checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # CheckpointException is a BaseException
        raise RunFailure(f"checkpoint: cannot load {path}: {_reason(exc)}") from None
    for part, entries in state.items():
        for key in entries:
            entries[key] = wanted[part][aliases.get((part, key), key)]
    set_state_dict(checkpoint_module(modules), _optimizers(optimizer), model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=_OPTIONS)
    saved = None
    if lr is not None:
        for member in _optimizers(optimizer):
            for group in member.param_groups:
                if float(group["lr"]) != lr:
                    saved = float(group["lr"])
                group["lr"] = lr
    exact = path / f"offload-{dist.get_rank()}.pt"
    host = [o for o in _optimizers(optimizer) if hasattr(o, "load_exact_state")]
    if same_layout and exact.is_file() and host and host[0].config.compression != "none":
        host[0].load_exact_state(torch.load(exact, weights_only=True))
    rng = path / f"rng-{dist.get_rank()}.pt"
    if same_layout and rng.is_file():
        rng_state = torch.load(rng, weights_only=True)
        torch.set_rng_state(rng_state["cpu"])
        if "cuda" in rng_state and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng_state["cuda"])
    return saved
