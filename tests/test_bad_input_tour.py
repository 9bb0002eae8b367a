"""Bad input found on a hostile tour of the planning commands: each gives exit 2 and one clear
line per problem (CONTRACT, exit codes), never an internal error, and with `--json` the
error document."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import run_cli

# Longer than any file name Linux accepts (NAME_MAX 255): looking at it raises ENAMETOOLONG.
LONG_NAME = "a" * 300


def _bad(result, needle: str) -> list[str]:
    assert result.code == 2, (result.code, result.out, result.err)
    assert "Traceback" not in result.err and "internal error" not in result.err, result.err
    assert any(needle in line for line in result.err_lines), result.err
    return result.err_lines


# --- paths that cannot even be looked at --------------------------------------------------

@pytest.mark.parametrize("argv", [
    ["validate", LONG_NAME], ["layout", LONG_NAME], ["estimate", LONG_NAME], ["plan", LONG_NAME],
    ["shards", LONG_NAME], ["schedule", LONG_NAME],
], ids=lambda argv: argv[0])
def test_a_job_name_too_long_for_the_file_system(argv):
    lines = _bad(run_cli(*argv), "cannot read: File name too long")
    assert lines == [f"{LONG_NAME}: cannot read: File name too long"]
    error = run_cli(*argv, "--json").json["error"]
    assert error["exit_code"] == 2 and error["problems"][0]["file"] == LONG_NAME


@pytest.mark.parametrize("argv, table", [
    (["validate"], '[model]\nhf_config = "{}.json"\n'),
    (["estimate"], '[model]\nhf_config = "{}.json"\n'),
    (["validate"], '[model]\npreset = "gpt2"\n[data]\npath = "{}.bin"\n'),  # validate checks data files
], ids=["validate-hf_config", "estimate-hf_config", "validate-data.path"])
def test_a_path_in_the_job_too_long_for_the_file_system(argv, table, write):
    _bad(run_cli(*argv, write("job.toml", table.format(LONG_NAME))), "cannot read: File name too long")


def test_validate_goes_on_past_a_name_too_long(write):
    good = write("good.toml", '[model]\npreset = "gpt2"\n')
    result = run_cli("validate", LONG_NAME, good, "--json")
    assert result.code == 2
    assert [f["valid"] for f in result.json["files"]] == [False, True]


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
@pytest.mark.parametrize("command", ["validate", "estimate", "layout"])
def test_a_device_that_never_ends_is_too_large(command):
    """/dev/zero states no size: it was read whole, until the memory ran out."""
    lines = _bad(run_cli(command, "/dev/zero"), "too large for a job file")
    assert lines == ["/dev/zero: holds more than 8388608 bytes: too large for a job file"]


# --- values as the file wrote them ---------------------------------------------------------

def test_json_null_is_named_null(write):
    _bad(run_cli("validate", write("job.json", '{"parallel": {"tp": null}}')),
         "parallel.tp: expected an integer, got null")


@pytest.mark.parametrize("value, shown", [
    ("1979-05-27", "got a date 1979-05-27"),
    ("07:32:00", "got a time 07:32:00"),
    ("1979-05-27T07:32:00", "got a date-time 1979-05-27T07:32:00"),
])
def test_toml_dates_are_quoted_as_toml_writes_them(value, shown):
    _bad(run_cli("validate", "tiny-gpt2-cpu", "--set", f"parallel.tp={value}"), f"--set: parallel.tp: expected an integer, {shown}")


def test_an_empty_flag_value_is_shown_quoted():
    _bad(run_cli("validate", "tiny-gpt2-cpu", "--zero", ""), "--zero '': zero.stage: unknown sharding ''")


# --- many problems of one kind ------------------------------------------------------------

def test_the_bad_items_of_one_array_are_counted_past_twenty(write):
    job = write("job.toml", "[lora]\ntargets = [" + ", ".join(['"nope"'] * 1000) + "]\n")
    lines = _bad(run_cli("validate", job), "lora.targets.0: must be one of")
    assert len(lines) == 21, lines
    assert lines[-1] == f"{job}:2: lora.targets: and 980 more bad items"


def test_a_long_list_of_repeated_targets_is_refused_at_once():
    """The duplicate check was quadratic: 200,000 names took a minute (an 8 MiB file, a
    quarter of an hour). Linear, 400,000 take well under a second (not asserted: timings belong
    in benchmarks)."""
    from pydantic import ValidationError

    from shardplan.spec.job import LoraSpec

    with pytest.raises(ValidationError, match="'q_proj' is listed twice"):
        LoraSpec.model_validate({"targets": ["q_proj"] * 400_000})


# --- values that name nothing --------------------------------------------------------------

def test_an_empty_hf_config_names_no_file(write):
    lines = _bad(run_cli("validate", write("job.toml", '[model]\nhf_config = ""\n')), "model.hf_config: names no file")
    assert not any("directory" in line for line in lines)


@pytest.mark.parametrize("argv", [["--params", "0"], ["--set", "model.params=0"]], ids=["flag", "set"])
def test_a_model_of_no_parameters_is_refused(argv):
    _bad(run_cli("estimate", *argv), "model.params: a model of 0 parameters has nothing to plan")


def test_a_set_key_may_have_spaces():
    result = run_cli("layout", "--set", " parallel . tp = 2", "--json")
    assert result.code == 0, result.err
    assert result.json["world_size"] == 2


# --- lines of keys TOML allows to be written otherwise ------------------------------------

@pytest.mark.parametrize("text, line", [
    ('[parallel]\n"tp" = 0\n', 2),
    ("[parallel]\n'tp' = 0\n", 2),
    ("[parallel]\ndp = 2\ntp.x = 1\n", 3),  # a dotted key writes the table tp on its line
])
def test_quoted_and_dotted_keys_are_found_on_their_line(text, line, write):
    job = write("job.toml", text)
    _bad(run_cli("validate", job), f"{job}:{line}: parallel.tp:")


# --- the command line ---------------------------------------------------------------------

@pytest.mark.parametrize("argv", [["estimate", "--tp"], ["layout", "--order"], ["plan", "--gpus"]],
                         ids=lambda argv: argv[0])
def test_an_option_without_its_value_names_the_command(argv):
    name = f"shardplan {argv[0]}"
    lines = _bad(run_cli(*argv), "requires an argument")
    assert lines == [f"{name}: Option '{argv[1]}' requires an argument. (see {name} --help)"]


def test_json_after_double_dash_is_a_file_name():
    result = run_cli("estimate", "--", "--json")
    _bad(result, "--json: no such file or job preset")
    assert result.out == ""


@pytest.mark.parametrize("name", ["gpt2.toml", "models/gpt2"])
def test_a_preset_given_as_its_file_is_hinted(name):
    _bad(run_cli("presets", name), "(did you mean 'gpt2'?)")


# --- a --set over a flag of the same key: the --set wins, and says so -----------------------

def test_layout_says_a_set_overrides_a_shortcut():
    result = run_cli("layout", "--dp", "2", "--set", "parallel.dp=4", "--json")
    assert result.code == 0 and result.json["world_size"] == 4
    assert "warning: --set: parallel.dp=4 overrides --dp 2" in result.err_lines


def test_layout_order_gives_way_to_a_set():
    result = run_cli("layout", "--dp", "2", "--tp", "2", "--order", "tp-dp-pp-cp",
                     "--set", "parallel.order=dp-tp-pp-cp", "--json")
    assert result.code == 0 and result.json["order"] == "dp-tp-pp-cp"
    assert "warning: --set: parallel.order='dp-tp-pp-cp' overrides --order tp-dp-pp-cp" in result.err_lines
    _bad(run_cli("layout", "--order", "tp-dp", "--set", "parallel.order=xx"), "--set: parallel.order: unknown axis 'xx'")


def test_schedule_says_a_set_overrides_its_flag():
    result = run_cli("schedule", "--pp", "2", "--set", "parallel.pp=4", "--microbatches", "4", "--schedule", "1f1b",
                     "--json")
    assert result.code == 0 and result.json["pp"] == 4
    assert "warning: --set: parallel.pp=4 overrides --pp 2" in result.err_lines


def test_schedule_blames_the_set_that_gave_a_bad_value():
    lines = _bad(run_cli("schedule", "--set", "parallel.pp=300", "--microbatches", "4", "--schedule", "1f1b"),
                 "must be <= 256")
    assert lines == ["--set: parallel.pp: must be <= 256 (got 300)"]


def test_schedule_svg_needs_a_file_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _bad(run_cli("schedule", "--pp", "2", "--microbatches", "2", "--schedule", "1f1b", "--svg", ""),
         "--svg: needs a file name (got an empty one)")
    assert list(tmp_path.iterdir()) == []


# --- numbers past what Python reads or prints, and values too long for one line ------------
# Python converts at most 4300 decimal digits to an integer (sys.set_int_max_str_digits);
# tomllib and json raise a bare ValueError past that, and a huge hexadecimal integer (read
# without that limit) could not be printed in a message. Each was an internal error (exit 3).
HUGE = "9" * 5000


@pytest.mark.parametrize("name, text, needle", [
    ("job.toml", "[parallel]\n\ndp = " + HUGE + "\n", ":3: invalid TOML: a number of more than 4300 digits"),
    ("job.json", '{"parallel": {"dp": ' + HUGE + "}}", ":1: invalid JSON: a number of more than 4300 digits"),
    ("job.toml", "[parallel]\ndp = 0x" + "f" * 5000 + "\n", "parallel.dp: must be <= 1048576 (got an integer of about 6021 digits)"),
    ("job.toml", "[model]\nparams = 0x" + "f" * 5000 + "\n", "model.params: an integer of about 6021 digits is absurdly large for a count"),
    ("job.toml", "[cluster]\ngpu_memory = 0x" + "f" * 5000 + "\n", "cluster.gpu_memory: an integer of about 6021 digits is absurdly large for a size"),
    # float() of it overflowed
    ("job.toml", "[cluster]\nhost_bandwidth = 0x" + "f" * 5000 + "\n", "cluster.host_bandwidth: an integer of about 6021 digits is absurdly large for a bandwidth"),
], ids=["toml", "json", "hex-degree", "hex-count", "hex-size", "hex-bandwidth"])
@pytest.mark.skipif(not hasattr(__import__("sys"), "get_int_max_str_digits"), reason="no digit limit")
def test_numbers_too_long_for_python(name, text, needle, write):
    path = write(name, text)
    lines = _bad(run_cli("validate", path), needle)
    assert len(lines) == 1 and len(lines[0]) < 300, lines
    doc = run_cli("estimate", path, "--json")
    assert doc.code == 2 and doc.json["error"]["problems"][0]["file"] == path


@pytest.mark.skipif(not hasattr(__import__("sys"), "get_int_max_str_digits"), reason="no digit limit")
def test_a_set_number_too_long_for_python():
    assert _bad(run_cli("estimate", "--set", f"parallel.dp={HUGE}"), "4300 digits") == [
        "--set: parallel.dp: a number of more than 4300 digits"]
    _bad(run_cli("estimate", "--set", f"lora.targets=[{HUGE}]"), "--set: lora.targets: a number of more than 4300 digits")
    lines = _bad(run_cli("estimate", "--params", HUGE), "model.params: count '999")  # read as the string it is
    assert len(lines) == 1 and len(lines[0]) < 200, lines


@pytest.mark.parametrize("argv, needle", [
    (["estimate", "--set", "cluster.gpu_memory=1e999999999999GiB"], "cluster.gpu_memory: size '1e999999999999GiB' is absurdly large"),
    (["estimate", "--params", "1e999999999999B"], "model.params: count '1e999999999999B' is absurdly large"),
    (["estimate", "--set", "cluster.host_bandwidth=1e999999999999GB/s"], "bandwidth '1e999999999999GB/s' is absurdly large"),
    (["shards", "--numel", "1e999999999999"], "--numel: count '1e999999999999' is absurdly large"),
], ids=["size", "count", "bandwidth", "numel"])
def test_an_exponent_past_decimal_arithmetic(argv, needle):
    # Decimal raised its Overflow (an ArithmeticError, not a ValueError): an internal error.
    _bad(run_cli(*argv), needle)


@pytest.mark.parametrize("argv, needle", [
    (["shards", "--numel", "1" * 5000], "--numel: count '1111"),
    (["shards", "--numel", "0." + "0" * 5000 + "1"], "is not a whole number of elements"),
    (["estimate", "--set", "cluster.gpu_memory=80" + "x" * 5000], "unknown size unit 'xxx"),
    (["estimate", "--zero", "z" * 5000], "zero.stage: unknown sharding 'zzz"),
    (["layout", "--order", "tp-" + "x" * 5000], "parallel.order: unknown axis 'xxx"),
    (["estimate", "--set", "p" * 5000], "--set: 'ppp"),
], ids=["numel", "numel-fraction", "size-unit", "zero", "order", "set"])
def test_a_long_value_is_quoted_cut(argv, needle):
    lines = _bad(run_cli(*argv), needle)
    assert len(lines) == 1 and len(lines[0]) < 400, lines[0][:500]


def test_a_long_order_is_checked_in_linear_time():
    # Counting each of 20,000 axis names took 6 s (quadratic); an 8 MiB job file, hours.
    _bad(run_cli("layout", "--order", "-".join(["tp"] * 50_000)), "parallel.order: axis 'tp' appears twice")


@pytest.mark.parametrize("config, needle", [
    ({"hidden_size": "x" * 5000}, "hidden_size: expected a positive integer, got 'xxx"),
    ({"attention_bias": "x" * 5000}, "attention_bias: expected true or false, got 'xxx"),
    ({"model_type": "x" * 5000}, "model_type: 'xxx"),
], ids=["int", "bool", "model_type"])
def test_a_long_hf_config_value_is_quoted_cut(config, needle, write):
    import json

    base = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100}
    write("config.json", json.dumps({**base, **config}))
    lines = _bad(run_cli("validate", write("job.toml", '[model]\nhf_config = "config.json"\n')), needle)
    assert len(lines) == 1 and len(lines[0]) < 300, lines[0][:500]


# --- a JSON job that gives a key twice ------------------------------------------------------

@pytest.mark.parametrize("text, key", [
    ('{"parallel": {"dp": 2,\n "dp": 4}}', "parallel.dp"),
    ('{"train": {"lr": 1},\n "train": {"lr": 2}}', "train"),
], ids=["key", "table"])
def test_a_json_job_key_given_twice_is_refused(text, key, write):
    # json keeps the last one without a word; the same job in TOML is refused.
    path = write("job.json", text)
    assert _bad(run_cli("validate", path), "given twice") == [f"{path}:2: {key}: given twice (lines 1 and 2)"]
    toml = write("job.toml", "[parallel]\ndp = 2\ndp = 4\n")
    assert f"{toml}:3: parallel.dp: given twice (lines 2 and 3)" in run_cli("validate", toml).err_lines


def test_an_unknown_key_of_no_letters_is_named(write):
    _bad(run_cli("validate", write("job.json", '{"": 2}')), "unknown key '' (known: model, parallel")


@pytest.mark.parametrize("value, message", [
    ("²", "WORLD_SIZE: environment variable is '²', not a positive integer"),  # str.isdigit takes it
    ("9" * 5000, "more than the largest supported world"),
])
def test_odd_world_size_variables_are_bad_input(value, message):
    result = run_cli("validate", "tiny-gpt2-cpu", env={"WORLD_SIZE": value})
    assert result.code == 2 and len(result.err_lines) == 1 and message in result.err, result.err


def test_an_empty_source_and_a_folder_as_data_path_are_named(write):
    result = run_cli("validate", "")
    assert result.code == 2 and result.err_lines == ["'': names no file: give a job file or a job preset name"]
    result = run_cli("validate", "tiny-gpt2-cpu", "--set", "data.path=/")
    assert "'/': is a directory, not a file" in result.err


def test_a_model_listing_past_its_rows_is_refused_at_once():
    """shards of a model over a million ranks built a row per (parameter, rank) until the
    memory ran out (tiny-gpt2: 68 parameters x 2^20 ranks); it is bad input, said at once."""
    result = run_cli("shards", "tiny-gpt2-cpu", "--world", str(2**20))
    assert result.code == 2 and len(result.err_lines) == 1 and "--numel N" in result.err


def test_paths_that_cannot_be_looked_at_are_named_at_their_key(write):
    """A name too long for the file system (NAME_MAX 255) as hf_config: the key and line, not
    an internal error; as data.path `estimate` keeps it a warning."""
    job = write("job.toml", f'[model]\nhf_config = "{LONG_NAME}.json"\n')
    result = run_cli("validate", job)
    assert result.code == 2 and "model.hf_config:" in result.err and "cannot read" in result.err, result.err
    result = run_cli("estimate", "tiny-gpt2-cpu", "--set", f"data.path={LONG_NAME}")
    assert result.code == 0 and "warning: data.path" in result.err and "cannot read" in result.err, result.err


def test_plan_writes_a_json_job_as_json(tmp_path):
    """`--write best.json` writes JSON, which every command reads as the job it is (the
    written job is accepted unchanged: CONTRACT, plan)."""
    out = tmp_path / "best.json"
    plan = run_cli("plan", "llama-3-8b-h100", "--gpus", "8", "--global-batch", "8", "--set", "parallel.dp=8",
                   "--write", str(out), "--json")
    assert plan.code == 0, plan.err
    estimate = run_cli("estimate", str(out), "--json")
    assert estimate.code == 0 and estimate.json["peak_gpu_bytes"] == plan.json["plans"][0]["peak_gpu_bytes"]


@pytest.mark.parametrize("args, needle", [
    (("validate", "gpt2-xl-offload-a100-40gb", "--set", "parallel.pp=2", "--set", "parallel.first_stage_layers=100"),
     "first 100: more layers than the model's 48"),
    (("validate", "tiny-gpt2-cpu", "--set", f"train.global_batch_size={2**31}"), "!= dp"),
])
def test_split_and_batch_hints_stay_possible(args, needle):
    result = run_cli(*args)
    assert result.code == 2 and needle in result.err and "would make it" not in result.err, result.err


def test_write_to_a_folder_name_is_refused(tmp_path):
    result = run_cli("plan", "llama-3-8b-h100", "--write", str(tmp_path / "x.toml") + "/")
    assert result.code == 2 and "Is a directory" in result.err and not (tmp_path / "x.toml").exists()
