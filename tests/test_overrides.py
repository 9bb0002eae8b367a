"""`--set KEY=auto` (io/overrides.py): a plan key set to auto is taken out of the job, as if
neither the file nor a job preset wrote it; any other key keeps "auto" as its value."""

from __future__ import annotations

from conftest import run_cli
from shardplan.io.overrides import apply_overrides, collect_overrides
from shardplan.io.plan_job import FIXED_KEYS, SEARCHED
from shardplan.spec.names import PLAN_KEYS

FILE = {"parallel": {"dp": 2, "tp": 8}, "zero": {"stage": 1}, "data": {"path": "tokens.bin"}}


def test_auto_takes_a_plan_key_out():
    data = apply_overrides(FILE, collect_overrides({}, ["parallel.tp=auto", "zero.stage=auto", "offload.params=auto"]))
    assert data["parallel"] == {"dp": 2} and data["zero"] == {} and "offload" not in data
    assert FILE["parallel"] == {"dp": 2, "tp": 8}  # the file's tables are not changed


def test_auto_is_a_value_for_other_keys():
    """`data.dtype = "auto"` is a value of its own (spec/job.py), not a plan key."""
    data = apply_overrides(FILE, collect_overrides({}, ["data.dtype=auto"]))
    assert data["data"] == {"path": "tokens.bin", "dtype": "auto"}


def test_a_later_value_sets_the_key_again():
    data = apply_overrides(FILE, collect_overrides({}, ["parallel.tp=auto", "parallel.tp=4"]))
    assert data["parallel"] == {"dp": 2, "tp": 4}


def test_the_plan_keys_are_what_plan_searches():
    assert set(PLAN_KEYS) == set(FIXED_KEYS.values()) | {f"offload.{key}" for key in SEARCHED["offload"]}


def test_estimate_takes_the_default_of_a_key_set_auto():
    """Outside `plan`, a key left out takes its default (CONTRACT: tp 1, dp 1): the preset's
    tp 8 x pp 4 x dp 2 on its 64 GPUs, with tp auto and dp 16, is tp 1."""
    result = run_cli("estimate", "llama-2-70b-3d", "--set", "parallel.tp=auto", "--dp", "16",
                     "--set", "parallel.sequence_parallel=auto", "--json")
    assert result.code in (0, 1), result.err
    devices = result.json["devices"]
    assert len(devices) == 4 and all(len(device["ranks"]) == 16 for device in devices)  # pp 4, dp 16 x tp 1
    short = run_cli("estimate", "llama-2-70b-3d", "--set", "parallel.tp=auto")
    assert short.code == 2 and "dp(2) * tp(1) * pp(4) * cp(1) = 8 != world size 64" in short.err
    bad = run_cli("estimate", "llama-2-70b-3d", "--set", "train.precision=auto")
    assert bad.code == 2 and "train.precision" in bad.err
