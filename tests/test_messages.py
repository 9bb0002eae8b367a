"""What a new user reads: a config.json where a job goes, preset names where a job goes, keys in
the wrong table, stage numbers as strings, every problem of a file at once, the ranks column,
an empty [model] table and an unstated GPU memory."""

from __future__ import annotations

import shutil

import pytest

from conftest import DATA, ROOT, run_cli
from shardplan.render.estimate import _ranks

LLAMA_CONFIG = DATA / "hf_configs" / "llama-3-8b.json"


# --- a Hugging Face config.json where a job file goes ------------------------------------

def test_config_json_is_planned_as_the_model(tmp_path, write):
    config = tmp_path / "config.json"
    shutil.copy(LLAMA_CONFIG, config)
    direct = run_cli("estimate", str(config), "--json")
    assert direct.code == 0, direct.err
    assert direct.err_lines[0] == (f"{config}: note: a Hugging Face config.json (llama): planned as the model of "
                                   "a job with default tables, as [model] hf_config = 'config.json' would")
    assert not any("unknown key" in line for line in direct.err_lines)
    # The same numbers as the job that names it.
    job = write("job.toml", '[model]\nhf_config = "config.json"\n')
    named = run_cli("estimate", job, "--json")
    assert direct.json["params"] == named.json["params"]
    assert direct.json["peak_gpu_bytes"] == named.json["peak_gpu_bytes"]


def test_config_json_path_is_the_one_given(tmp_path, monkeypatch):
    (tmp_path / "models").mkdir()
    shutil.copy(LLAMA_CONFIG, tmp_path / "models" / "config.json")
    monkeypatch.chdir(tmp_path)
    result = run_cli("validate", "models/config.json", "--set", "parallel.tp=3")
    assert result.code == 2
    assert result.err_lines[0].startswith("models/config.json: note: a Hugging Face config.json (llama)")
    assert "parallel.tp: 3 does not divide model.num_heads (32)" in result.err


def test_an_unsupported_config_json_says_what_it_was_read_as(write):
    config = write("config.json", '{"model_type": "bert", "hidden_size": 8}')
    result = run_cli("estimate", config)
    assert result.code == 2
    assert "note: a Hugging Face config.json (bert)" in result.err_lines[0]
    assert "model_type: 'bert' is not supported" in result.err_lines[1]


@pytest.mark.parametrize("value, message", [
    ("5", "model_type: 5 is not supported"),
    ('["llama"]', "model_type: ['llama'] is not supported"),
    ("null", "model_type: required"),
])
def test_a_config_json_with_an_odd_model_type_is_still_a_config(write, value, message):
    """A config.json whose model_type is no string was read as a job (every key unknown);
    the key marks a config whatever its value, and the value is what is said wrong."""
    config = write("config.json", f'{{"model_type": {value}, "hidden_size": 8}}')
    result = run_cli("validate", config)
    assert result.code == 2 and "note: a Hugging Face config.json" in result.err_lines[0], result.err
    assert message in result.err_lines[1] and "unknown key" not in result.err


def test_a_json_job_is_not_taken_for_a_config(write):
    job = write("job.json", '{"parallel": {"dp": 2}, "model_type": "llama"}')
    result = run_cli("validate", job)
    assert result.code == 2 and "model_type: unknown key" in result.err and "note:" not in result.err


# --- preset names where a job goes -------------------------------------------------------

@pytest.mark.parametrize("name, hint", [
    ("llama-3-8b", "llama-3-8b: no such file or job preset; llama-3-8b is a model preset: give it as "
                   "--set model.preset=llama-3-8b"),
    ("h100-80gb", "h100-80gb: no such file or job preset; h100-80gb is a cluster preset: give it as "
                  "--set cluster.preset=h100-80gb"),
    ("llama-3-8b-h10", "llama-3-8b-h10: no such file or job preset (did you mean 'llama-3-8b-h100'?)"),
    ("qwerty", "qwerty: no such file or job preset (see `shardplan presets`)"),
])
def test_a_name_that_is_no_job(name, hint):
    result = run_cli("estimate", name)
    assert (result.code, result.err_lines) == (2, [hint])


def test_the_hint_works():
    assert run_cli("estimate", "--set", "model.preset=llama-3-8b").code == 0


# --- keys in the wrong table -------------------------------------------------------------

@pytest.mark.parametrize("text, line", [
    ("[train]\nmicro_batch_size = 2\n", "train.micro_batch_size: unknown key (it belongs in [parallel]: "
                                        "parallel.micro_batch_size)"),
    ("micro_batch_size = 2\n", "micro_batch_size: unknown key (it belongs in [parallel]: parallel.micro_batch_size)"),
    ("[parallel]\nseq_len = 4096\n", "parallel.seq_len: unknown key (it belongs in [train]: train.seq_len)"),
    ("[offload]\nstage = 3\n", "offload.stage: unknown key (it belongs in [zero]: zero.stage)"),
    ("[train]\nmicro_batch = 2\n", "train.micro_batch: unknown key (did you mean 'parallel.micro_batch_size'?)"),
    # A misspelling in its own table keeps its own hint.
    ("[parallel]\nsequence_paralel = true\n", "parallel.sequence_paralel: unknown key (did you mean "
                                              "'sequence_parallel'?)"),
])
def test_a_key_in_the_wrong_table_names_its_table(text, line, write):
    path = write("job.toml", text)
    result = run_cli("validate", path)
    assert result.code == 2
    assert result.err_lines[0].endswith(line), result.err


def test_a_key_set_in_the_wrong_table():
    result = run_cli("validate", "llama-3-8b-h100", "--set", "train.micro_batch_size=2")
    assert result.err_lines == ["--set: train.micro_batch_size: unknown key (it belongs in [parallel]: "
                                "parallel.micro_batch_size)"]


# --- zero.stage as a string --------------------------------------------------------------

@pytest.mark.parametrize("stage", ["0", "1", "2", "3", " 3 "])
def test_stage_numbers_as_strings(stage, write):
    quoted = run_cli("estimate", write("q.toml", f'[model]\npreset = "gpt2"\n[zero]\nstage = "{stage}"\n'), "--json")
    number = run_cli("estimate", write("n.toml", f'[model]\npreset = "gpt2"\n[zero]\nstage = {stage.strip()}\n'),
                     "--json")
    assert quoted.code == number.code == 0, quoted.err
    assert quoted.json == number.json


def test_an_unknown_stage_name_says_what_to_write(write):
    job = write("job.toml", '[zero]\nstage = "full"\n')
    result = run_cli("validate", job)
    assert result.err_lines == [
        f"{job}:2: zero.stage: unknown sharding 'full': write a stage number, stage = 0, 1, 2 or 3, or an FSDP "
        "name: 'no_shard', 'shard_grad_op', 'full_shard', 'hybrid_shard', '_hybrid_shard_zero2'"]


# --- every problem of a file at once -----------------------------------------------------

def test_a_model_problem_hides_nothing(write):
    job = write("job.toml", '[model]\npreset = "llama-3-9b"\n\n[parallel]\ndp = 2\ntp = 3\npp = 4\n'
                            'num_microbatches = 2\n\n[offload]\nparams = true\n')
    result = run_cli("validate", job, "--world", "16")
    assert result.code == 2
    paths = [line.split(": ")[1] for line in result.err_lines]
    assert paths == ["model.preset", "parallel", "parallel.num_microbatches", "offload.params"], result.err
    assert "did you mean 'llama-3-8b'" in result.err_lines[0]


def test_a_broken_config_json_hides_nothing(write):
    write("config.json", '{"model_type": "llama"}')
    job = write("job.toml", '[model]\nhf_config = "config.json"\n[parallel]\ndp = 2\ntp = 4\n')
    result = run_cli("validate", job, "--world", "6")
    assert "num_hidden_layers: required" in result.err
    assert "dp(2) * tp(4) * pp(1) * cp(1) = 8 != world size 6 (from --world)" in result.err


def test_an_unknown_cluster_preset_and_model_together(write):
    job = write("job.toml", '[cluster]\npreset = "h100"\n[model]\npreset = "llama-9b"\n')
    result = run_cli("validate", job)
    assert [line.split(": ")[1] for line in result.err_lines] == ["cluster.preset", "model.preset"]


@pytest.mark.parametrize("other, path", [
    ('[train]\nprecision = "xx"\n', "train.precision"),  # a value the tables reject
    ("[parallel]\ndpp = 1\n", "parallel.dpp"),  # an unknown key
])
def test_an_unknown_model_preset_is_listed_with_invalid_tables(write, other, path):
    """A preset that cannot be found hides nothing, and is not hidden by a table that does not
    validate (README: "it is listed with the rest")."""
    job = write("job.toml", '[model]\npreset = "llama-3-8bb"\n' + other)
    result = run_cli("validate", job)
    assert result.code == 2
    assert [line.split(": ")[1] for line in result.err_lines] == ["model.preset", path]
    assert "did you mean 'llama-3-8b'?" in result.err_lines[0]


# --- the ranks column --------------------------------------------------------------------

@pytest.mark.parametrize("ranks, shown", [
    ([0], "0"), ([0, 1], "0-1"), (list(range(8)), "0-7"), (list(range(8, 16)), "8-15"), ([0, 8], "0,8"),
    ([0, 1, 2, 3, 8, 9, 10, 11], "0-3,8-11"), ([0, 4, 8], "0,4,8"), (list(range(0, 64, 4)), "0,4,..,60"),
])
def test_ranks_are_always_ranks(ranks, shown):
    assert _ranks(ranks) == shown


def test_the_estimate_table_shows_ranks_on_every_row():
    result = run_cli("estimate", "llama-2-70b-3d")  # pp 4 x 16 ranks a stage (presets/jobs)
    rows = [line.split() for line in result.out.splitlines()[2:6]]
    assert [row[:2] for row in rows] == [["0", "0-15"], ["1", "16-31"], ["2", "32-47"], ["3", "48-63"]]


# --- an empty [model] table, an unstated GPU memory --------------------------------------

def test_an_empty_model_table_is_warned_about(write):
    job = write("job.toml", "[model]\n[parallel]\ndp = 2\n")
    result = run_cli("validate", job)
    assert result.code == 0
    assert result.err_lines == [f"{job}:1: warning: model: the table names no model, so nothing model-dependent "
                                "is checked (give preset, hf_config, params, or an inline shape with family)"]
    assert run_cli("validate", write("none.toml", "[parallel]\ndp = 2\n")).err == ""  # no table: no claim


def test_the_fit_is_checked_only_against_a_stated_gpu_memory(write):
    unstated = run_cli("estimate", write("a.toml", '[model]\npreset = "gpt2"\n'), "--json").json
    assert unstated["fits"] is None and unstated["gpu_memory"] is None
    text = run_cli("estimate", write("b.toml", '[model]\npreset = "gpt2"\n')).out
    assert "(no GPU memory stated: set cluster.gpu_memory or [cluster] preset to check the fit)" in text
    stated = run_cli("estimate", write("c.toml", '[model]\npreset = "gpt2"\n[cluster]\ngpu_memory = "80GiB"\n'),
                     "--json").json
    assert stated["fits"] is True and stated["gpu_memory"] == 80 * 2**30


def test_a_budget_is_not_checked_against_an_unstated_gpu_memory(write):
    # 90 GiB of parameters on the GPU: no GPU memory stated, nothing to exceed.
    assert run_cli("validate", write("a.toml", '[offload]\ngpu_param_budget = "90GiB"\n')).code == 0
    stated = run_cli("validate", write("b.toml", '[offload]\ngpu_param_budget = "90GiB"\n'
                                                 '[cluster]\ngpu_memory = "80GiB"\n'))
    assert stated.code == 2 and "exceeds cluster.gpu_memory (80.00 GiB)" in stated.err


def test_the_docs_state_no_gpu_memory_default():
    row = next(line for line in (ROOT / "docs" / "job-file.md").read_text().splitlines()
               if line.startswith("| `gpu_memory`"))
    assert "80GiB" not in row and "checked only when given" in row


# --- overrides that contradict each other -------------------------------------------------

def test_two_model_sources_are_refused():
    message = "--set: two model sources on the command line (--params 7B, --set model.preset=gpt2): give one of them"
    result = run_cli("validate", "llama-3-8b-h100", "--params", "7B", "--set", "model.preset=gpt2")
    assert result.code == 2 and result.err_lines == [message]
    assert run_cli("validate", "llama-3-8b-h100", "--params", "7B", "--set", "model.preset=gpt2",
                   "--json").json["error"]["problems"][0]["path"] == "--set"


def test_a_set_over_a_shortcut_wins_and_says_so():
    """The planner's "to fit" suggestions are --set flags appended to the command (docs/plan.md):
    one that changes a shortcut's key wins, with a warning, and a problem with its value is
    the --set's."""
    result = run_cli("estimate", "llama-3-8b-h100", "--dp", "4", "--set", "parallel.dp=8", "--json")
    assert result.code == 0 and result.json["devices"][0]["ranks"] == list(range(8))
    assert "warning: --set: parallel.dp=8 overrides --dp 4" in result.err_lines
    bad = run_cli("validate", "llama-3-8b-h100", "--dp", "4", "--set", "parallel.dp=0")
    assert bad.code == 2 and any(line.startswith("--set: parallel.dp: must be >= 1") for line in bad.err_lines)


def test_agreeing_overrides_and_a_repeated_set_are_taken():
    assert run_cli("validate", "llama-3-8b-h100", "--dp", "8", "--set", "parallel.dp=8").code == 0
    # Of two --set of one key the later wins (the README).
    result = run_cli("estimate", "llama-3-8b-h100", "--set", "train.seq_len=2048", "--set", "train.seq_len=4096",
                     "--json")
    assert result.code == 0 and result.json["assumptions"]["seq_len"] == 4096


# --- hints ------------------------------------------------------------------------------

@pytest.mark.parametrize("setting, message", [
    ("train.precision=BF16-mixed", "(did you mean 'bf16-mixed'?)"),  # case does not count
    ("cluster.gpu=h100", "(did you mean 'h100-pcie' or 'h100-sxm'?)"),  # presets/gpus: the names it starts
    # A name of a known family (the word before the first '-') is matched within the family:
    # 'h100-80gb' was taken for 'a100-sxm-80gb' by spelling alone.
    ("cluster.gpu=h100-sxm-80gb", "(did you mean 'h100-sxm'?)"),
    ("cluster.gpu=h100-80gb", "(did you mean 'h100-sxm'?)"),
    ("cluster.gpu=a100-80gb", "(did you mean 'a100-sxm-80gb'?)"),
    ("model.preset=mistral-7b-v0.3", "(did you mean 'mistral-7b'?)"),
    ("parallel.tpp=2", "(did you mean 'tp'?)"),
    ("train.lr=nan", "train.lr: must be a number (got nan)"),
])
def test_hints_point_at_what_was_meant(setting, message):
    result = run_cli("validate", "llama-3-8b-h100", "--set", setting)
    assert result.code == 2 and len(result.err_lines) == 1 and result.err_lines[0].endswith(message), result.err


def test_plan_without_a_model_says_so():
    result = run_cli("plan", "--gpus", "8")
    assert result.code == 2
    assert result.err_lines == ["model: plan needs the model's architecture (a preset, hf_config or inline shape), "
                                "and the job names no model"]


def test_values_are_quoted_as_the_job_file_writes_them():
    result = run_cli("validate", "llama-3-8b-h100", "--set", "parallel.dp=true")
    assert result.code == 2 and result.err_lines[0].endswith("got a boolean true")


def test_bf16_on_a_gpu_without_it_is_warned_about():
    """Volta has no bf16 (NVIDIA Tesla V100 datasheet: fp16 tensor cores): a warning, not a
    refusal (the memory estimate holds either way); fp16 is quiet."""
    bf16 = run_cli("validate", "llama-3-8b-h100", "--set", "cluster.gpu=v100-sxm2-32gb")
    assert bf16.code == 0 and any("v100-sxm2-32gb has no bf16" in line for line in bf16.err_lines)
    fp16 = run_cli("validate", "llama-3-8b-h100", "--set", "cluster.gpu=v100-sxm2-32gb",
                   "--set", "train.precision=fp16-mixed")
    assert not any("no bf16" in line for line in fp16.err_lines)


def test_a_problem_with_an_implied_key_names_where_it_was_given(write):
    """`zero.stage = "hybrid_shard"` sets zero.hybrid (FSDP's HYBRID_SHARD, spec/job.py): a
    warning about hybrid sharding points at the stage's line, or at the --set that gave it."""
    job = write("hy.toml", '[model]\npreset = "tiny-gpt2"\n[parallel]\ndp = 2\n\n[zero]\nstage = "hybrid_shard"\n')
    warning = "warning: zero.hybrid: on a single node hybrid sharding is the same as sharding over dp"
    assert f"{job}:7: {warning}" in run_cli("validate", job).err_lines
    flagged = run_cli("validate", "llama-3-8b-h100", "--set", "zero.stage=hybrid_shard")
    assert flagged.code == 0 and f"--set: {warning}" in flagged.err_lines
    written = write("hy2.toml", '[model]\npreset = "tiny-gpt2"\n[parallel]\ndp = 2\n[zero]\nstage = 3\nhybrid = true\n')
    assert f"{written}:7: {warning}" in run_cli("validate", written).err_lines
