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


def test_a_default_the_schema_states_changes_nothing_when_written(write):
    """Every key the schema gives a `default` for, written with that value, gives the same
    job as leaving it out: keys whose unwritten value comes from other keys (the CPU budget
    from the node's RAM, the fit check from a stated GPU memory, the sequence from the
    model's positions) state no default."""
    import tomli_w

    schema = run_cli("schema").json
    written = {"model": {"preset": "tiny-gpt2"}}
    for table in ("parallel", "zero", "offload", "train", "data", "checkpoint", "cluster"):
        prop = schema["properties"][table]
        ref = prop.get("$ref") or next(a["$ref"] for a in prop["anyOf"] if "$ref" in a)
        fields = schema["$defs"][ref.rsplit("/", 1)[-1]]["properties"]
        written[table] = {k: p["default"] for k, p in fields.items() if p.get("default") is not None}
    assert "cpu_memory_budget" not in written["offload"] and "gpu_memory" not in written["cluster"]
    assert "seq_len" not in written["train"] and written["train"]
    full = write("full.toml", tomli_w.dumps(written))
    bare = write("bare.toml", tomli_w.dumps({"model": {"preset": "tiny-gpt2"}}))
    for command in ("estimate", "validate"):
        a, b = run_cli(command, full, "--json"), run_cli(command, bare, "--json")
        assert a.code == b.code == 0, a.err
        if command == "estimate":
            assert a.json == b.json
