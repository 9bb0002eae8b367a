"""`shardplan schema`: the JSON schema of the job file (also committed as schema/job.schema.json)."""

from __future__ import annotations

import typer

from ..render.output import emit_json
from ..spec.schema import job_schema
from .options import JsonFlag


def schema(json_out: JsonFlag = False) -> None:
    """Print the JSON schema of the job file (editors use it to complete TOML)."""
    emit_json(job_schema())


def register(app: typer.Typer) -> None:
    app.command("schema")(schema)
