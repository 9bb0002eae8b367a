"""Shipped presets: models (published config values), cluster node types, GPUs (the time
model's hardware figures, each with its datasheet), example jobs.

Each preset is a job-file fragment in `presets/<kind>/<name>.toml`; its first comment line
describes it and names its source.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..spec.errors import InputError, Problem
from .problems import did_you_mean

KINDS = ("models", "clusters", "gpus", "jobs")


@lru_cache(maxsize=1)
def presets_dir() -> Path:
    """`presets/` shipped inside the wheel, else beside the package in a source checkout."""
    here = Path(__file__).resolve().parent.parent
    for candidate in (here / "presets", here.parent / "presets"):
        if (candidate / "models").is_dir():
            return candidate
    raise InputError(Problem("", "the shipped presets are missing from this installation"))


@dataclass(frozen=True)
class Preset:
    name: str
    kind: str
    path: Path

    @property
    def description(self) -> str:
        for line in self.path.read_text(encoding="utf-8").splitlines():
            stripped = line.strip()
            if stripped.startswith("#") and not stripped.startswith("#:"):
                return stripped.lstrip("#").strip()
            if stripped and not stripped.startswith("#"):
                break
        return ""


def list_presets(kind: str | None = None) -> list[Preset]:
    kinds = (kind,) if kind else KINDS
    found = []
    for k in kinds:
        for path in sorted((presets_dir() / k).glob("*.toml")):
            found.append(Preset(path.stem, k, path))
    return found


def find_preset(name: str, kind: str | None = None, path: str = "") -> Preset:
    """The preset called `name` (of `kind` when given); an unknown name is an InputError."""
    candidates = list_presets(kind)
    for preset in candidates:
        if preset.name == name:
            return preset
    what = {"models": "model", "clusters": "cluster", "gpus": "gpu", "jobs": "job"}.get(kind or "", "")
    stem = Path(name).stem if name.endswith(".toml") or "/" in name else name  # `models/gpt2.toml` is gpt2
    hint = did_you_mean(stem, [p.name for p in candidates]) or " (see `shardplan presets`)"
    raise InputError(Problem(path, f"no {what + ' ' if what else ''}preset named {name!r}{hint}"))
