"""Keys a job writes that its framework's accounting does not read get a warning (exit 0):
DeepSpeed's own knobs (spec/job.py ZeroSpec, read by core/deepspeed.py only) under fsdp2 or
zero-paper, and FSDP's `min_num_params` under deepspeed, which has no such knob (DeepSpeed
0.19.8 zero/config.py lists none; its stage 3 keeps small parameters whole by
stage3_param_persistence_threshold instead)."""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.checks import DEEPSPEED_KEYS

BASE = """
[model]
preset = "tiny-gpt2"
[parallel]
dp = 4
[zero]
stage = 3
"""


def _warnings(write, text: str, *flags: str) -> list[dict]:
    result = run_cli("validate", write("job.toml", text), "--json", *flags)
    assert result.code == 0, result.err
    return [p for f in result.json["files"] for p in f["problems"] if p["severity"] == "warning"]


@pytest.mark.parametrize("key, value", [("reduce_bucket_size", "1000"), ("allgather_bucket_size", "1000"),
                                        ("prefetch_bucket_size", "0"), ("max_live_parameters", "1000"),
                                        ("param_persistence_threshold", "10"), ("overlap_comm", "false")])
@pytest.mark.parametrize("framework", ["fsdp2", "zero-paper"])
def test_deepspeed_knobs_under_another_framework_warn(write, key, value, framework):
    found = _warnings(write, BASE + f'framework = "{framework}"\n{key} = {value}\n')
    assert [w["path"] for w in found] == [f"zero.{key}"]
    assert framework in found[0]["message"] and "export --to deepspeed" in found[0]["message"]
    # Under deepspeed the same key is read: no warning.
    assert _warnings(write, BASE + f'framework = "deepspeed"\n{key} = {value}\n') == []


def test_every_deepspeed_knob_is_checked():
    from shardplan.spec.job import ZeroSpec

    fsdp_or_common = {"stage", "hybrid", "min_num_params", "framework"}
    assert set(ZeroSpec.model_fields) - fsdp_or_common == set(DEEPSPEED_KEYS)


def test_min_num_params_under_deepspeed_warns(write):
    found = _warnings(write, BASE + 'framework = "deepspeed"\nmin_num_params = 1000\n')
    assert [w["path"] for w in found] == ["zero.min_num_params"]
    assert "param_persistence_threshold" in found[0]["message"]
    assert _warnings(write, BASE + "min_num_params = 1000\n") == []  # fsdp2 reads it


def test_a_set_flag_counts_as_written(write):
    found = _warnings(write, BASE, "--set", "zero.reduce_bucket_size=1000")
    assert [w["path"] for w in found] == ["zero.reduce_bucket_size"]
    assert _warnings(write, BASE, "--set", "zero.reduce_bucket_size=1000", "--framework", "deepspeed") == []


def test_defaults_do_not_warn(write):
    assert _warnings(write, BASE) == []
