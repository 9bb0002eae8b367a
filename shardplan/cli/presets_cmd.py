"""`shardplan presets [NAME]`: list the shipped presets, or show one."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from ..core.params import count_params
from ..io.job import load_job
from ..io.presets import find_preset, list_presets
from ..render.output import emit_json, stdout_console
from .options import JsonFlag


def _params(preset) -> dict | None:
    if preset.kind in ("clusters", "gpus"):
        return None
    shape = load_job(str(preset.path), env={}).shape
    if shape is None:
        return None
    counts = count_params(shape)
    return {"total": counts.total, "embedding": counts.embedding, "active": counts.active}


def _table(preset) -> dict:
    """The preset's keys as validated values (sizes and counts as integers, CONTRACT units)."""
    return load_job(str(preset.path), env={}).job.model_dump(mode="json", exclude_unset=True)


def presets(
    name: Annotated[Optional[str], typer.Argument(help="a preset to show")] = None,
    json_out: JsonFlag = False,
) -> None:
    """List the shipped models, cluster node types, GPUs and example jobs, or show one of them."""
    from ..render.presets import preset_detail, preset_table  # rich loads only here
    if name is None:
        rows = [
            {"name": p.name, "kind": p.kind.rstrip("s"), "description": p.description, "params": _params(p)}
            for p in list_presets()
        ]
        if json_out:
            emit_json({"presets": rows})
        else:
            stdout_console().print(preset_table(rows), soft_wrap=True)
        return
    preset = find_preset(name)
    doc = {
        "name": preset.name,
        "kind": preset.kind.rstrip("s"),
        "description": preset.description,
        "file": f"presets/{preset.kind}/{preset.path.name}",
        "table": _table(preset),
        "params": _params(preset),
    }
    if json_out:
        emit_json(doc)
    else:
        stdout_console().print(preset_detail(doc, preset.path.read_text(encoding="utf-8")), soft_wrap=True)


def register(app: typer.Typer) -> None:
    app.command("presets")(presets)
