"""A searched plan as job-file tables, and the job a search starts from.

`plan_tables` gives the tables the search set (CONTRACT: `plan` JSON `job`, and `--write`),
`written_job` the whole job file: the original document with those tables written over, so
`validate`, `estimate`, `run` and `export` take it unchanged and `estimate` reproduces the
plan's figures. `fixed_keys` reads which plan keys the job (its file, a preset, `--set`)
gives explicitly: those stay fixed, the others are searched.
"""

from __future__ import annotations

import copy

from ..core.estimate_inputs import EstimateInputs
from ..core.search import Fixed
from ..spec.job import JobSpec
from ..spec.names import AUTO

# The tables and keys the search may set; everything else in the job is kept as written.
SEARCHED = {
    "parallel": ("dp", "tp", "pp", "cp", "sequence_parallel", "pipeline_schedule", "virtual_stages",
                 "first_stage_layers", "last_stage_layers", "micro_batch_size", "num_microbatches"),
    "zero": ("stage", "hybrid"),
    "train": ("activation_checkpointing", "global_batch_size"),
    "offload": ("params", "grads", "optimizer"),
}


def plan_tables(inputs: EstimateInputs, global_batch: int) -> dict[str, dict[str, object]]:
    """The tables the search set, for the JSON and the written job file."""
    d = inputs.degrees
    parallel: dict[str, object] = {"dp": d.dp, "tp": d.tp, "pp": d.pp, "cp": d.cp,
                                   "sequence_parallel": inputs.sequence_parallel,
                                   "micro_batch_size": inputs.micro_batch, "num_microbatches": inputs.num_microbatches}
    if d.pp > 1:
        parallel["pipeline_schedule"] = inputs.schedule
        if inputs.virtual > 1:
            parallel["virtual_stages"] = inputs.virtual
        first, last = inputs.stage_split
        if first:
            parallel["first_stage_layers"] = first
        if last:
            parallel["last_stage_layers"] = last
    tables: dict[str, dict[str, object]] = {
        "parallel": parallel,
        "zero": {"stage": inputs.zero_stage, "hybrid": inputs.hybrid},
        "train": {"activation_checkpointing": inputs.recompute, "global_batch_size": global_batch},
    }
    # Offload the balanced strategy decided is the estimate's own decision again when the
    # written job is estimated or run; only offload the plan itself asks for is written.
    offload = {key: True for key, on in (("params", inputs.offload_params), ("grads", inputs.offload_grads),
                                          ("optimizer", inputs.offload_optimizer)) if on}
    if offload:
        tables["offload"] = offload
    return tables


def written_job(document: dict, tables: dict[str, dict[str, object]]) -> dict:
    """The job document with the plan's tables written over the keys the search sets. A key
    the job fixes that the plan leaves unwritten stays as the job wrote it (a pipeline schedule
    fixed for a plan of one stage, whose estimate took it); one it left to the search ("auto")
    goes."""
    data = copy.deepcopy(document)
    for table, keys in SEARCHED.items():
        section = data.setdefault(table, {})
        if not isinstance(section, dict):
            section = data[table] = {}
        for key in keys:
            if section.get(key) == AUTO or key in tables.get(table, {}):
                section.pop(key, None)
        section.update(tables.get(table, {}))
        if not section:
            del data[table]
    return data


# Fixed's fields and the job keys that fix them; `offload` stands for any of the offload
# table's params / grads / optimizer (written: never searched).
FIXED_KEYS = {
    "dp": "parallel.dp", "tp": "parallel.tp", "pp": "parallel.pp", "cp": "parallel.cp",
    "sequence_parallel": "parallel.sequence_parallel", "schedule": "parallel.pipeline_schedule",
    "virtual": "parallel.virtual_stages", "first_stage_layers": "parallel.first_stage_layers",
    "last_stage_layers": "parallel.last_stage_layers", "micro_batch": "parallel.micro_batch_size",
    "num_microbatches": "parallel.num_microbatches", "zero_stage": "zero.stage", "hybrid": "zero.hybrid",
    "recompute": "train.activation_checkpointing",
}


def fixed_keys(job: JobSpec) -> Fixed:
    """The plan keys the job gives explicitly (pydantic's fields_set of each table)."""
    def given(path: str):
        table, key = path.split(".")
        section = getattr(job, table)
        return getattr(section, key) if key in section.model_fields_set else None

    offload_given = any(k in job.offload.model_fields_set for k in SEARCHED["offload"])
    return Fixed(**{name: given(path) for name, path in FIXED_KEYS.items()}, offload=True if offload_given else None)
