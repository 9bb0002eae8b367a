"""Exported Megatron-LM arguments against Megatron-LM's own parser, as recorded.

Megatron-LM's argument parser (megatron/training/arguments.py) is not on the package index,
so tests/data/interop/megatron_arguments.json records, for every argument the exporter can
write, where Megatron defines it (file:line at the commit named in the file), whether it
takes a value and its choices, read off Megatron-LM's parser at that commit.
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from conftest import DATA, ROOT, run_cli
from interop_plans import PLANS

RECORD = json.loads((DATA / "interop" / "megatron_arguments.json").read_text())
ARGUMENTS = RECORD["arguments"]


def exported_args(write, plan: str) -> list[str]:
    result = run_cli("export", write("job.toml", PLANS[plan]), "--to", "megatron")
    assert result.code == 0, result.err
    return shlex.split(result.out.replace("\\\n", " "))


def test_record_covers_every_argument_the_exporter_writes():
    source = (ROOT / "shardplan" / "io" / "interop" / "megatron.py").read_text()
    written = set(re.findall(r'add\("(--[a-z0-9-]+)"', source))
    assert written == set(ARGUMENTS)
    assert len(RECORD["megatron_lm_commit"]) == 40
    for flag, entry in ARGUMENTS.items():
        assert re.match(r"megatron/[a-z_/]+\.py:\d+", entry["source"]), flag


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_arguments_parse_as_megatrons(write, plan):
    args = exported_args(write, plan)
    i = 0
    while i < len(args):
        flag = args[i]
        assert flag in ARGUMENTS, f"{flag} is not a Megatron-LM argument"
        entry = ARGUMENTS[flag]
        if entry["takes_value"]:
            value = args[i + 1]
            assert not value.startswith("--"), flag
            if entry["choices"]:
                assert value in entry["choices"], (flag, value)
            i += 2
        else:
            i += 1
    assert len(set(a for a in args if a.startswith("--"))) == sum(a.startswith("--") for a in args)


def test_the_rotary_base_is_said_not_exported():
    """shardplan keeps no rotary base, and Megatron-LM's --rotary-base defaults to 10000
    (megatron/training/arguments.py), not Llama 3's 500000: a note says so; GPT-2's learned
    positions have none."""
    notes = run_cli("export", "llama-3-8b-h100", "--to", "megatron", "--json").json["notes"]
    assert any(n["path"] == "model.position_embedding" and "--rotary-base" in n["message"] for n in notes)
    gpt2 = run_cli("export", "tiny-gpt2-cpu", "--to", "megatron", "--json").json["notes"]
    assert not any("--rotary-base" in n["message"] for n in gpt2)


def test_interleaved_microbatches_megatron_does_not_take_are_said(write):
    """Megatron-LM refuses an interleaved schedule whose microbatches pp does not divide
    (megatron/core/pipeline_parallel/schedules.py, get_forward_backward_func: "number of
    microbatches is not divisible by pipeline-parallel size when using interleaved
    schedule"); torch runs 6 on pp 4 in one round, so the job is valid and the export says it."""
    plan = PLANS["pp4_interleaved"].replace("num_microbatches = 16", "num_microbatches = 6")
    assert plan != PLANS["pp4_interleaved"]
    notes = run_cli("export", write("job.toml", plan), "--to", "megatron", "--json").json["notes"]
    assert any(n["path"] == "parallel.num_microbatches" and "divisible by pp (4)" in n["message"] for n in notes)
    whole = run_cli("export", write("whole.toml", PLANS["pp4_interleaved"]), "--to", "megatron", "--json").json["notes"]
    assert not any(n["path"] == "parallel.num_microbatches" for n in whole)
