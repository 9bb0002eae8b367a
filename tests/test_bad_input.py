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
    ("duplicate_key", "[parallel]\ndp = 2\ndp = 3\n", [], ":3: parallel.dp: given twice (lines 2 and 3)"),
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
    # DeepSpeed 0.19.8 deepspeed/runtime/zero/config.py: `reduce_bucket_size: int = Field(pp_int(5e8), gt=0)`.
    ("empty_reduce_bucket", "[zero]\nreduce_bucket_size = 0\n", [], "zero.reduce_bucket_size: must be >= 1 (got 0)"),
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
    # tomllib parses nested arrays recursively: RecursionError, not TOMLDecodeError
    ("toml_deep", "x = " + "[" * 100000, [], "invalid TOML: nested too deeply"),
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
    ("world_too_big", "[parallel]\ndp = 1048576\ntp = 2\n", [], "exceeds the largest supported world (1048576)"),
    ("zero_gpu_memory", "[cluster]\ngpu_memory = 0\n", [], "cluster.gpu_memory: must be > 0"),
    # A bare number is bytes (CONTRACT); one no device is that small is a unit left out.
    ("bare_gpu_memory", "[cluster]\ngpu_memory = 24\n", [],
     "cluster.gpu_memory: 24 is read as 24 bytes (a bare number is bytes), less than any device has: "
     "write '24GiB' if gibibytes were meant"),
    ("bare_host_memory", "", ["--set", "cluster.cpu_memory_per_node=512"], "write '512GiB' if gibibytes were meant"),
    ("fractional_size", '[cluster]\ngpu_memory = "1.5B"\n', [], "is not a whole number of bytes"),
    ("fractional_count", '[model]\nparams = "1.5"\n', [], "is not a whole number of elements"),
    ("hybrid_contradiction", '[zero]\nstage = "hybrid_shard"\nhybrid = false\n', [],
     "stage 'hybrid_shard' is hybrid sharding, but hybrid = false"),
    ("too_many_layers", '[model]\nfamily = "gpt2"\nnum_layers = 200000\nhidden_size = 64\nnum_heads = 4\n'
     'vocab_size = 100\nmax_seq_len = 64\n', [], "model.num_layers: must be <= 100000"),
    ("empty_hf_config", '[model]\nhf_config = ""\n', [], "model.hf_config: names no file"),
    ("zero_params", "[model]\nparams = 0\n", [], "model.params: a model of 0 parameters"),
]

JSON_CASES = [
    ("broken_json", "{", "invalid JSON"),
    ("json_array", "[1, 2]", "JSON object"),
    ("json_bad_type", '{"parallel": {"dp": "2"}}', "parallel.dp: expected an integer"),
    ("json_huge_int", '{"parallel": {"dp": 100000000000000000000000000000}}', "parallel.dp: must be <="),
    ("json_deep", "[" * 100000 + "]" * 100000, "JSON"),
    ("json_null", '{"parallel": {"tp": null}}', "parallel.tp: expected an integer, got null"),
    # JSON's \ud800 escape leaves half of a UTF-16 pair, which no output can print.
    ("json_lone_surrogate", '{"model": {"preset": "gpt2", "name": "\\ud800x"}}',
     'model.name: not valid Unicode: JSON\'s escape leaves an unpaired surrogate in "\\ud800x"'),
    ("json_lone_surrogate_key", '{"model": {"preset": "gpt2", "\\udc00k": 1}}', "model: a key is not valid Unicode"),
]

HF_CASES = [
    ("hf_unsupported", '{"model_type": "bert", "hidden_size": 8}', "model_type: 'bert' is not supported"),
    ("hf_bad_type", '{"model_type": "llama", "hidden_size": "big", "num_hidden_layers": 2, '
     '"num_attention_heads": 2, "intermediate_size": 8, "vocab_size": 10}', "hidden_size: expected a positive integer"),
    ("hf_missing", '{"model_type": "llama"}', "num_hidden_layers: required"),
    ("hf_not_json", "model_type = 'llama'", "invalid JSON"),
    ("hf_no_architecture", '{"architectures": []}', "model_type: required (supported: gpt2"),
    ("hf_architecture_not_a_name", '{"model_type": "llama", "architectures": [5]}',
     "architectures: expected a list of model class names (strings), got [5]"),
    # Bounds of a shape written in the job file apply to a config.json too, named by its keys.
    ("hf_zero_layers", '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 0, '
     '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}', "num_hidden_layers: expected a positive"),
    ("hf_too_deep", '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 200000, '
     '"num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100}', "num_hidden_layers: must be <= 100000"),
]

# Commands that read a job file and the plan flags.
JOB_COMMANDS = [["validate"], ["layout"], ["estimate"], ["shards"], ["run"]]
# Commands for which a missing data file is an error (elsewhere it is a warning).
CHECKS_PATHS = ("validate", "run")


def _corpus_pairs() -> list:
    """(command, case) of the file corpus, without the pairs where the case is no error: a
    missing data file only warns when nothing will read it, and shards' --world is the shard
    group's size, run's world is torchrun's."""
    pairs = []
    for command in JOB_COMMANDS:
        for case in FILE_CASES:
            if case[0] == "missing_data" and command[0] not in CHECKS_PATHS:
                continue
            if case[0] == "world_mismatch" and command[0] in ("shards", "run"):
                continue
            pairs.append(pytest.param(command, *case, id=f"{case[0]}-{command[0]}"))
    return pairs


def _check(result, needle):
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err
    assert result.err_lines, "no message on stderr"
    assert any(needle in line for line in result.err_lines), result.err


@pytest.mark.parametrize("command, name, text, flags, needle", _corpus_pairs())
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


# Commands with their own arguments: (argv, text the error line must contain).
OWN_ARGUMENT_CASES = [
    (["schedule", "--pp", "4", "--microbatches", "3", "--schedule", "1f1b"], "--microbatches: 1f1b needs at least pp (4) microbatches"),
    (["schedule", "--pp", "4", "--microbatches", "2", "--schedule", "zero-bubble"], "--microbatches: zero-bubble needs at least pp (4) microbatches"),
    (["schedule", "--pp", "4", "--microbatches", "9", "--schedule", "interleaved-1f1b", "--virtual", "2"], "--microbatches: interleaved-1f1b needs microbatches divisible by pp (4) or by its max(1, m // pp) = 2 rounds (got 9)"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--virtual", "2"], "--virtual: 2 chunks per rank need interleaved-1f1b or round-robin"),
    (["schedule", "--pp", "0", "--microbatches", "8", "--schedule", "gpipe"], "--pp: must be >= 1 (got 0)"),
    (["schedule", "--pp", "-4", "--microbatches", "8", "--schedule", "gpipe"], "--pp: must be >= 1 (got -4)"),
    (["schedule", "--pp", "9223372036854775807", "--microbatches", "8", "--schedule", "gpipe"], "--pp: must be <= 256"),
    (["schedule", "--pp", "4", "--microbatches", "99999999999999999999", "--schedule", "gpipe"], "--microbatches: must be <= 65536"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "round-robin", "--virtual", "0"], "--virtual: must be >= 1 (got 0)"),
    (["schedule", "--pp", "256", "--microbatches", "8192", "--schedule", "gpipe"], "(microbatch, stage) pairs exceed the 1048576"),
    (["schedule", "--pp", "64", "--microbatches", "2048", "--schedule", "gpipe"], "more than the 262144 shardplan draws"),
    (["schedule", "--pp", "two", "--microbatches", "8", "--schedule", "gpipe"], "--pp"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1f"], "--schedule: unknown schedule '1f1f' (did you mean '1f1b'?"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--cost-w", "1"], "--cost-w: only zero-bubble splits the backward"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--cost-b", "0"], "--cost-b: must be >= 1 (got 0)"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--cost-f", "101"], "--cost-f: must be <= 100"),
    (["schedule", "--microbatches", "8", "--schedule", "1f1b"], "--pp: required (or give a job FILE that sets parallel.pp)"),
    (["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b", "--svg", "/nonexistent-dir/x.svg"], "--svg: cannot write"),
    (["schedule", "no-such-job.toml"], "no such file"),
    (["layout", "--rank", "16", "--dp", "16"], "rank 16 is out of range"),
    (["layout", "--order", "tp-tp"], "axis 'tp' appears twice"),
    (["layout", "--pp", "2", "--order", "tp-dp"], "leaves out pp"),
    (["layout", "--dp", "0"], "parallel.dp: must be >= 1"),
    (["layout", "--gpus-per-node", "0"], "cluster.gpus_per_node: must be >= 1"),
    (["shards", "--numel", "10", "--world", "0"], "--world"),
    (["shards", "--numel", "-1"], "--numel"),
    (["shards", "--numel", "10", "--style", "fsdp3"], "--style: unknown style"),
    (["shards", "--blocks", "4"], "--blocks: needs --assign"),
    (["shards", "--blocks", "4", "--assign", "random"], "--assign: unknown assignment"),
    (["shards", "--numel", "4", "--blocks", "2", "--assign", "contiguous"], "--numel: cannot be combined"),
    (["shards", "--world", "4"], "nothing to shard: no model"),
    (["shards", "--params", "7B"], "nothing to shard: a bare parameter count"),
    (["estimate"], "no model"),
    (["estimate", "--params", "7.5B", "--pp", "0"], "parallel.pp: must be >= 1"),
    (["run", "tiny-gpt2-cpu", "--nproc", "3"], "--nproc: 3 workers, but dp(2) * tp(1) * pp(1) * cp(1) = 2"),
    (["run", "tiny-gpt2-cpu", "--set", "parallel.cp=2", "--dp", "1"], "parallel.cp: context parallelism is not executed"),
    (["run", "tiny-gpt2-cpu", "--params", "1B"], "model: `run` needs an architecture"),
    (["run", "tiny-gpt2-cpu", "--set", "offload.grads=true"], "offload.grads: gradients on the CPU serve only"),
    (["estimate", "tiny-gpt2-cpu", "--set", "offload.grads=true"], "offload.grads: gradients on the CPU serve only"),
    (["run", "tiny-gpt2-cpu", "--set", "offload.optimizer=true", "--set", "train.optimizer=adamw8bit"],
     "offload.optimizer: the offload engine steps adamw and sgd"),
    # torchao's NF4 (torchao/dtypes/nf4tensor.py: blocks of 64, scaler blocks of 256): tiny-llama's
    # k_proj is 64 x 128 = 8,192 elements.
    (["run", "tiny-gpt2-cpu", "--set", "model.preset=tiny-llama", "--set", "lora.base_dtype=nf4", "--dp", "1",
      "--set", "cluster.gpus_per_node=1"],
     "lora.base_dtype: torchao stores a layer linear as NF4 only in whole blocks of 64 * 256 = 16,384 elements: "
     "attn.k_proj.weight has 8,192"),
    # An offload the strategy decides is checked as one the job writes (it reached the engine: KeyError).
    (["run", "tiny-gpt2-cpu", "--set", "train.optimizer=adamw8bit", "--set", "cluster.gpu_memory=4MiB",
      "--set", "offload.gpu_param_budget=1MiB"],
     "offload.strategy: the balanced offload strategy offloads the parameters to fit, but "
     "the offload engine steps adamw and sgd on the CPU, not adamw8bit"),
    (["run", "tiny-gpt2-cpu", "--set", "offload.overlap=false"], "offload.overlap: FSDP2 always prefetches"),
    (["run", "tiny-gpt2-cpu", "--set", "model.preset=mixtral-8x7b"], "model: `run` builds GPT-2 and Llama-style "
                                                                    "models, not mixture-of-experts layers"),
    (["presets", "llama-3-9b"], "no preset named 'llama-3-9b'"),
    (["run", "tiny-gpt2-cpu", "--resume"], "--resume: the job has no [checkpoint] dir to resume from"),
    # Paths `run` writes or reads are checked before torchrun starts, not after the training.
    (["run", "tiny-gpt2-cpu", "--report", "/nonexistent-dir/x.json"],
     "--report: cannot write '/nonexistent-dir/x.json': No such file or directory"),
    (["run", "tiny-gpt2-cpu", "--report", "."], "--report: cannot write '.': Is a directory"),
    (["run", "tiny-gpt2-cpu", "--report", "-"], "--report: '-' would write to stdout, which holds the run's output"),
    # A --resume path that is no checkpoint is refused before torchrun starts too, but with
    # docs/recovery.md's exit 3: tests/test_run_edges.py.
]


@pytest.mark.parametrize("argv, needle", OWN_ARGUMENT_CASES, ids=[" ".join(c[0])[:60] for c in OWN_ARGUMENT_CASES])
def test_own_argument_corpus(argv, needle):
    _check(run_cli(*argv), needle)


def test_run_refuses_a_report_it_cannot_create(tmp_path):
    import os

    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("this user writes into read-only folders (root)")
        _check(run_cli("run", "tiny-gpt2-cpu", "--report", str(folder / "r.json")), "Permission denied")
    finally:
        folder.chmod(0o755)


@pytest.mark.parametrize("text", ['{"architectures": []}', '{"model_type": null, "architectures": [5]}'])
def test_hf_config_given_as_the_job_with_bad_architectures(text, write):
    # A config.json given where a job is expected is read through its architectures too.
    result = run_cli("validate", write("f.json", text))
    _check(result, "model_type: required")
    assert "internal error" not in result.err and "(5)" not in result.err, result.err


@pytest.mark.parametrize("suffix, text", [("toml", "[parallel]\ndp = 2\n"), ("json", '{"parallel": {"dp": 2}}')])
def test_a_byte_order_mark_is_accepted(suffix, text, write):
    # Windows editors write UTF-8 with a BOM; tomllib and json reject it, shardplan drops it.
    path = write(f"job.{suffix}", b"\xef\xbb\xbf" + text.encode())
    result = run_cli("validate", path)
    assert result.code == 0, result.err
    assert "world 2 = dp 2" in result.out


def test_run_refuses_a_shared_norm_before_starting(write):
    # A Llama shape with Falcon's single shared norm: refused with exit 2 before any worker
    # starts (capabilities.unbuildable, the rule runtime/model.py also applies).
    job = write("shared.toml", '[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
                               'vocab_size = 128\nmax_seq_len = 64\nffn_hidden_size = 128\nshared_layer_norm = true\n')
    _check(run_cli("run", job), "not Falcon's parallel attention/MLP block")


# --- the same corpus with --json: stdout carries the CONTRACT's error document ---------

def _line(problem: dict) -> str:
    """An error of the error document written as its stderr line (spec/errors.py Problem)."""
    where = f"{problem['flag']}: " if problem.get("flag") else ""
    if problem["file"]:
        where = f"{problem['file']}:{problem['line']}: " if problem["line"] else f"{problem['file']}: "
    path = f"{problem['path']}: " if problem["path"] else ""
    return f"{where}{path}{problem['message']}"


def _check_json(argv: list[str], needle: str) -> None:
    result = run_cli(*argv, "--json")
    _check(result, needle)
    doc = result.json  # stdout is one JSON document and nothing else
    assert doc["schema_version"] == 1 and doc["error"]["exit_code"] == 2, doc
    problems = doc["error"]["problems"]
    # CONTRACT's four keys; a value from the command line names its flag instead of a file.
    assert problems and all(set(p) - {"flag"} == {"file", "line", "path", "message"} for p in problems), problems
    assert all(p["file"] is None for p in problems if "flag" in p), problems
    assert any(needle in _line(p) for p in problems), problems
    errors = [line for line in result.err_lines if "warning:" not in line and "note:" not in line]
    assert [_line(p) for p in problems] == errors or len(problems) == len(errors) == 1, (errors, problems)


@pytest.mark.parametrize("command, name, text, flags, needle", _corpus_pairs())
def test_file_corpus_json(command, name, text, flags, needle, write):
    _check_json([*command, write("job.toml", text), *flags], needle)


@pytest.mark.parametrize("argv, needle", OWN_ARGUMENT_CASES + [(["estimat"], "No such command")],
                         ids=[" ".join(c[0])[:60] for c in OWN_ARGUMENT_CASES] + ["estimat"])
def test_own_argument_corpus_json(argv, needle):
    _check_json(argv, needle)


@pytest.mark.parametrize("command", [["presets", "gpt2"], ["schema"], ["schedule", "--pp", "2", "--microbatches",
                                     "2", "--schedule", "gpipe"]], ids=lambda c: c[0])
def test_commands_without_a_job_give_the_error_document(command):
    _check_json([*command, "--no-such-flag"], "No such option: --no-such-flag")


def test_validate_warns_of_the_plan_keys_run_refuses():
    """The shipped llama-2-70b-3d (fsdp2 accounting, ZeRO-1 under tp 8) was valid without a
    word, and `run` then refused it. `validate` now says what `run` refuses of an fsdp2 job's
    plan, at the key's line, in `run`'s own words (runtime/capabilities.py); a job written for
    DeepSpeed is not meant for `run`, and a model `run` does not build is no plan to change."""
    result = run_cli("validate", "llama-2-70b-3d")
    assert result.code == 0, result.err
    (line,) = result.err_lines
    refused = run_cli("run", "llama-2-70b-3d")
    assert refused.code == 2 and "zero.stage: stage 1 runs under DDP" in refused.err, refused.err
    reason = refused.err_lines[0].split("zero.stage: ", 1)[1]
    assert line.endswith(f"llama-2-70b-3d.toml:17: warning: zero.stage: `shardplan run` would refuse it: {reason}")
    # From the command line, at its flag; --json lists it among the file's problems.
    result = run_cli("validate", "tiny-gpt2-cpu", "--set", "train.precision=fp16-mixed", "--json")
    (problem,) = result.json["files"][0]["problems"]
    assert result.code == 0 and problem["severity"] == "warning" and problem["path"] == "train.precision"
    assert "would refuse it: fp16-mixed needs loss scaling" in problem["message"]
    for quiet in (("llama-2-70b-3d", "--set", "zero.framework=deepspeed"), ("mixtral-8x7b-h100",)):
        result = run_cli("validate", *quiet)
        assert result.code == 0 and "would refuse" not in result.err, result.err
    assert run_cli("run", "mixtral-8x7b-h100").code == 2
