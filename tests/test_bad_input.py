"""A corpus of malformed inputs: every one gives exit 2 and one clear line per problem.

CONTRACT, exit codes: bad input never prints a traceback; stderr names the file (and line
where known) and the dotted field path.
"""

from __future__ import annotations

import pytest

from conftest import run_cli

# (name, file text or bytes, extra flags, text the first error line must contain)
FILE_CASES = [
    ("broken_toml", "[parallel\ndp = 2\n", [], "invalid TOML"),
    ("unclosed_string", '[model]\npreset = "llama-3-8b\n', [], "invalid TOML"),
    ("duplicate_key", "[parallel]\ndp = 2\ndp = 3\n", [], "invalid TOML"),
    ("string_degree", '[parallel]\ndp = "two"\n', [], "parallel.dp: expected an integer"),
    ("float_degree", "[parallel]\ndp = 2.5\n", [], "parallel.dp: expected an integer"),
    ("bool_degree", "[parallel]\ntp = true\n", [], "parallel.tp: expected an integer"),
    ("zero_degree", "[parallel]\ndp = 0\n", [], "parallel.dp: must be >= 1"),
    ("negative_degree", "[parallel]\ntp = -4\n", [], "parallel.tp: must be >= 1"),
    ("huge_degree", "[parallel]\ndp = 9223372036854775807\n", [], "parallel.dp: must be <="),
    ("too_big_integer", "[parallel]\ndp = 99999999999999999999\n", [], "parallel.dp: must be <="),
    ("unknown_key", "[parallel]\nsequence_paralel = true\n", [], "did you mean 'sequence_parallel'"),
    ("unknown_table", "[paralel]\ndp = 2\n", [], "did you mean 'parallel'"),
    ("table_not_table", "parallel = 3\n", [], "parallel: expected a table"),
    ("array_stage", "[zero]\nstage = [1]\n", [], "zero.stage"),
    ("bad_stage_name", '[zero]\nstage = "full_shrd"\n', [], "zero.stage: unknown sharding"),
    ("stage_too_high", "[zero]\nstage = 4\n", [], "zero.stage: must be <= 3"),
    ("absurd_size", '[cluster]\ngpu_memory = "1e400GiB"\n', [], "cluster.gpu_memory"),
    ("bad_size_unit", '[cluster]\ngpu_memory = "80 gigs"\n', [], "cluster.gpu_memory"),
    ("negative_size", "[cluster]\ngpu_memory = -5\n", [], "cluster.gpu_memory"),
    ("bad_schedule", '[parallel]\npipeline_schedule = "1f1f"\n', [], "did you mean '1f1b'"),
    ("bad_order", '[parallel]\norder = "tp-tp"\n', [], "parallel.order: axis 'tp' appears twice"),
    ("unknown_axis", '[parallel]\norder = "tp-ep-dp"\n', [], "parallel.order: unknown axis 'ep'"),
    ("zero_seq", "[train]\nseq_len = 0\n", [], "train.seq_len: must be >= 1"),
    ("negative_lr", "[train]\nlr = -1.0\n", [], "train.lr: must be > 0"),
    ("nan_lr", "[train]\nlr = nan\n", [], "train.lr"),
    ("dropout_one", "[model]\ndropout = 1.0\n", [], "model.dropout: must be < 1"),
    ("two_sources", '[model]\npreset = "gpt2"\nnum_layers = 3\n', [], "exactly one of"),
    ("unknown_preset", '[model]\npreset = "llama-9b"\n', [], "model.preset: no model preset named 'llama-9b'"),
    ("empty_preset", '[model]\npreset = ""\n', [], "model.preset"),
    ("unknown_cluster", '[cluster]\npreset = "h100"\n', [], "cluster.preset: no cluster preset named 'h100'"),
    ("inline_missing", '[model]\nfamily = "llama"\nnum_layers = 2\n', [], "model.hidden_size: required"),
    ("inline_no_family", "[model]\nnum_layers = 2\n", [], "model.family: required"),
    ("bad_family", '[model]\nfamily = "bert"\n', [], "model.family: must be one of"),
    ("missing_hf_config", '[model]\nhf_config = "nope.json"\n', [], "model.hf_config: 'nope.json': no such file"),
    ("missing_data", '[data]\npath = "tokens.bin"\n', [], "data.path: 'tokens.bin': no such file"),
    ("json_in_toml_name", '{"parallel": {"dp": 2}}', [], "invalid TOML"),
    ("binary_garbage", bytes(range(256)) * 8, [], "binary file"),
    ("not_utf8", b"[model]\npreset = \"\xff\xfe\"\n", [], "not UTF-8"),
    ("bad_world_flag", "", ["--world", "0"], "--world"),
    ("world_mismatch", "[parallel]\ndp = 2\ntp = 4\n", ["--world", "12"], "!= world size 12"),
    ("set_without_equals", "", ["--set", "parallel.dp"], "--set"),
    ("set_deep_key", "", ["--set", "a.b.c=1"], "--set"),
    ("set_unknown_key", "", ["--set", "parallel.micro_batch=2"], "--set: parallel.micro_batch: unknown key (did you mean 'micro_batch_size'?)"),
    ("set_bad_value", "", ["--set", "train.seq_len=abc"], "train.seq_len: expected an integer"),
    ("dp_flag_zero", "", ["--dp", "0"], "parallel.dp: must be >= 1"),
    ("dp_flag_text", "", ["--dp", "abc"], "--dp"),
    ("zero_flag_bad", "", ["--zero", "7"], "zero.stage: must be <= 3"),
    ("framework_flag_bad", "", ["--framework", "megatron"], "zero.framework: must be one of"),
    ("params_flag_bad", "", ["--params", "7.5Q"], "model.params"),
    ("unknown_flag", "", ["--dpp", "2"], "No such option"),
]

JSON_CASES = [
    ("broken_json", "{", "invalid JSON"),
    ("json_array", "[1, 2]", "JSON object"),
    ("json_bad_type", '{"parallel": {"dp": "2"}}', "parallel.dp: expected an integer"),
    ("json_huge_int", '{"parallel": {"dp": 100000000000000000000000000000}}', "parallel.dp: must be <="),
    ("json_deep", "[" * 100000 + "]" * 100000, "JSON"),
]

HF_CASES = [
    ("hf_unsupported", '{"model_type": "bert", "hidden_size": 8}', "model_type: 'bert' is not supported"),
    ("hf_bad_type", '{"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2, '
     '"num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 10}', "hidden_size: expected a positive integer"),
    ("hf_missing", '{"model_type": "llama"}', "num_hidden_layers: required"),
    ("hf_not_json", "model_type = 'llama'", "invalid JSON"),
]

# Commands that read a job file and flags; extended as commands land.
JOB_COMMANDS = [["validate"]]


def _check(result, needle):
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err
    assert result.err_lines, "no message on stderr"
    assert any(needle in line for line in result.err_lines), result.err


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("name, text, flags, needle", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_file_corpus(command, name, text, flags, needle, write):
    path = write("job.toml", text)
    result = run_cli(*command, path, *flags)
    _check(result, needle)
    if "--" not in needle and not any(f.startswith("--") for f in flags):
        assert all(line.startswith(path) for line in result.err_lines if "warning" not in line), result.err


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("name, text, needle", JSON_CASES, ids=[c[0] for c in JSON_CASES])
def test_json_corpus(command, name, text, needle, write):
    _check(run_cli(*command, write("job.json", text)), needle)


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
@pytest.mark.parametrize("name, text, needle", HF_CASES, ids=[c[0] for c in HF_CASES])
def test_hf_config_corpus(command, name, text, needle, write):
    write("config.json", text)
    job = write("job.toml", '[model]\nhf_config = "config.json"\n')
    _check(run_cli(*command, job), needle)


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
def test_missing_file(command, tmp_path):
    _check(run_cli(*command, str(tmp_path / "nope.toml")), "no such file")


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
def test_directory(command, tmp_path):
    (tmp_path / "job.toml").mkdir()
    _check(run_cli(*command, str(tmp_path / "job.toml")), "is a directory")


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
def test_unknown_job_name(command):
    _check(run_cli(*command, "llama-3-8b-h10"), "no such file or job preset")


@pytest.mark.parametrize("command", JOB_COMMANDS, ids=lambda c: c[0])
def test_bad_world_size_env(command, write):
    _check(run_cli(*command, write("job.toml", ""), env={"WORLD_SIZE": "abc"}), "WORLD_SIZE")


def test_unknown_command():
    _check(run_cli("estimat"), "No such command")


def test_unknown_preset_name():
    _check(run_cli("presets", "llama-3-9b"), "no preset named 'llama-3-9b'")
