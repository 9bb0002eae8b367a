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


# Each model's rope_theta as its Hugging Face config.json publishes it (Llama 2's gives none:
# LlamaConfig's default, 10000.0); Megatron-LM's --rotary-base is an int defaulting to 10000
# (megatron/training/arguments.py:2418 at the recorded commit).
ROTARY_BASES = {
    "llama-3-8b": 500000,    # meta-llama/Meta-Llama-3-8B config.json
    "llama-2-7b": 10000,     # meta-llama/Llama-2-7b-hf config.json (LlamaConfig's default)
    "mixtral-8x7b": 1000000,  # mistralai/Mixtral-8x7B-v0.1 config.json
    "qwen2.5-7b": 1000000,    # Qwen/Qwen2.5-7B config.json
}


@pytest.mark.parametrize("preset", sorted(ROTARY_BASES))
def test_the_rotary_base_is_exported(preset):
    """A rope model's base is written as Megatron takes it (an integer); no note asks for it."""
    result = run_cli("export", "llama-3-8b-h100", "--to", "megatron", "--json", "--set", f"model.preset={preset}")
    assert result.code == 0, result.err
    args = result.json["config"]["args"]
    assert args[args.index("--rotary-base") + 1] == str(ROTARY_BASES[preset])
    assert not any("rotary" in n["message"] for n in result.json["notes"])


def test_learned_positions_have_no_rotary_base():
    result = run_cli("export", "tiny-gpt2-cpu", "--to", "megatron", "--json")
    args = result.json["config"]["args"]
    assert "--rotary-base" not in args
    assert not any("rotary" in n["message"] for n in result.json["notes"])


def test_a_rope_model_without_a_base_is_said(write):
    """An inline rope shape that gives no rope_theta: Megatron would run its 10000, so a note
    asks for the base; with rope_theta the flag is written."""
    shape = ('[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
             'ffn_hidden_size = 128\nvocab_size = 1000\n')
    bare = run_cli("export", write("bare.toml", shape), "--to", "megatron", "--json").json
    assert any(n["path"] == "model.rope_theta" and "--rotary-base" in n["message"] for n in bare["notes"])
    given = run_cli("export", write("given.toml", shape + "rope_theta = 500000.0\n"), "--to", "megatron")
    assert given.code == 0, given.err
    assert "--rotary-base 500000" in given.out


def test_a_base_megatron_cannot_take_is_said(write):
    """--rotary-base is `type=int`: a fractional base is not written (Megatron would refuse
    it), and a note says so."""
    shape = ('[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
             'ffn_hidden_size = 128\nvocab_size = 1000\nrope_theta = 10000.5\n')
    result = run_cli("export", write("job.toml", shape), "--to", "megatron", "--json").json
    args = result["config"]["args"]
    assert "--rotary-base" not in args
    assert any(n["path"] == "model.rope_theta" and "10000.5" in n["message"] for n in result["notes"])


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
