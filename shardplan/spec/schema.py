"""The job file's JSON schema, as published by `shardplan schema`."""

from __future__ import annotations

from .job import JobSpec

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def job_schema() -> dict:
    schema = JobSpec.model_json_schema(mode="validation")
    return {"$schema": SCHEMA_DIALECT, "title": "shardplan job file", **{k: v for k, v in schema.items() if k != "title"}}
