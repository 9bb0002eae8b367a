"""The committed JSON schema (schema/job.schema.json) is what `shardplan schema` prints."""

from __future__ import annotations

import json

from conftest import ROOT, run_cli

SCHEMA_FILE = ROOT / "schema" / "job.schema.json"


def test_committed_schema_is_current():
    printed = run_cli("schema").json
    committed = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    assert committed == printed, "schema/job.schema.json is stale: run `shardplan schema > schema/job.schema.json`"


def test_every_field_is_described():
    schema = run_cli("schema").json
    for name, table in schema["$defs"].items():
        for key, prop in table.get("properties", {}).items():
            assert prop.get("description"), f"{name}.{key} has no description"
    assert set(schema["properties"]) == {
        "model", "parallel", "zero", "offload", "train", "lora", "data", "checkpoint", "cluster"
    }


def test_every_key_is_documented():
    from shardplan.spec.job import TABLES

    text = (ROOT / "docs" / "job-file.md").read_text(encoding="utf-8")
    for table, model in TABLES.items():
        assert f"## `[{table}]`" in text
        for key in model.model_fields:
            assert f"`{key}`" in text, f"docs/job-file.md does not describe {table}.{key}"
