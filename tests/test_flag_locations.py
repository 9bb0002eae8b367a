"""A problem whose value came from a command-line flag is placed at that flag, not at the job
file's line (CONTRACT: "file": null and the flag). A rule across keys (dp * tp * pp * cp against
the world, the global batch) goes to a flag when any value it checks came from one, and stays
at the file's line when all came from the file."""

from __future__ import annotations

import json

import pytest

from conftest import ROOT, run_cli

JOB = "llama-3-8b-h100"  # presets/jobs/llama-3-8b-h100.toml: dp = 8 at line 7, 1 node of 8 GPUs
JOB_FILE = str(ROOT / "presets" / "jobs" / "llama-3-8b-h100.toml")
WORLD = "dp({}) * tp(1) * pp(1) * cp(1) = {} != world size {} (from cluster: {}); dp = {} would fit"


def errors(result) -> list[str]:
    return [line for line in result.err_lines if ": warning: " not in line]


def only_problem(result) -> dict:
    assert result.code == 2, result.err
    problems = result.json["error"]["problems"]
    assert len(problems) == 1, problems
    return problems[0]


@pytest.mark.parametrize("args, flag, message", [
    (["--dp", "16"], "--dp 16", WORLD.format(16, 16, 8, "1 node * 8 GPUs", 8)),
    (["--set", "parallel.dp=16"], "--set", WORLD.format(16, 16, 8, "1 node * 8 GPUs", 8)),
    (["--gpus-per-node", "3"], "--gpus-per-node 3", WORLD.format(8, 8, 3, "1 node * 3 GPUs", 3)),
    (["--set", "cluster.nodes=2"], "--set", WORLD.format(8, 8, 16, "2 nodes * 8 GPUs", 16)),
    # The later of two --set of one key is the value checked: still a flag's, not the file's.
    (["--set", "parallel.dp=8", "--set", "parallel.dp=4"], "--set", WORLD.format(4, 4, 8, "1 node * 8 GPUs", 8)),
], ids=["dp", "set-dp", "gpus-per-node", "set-nodes", "set-twice"])
def test_world_mismatch_from_a_flag_is_at_the_flag(args, flag, message):
    text = run_cli("estimate", JOB, *args)
    assert text.code == 2
    assert errors(text) == [f"{flag}: parallel: {message}"], text.err
    problem = only_problem(run_cli("estimate", JOB, *args, "--json"))
    assert problem["file"] is None and problem["line"] is None, problem
    assert problem["flag"] == flag and problem["path"] == "parallel" and problem["message"] == message


def test_import_with_world_and_dp_flags_is_at_the_dp_flag(write):
    """docs/interop.md: a DeepSpeed config names no world size; --world and --dp give it. Both
    are flags: the problem goes to --dp, whose value the hint (`dp = 8 would fit`) changes."""
    config = write("ds.json", json.dumps({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
                                          "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}))
    message = "dp(4) * tp(1) * pp(1) * cp(1) = 4 != world size 8 (from --world); dp = 8 would fit"
    text = run_cli("import", config, "--world", "8", "--dp", "4")
    assert text.code == 2
    assert errors(text) == [f"--dp 4: parallel: {message}"], text.err
    problem = only_problem(run_cli("import", config, "--world", "8", "--dp", "4", "--json"))
    assert (problem["file"], problem["line"], problem["flag"], problem["message"]) == (None, None, "--dp 4", message)


def test_world_flag_against_the_files_degrees_stays_at_the_file(write):
    """`--world` sets no plan key: it states the machine the plan must fill (as torchrun's
    WORLD_SIZE does), so degrees the file writes that miss it are reported at the file's
    `[parallel]` line, the message naming --world (README's validate example)."""
    job = write("job.toml", "[parallel]\ndp = 2\ntp = 4\n")
    text = run_cli("validate", job, "--world", "12")
    assert errors(text) == [f"{job}:1: parallel: dp(2) * tp(4) * pp(1) * cp(1) = 8 != world size 12 (from --world); "
                            "dp = 3 would fit"], text.err
    problem = only_problem(run_cli("validate", job, "--world", "12", "--json"))
    assert (problem["file"], problem["line"], problem.get("flag")) == (job, 1, None)


def test_other_rules_across_keys_go_to_the_flag(write):
    """The global batch the file gives against a --dp; the file's rank order against a --tp."""
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 2\norder = "dp-pp"\n'
                            "[train]\nglobal_batch_size = 2\n")
    assert run_cli("validate", job).code == 0
    batch = run_cli("validate", job, "--dp", "4", "--json")
    assert errors(batch) == ["--dp 4: train.global_batch_size: 2 != dp (4) * micro_batch_size (1) * "
                             "num_microbatches (1) = 4"], batch.err
    problem = only_problem(batch)
    assert (problem["file"], problem["line"], problem["flag"]) == (None, None, "--dp 4")
    order = run_cli("validate", job, "--tp", "2", "--json")
    assert errors(order) == ["--tp 2: parallel.order: 'dp-pp' leaves out tp, whose degree is 2"], order.err
    assert only_problem(order)["flag"] == "--tp 2"


def test_values_from_the_file_stay_at_the_files_line(write):
    """All the values a rule checks are the file's: its file and line, also when a flag sets a
    key the rule does not check (here of the same table, which the file does not write)."""
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 16\n[cluster]\nnodes = 1\n')
    message = "dp(16) * tp(1) * pp(1) * cp(1) = 16 != world size 8 (from cluster: 1 node * 8 GPUs); dp = 8 would fit"
    for args in ([], ["--set", "parallel.micro_batch_size=2"], ["--zero", "3"]):
        text = run_cli("validate", job, *args)
        assert errors(text) == [f"{job}:3: parallel: {message}"], (args, text.err)
        problem = only_problem(run_cli("validate", job, *args, "--json"))
        assert (problem["file"], problem["line"], problem["path"]) == (job, 3, "parallel") and "flag" not in problem
    # No [parallel] table: the line of the cluster key the rule checks, not the flag's.
    bare = write("bare.toml", '[model]\npreset = "llama-3-8b"\n[cluster]\nnodes = 2\n')
    result = run_cli("validate", bare, "--set", "parallel.micro_batch_size=2", "--json")
    problem = only_problem(result)
    assert (problem["file"], problem["line"], problem["path"]) == (bare, 4, "parallel") and "flag" not in problem
    assert errors(result)[0].startswith(f"{bare}:4: parallel: dp(1) * tp(1) * pp(1) * cp(1) = 1 != world size 16")
