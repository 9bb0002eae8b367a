"""Problems in input files name the line they are on: a Hugging Face config.json's keys (as the
DeepSpeed import's do), and a TOML key or table given twice names the key and both its lines
(as a JSON job's does). CONTRACT: exit 2, `file:line: path: message`, and the JSON error
document's problems carry the same file, line and path."""

from __future__ import annotations

import json
import sys

import pytest

from conftest import DATA, run_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

LLAMA_3_8B = DATA / "hf_configs" / "llama-3-8b.json"
LLAMA_31_8B = DATA / "hf_configs" / "llama-3.1-8b.json"


def _config_line(text: str, needle: str) -> int:
    """The 1-based line of the first line holding `needle` (the expected line, found in the
    file as written rather than counted by hand)."""
    return next(n for n, line in enumerate(text.splitlines(), start=1) if needle in line)


def _only_problem(result) -> dict:
    assert result.code == 2, (result.code, result.out, result.err)
    problems = result.json["error"]["problems"]
    assert len(problems) == 1, problems
    return problems[0]


# --- a Hugging Face config.json: the line of the offending key -------------------------------

def _llama_with(write, source, change) -> tuple[str, str]:
    """An indented config.json (as `save_pretrained` writes it) with `change` applied."""
    config = json.loads(source.read_text())
    change(config)
    text = json.dumps(config, indent=2)
    return write("cfg.json", text), text


def test_a_config_json_key_of_the_wrong_type_names_its_line(write, tmp_path, monkeypatch):
    _, text = _llama_with(write, LLAMA_3_8B, lambda c: c.update(hidden_size="4096"))
    line = _config_line(text, '"hidden_size"')
    monkeypatch.chdir(tmp_path)  # the file named as a user names it
    expected = f"cfg.json:{line}: hidden_size: expected a positive integer, got '4096'"
    assert expected in run_cli("estimate", "cfg.json").err_lines
    problem = _only_problem(run_cli("estimate", "cfg.json", "--json"))
    assert problem == {"file": "cfg.json", "line": line, "path": "hidden_size",
                       "message": "expected a positive integer, got '4096'"}


def test_a_config_json_named_by_a_job_names_its_line(write):
    _, text = _llama_with(write, LLAMA_3_8B, lambda c: c.update(num_hidden_layers=0))
    line = _config_line(text, '"num_hidden_layers"')
    job = write("job.toml", '[model]\nhf_config = "cfg.json"\n')
    expected = f"cfg.json:{line}: num_hidden_layers: expected a positive integer, got 0"
    assert expected in run_cli("validate", job).err_lines
    problem = _only_problem(run_cli("estimate", job, "--json"))
    assert (problem["file"], problem["line"], problem["path"]) == ("cfg.json", line, "num_hidden_layers")


def test_a_nested_config_json_key_names_its_line(write):
    path, text = _llama_with(write, LLAMA_31_8B, lambda c: c["rope_scaling"].update(factor="8"))
    line = _config_line(text, '"factor"')
    assert f"{path}:{line}: rope_scaling.factor: expected a positive number, got '8'" in \
        run_cli("estimate", path).err_lines
    assert _only_problem(run_cli("estimate", path, "--json"))["line"] == line


def test_a_missing_nested_key_names_the_line_of_its_table(write):
    path, text = _llama_with(write, LLAMA_31_8B, lambda c: c["rope_scaling"].pop("factor"))
    line = _config_line(text, '"rope_scaling"')
    assert f"{path}:{line}: rope_scaling.factor: required for rope_type 'llama3'" in \
        run_cli("estimate", path).err_lines


def test_a_config_json_key_given_twice_is_at_the_line_of_the_value_read(write):
    # transformers reads config.json with `json`, which keeps the last of a key given twice
    # (configuration_utils.py `_dict_from_json_file`): the value read, and the line named, is the
    # last one, and the config is not refused for it.
    text = ('{\n "model_type": "llama",\n "num_hidden_layers": 2,\n "num_attention_heads": 4,\n'
            ' "hidden_size": 64,\n "hidden_size": "64"\n}\n')
    job = write("job.toml", f'[model]\nhf_config = "{write("cfg.json", text)}"\n')
    problem = _only_problem(run_cli("validate", job, "--json"))
    assert (problem["line"], problem["path"], problem["message"]) == (6, "hidden_size",
                                                                      "expected a positive integer, got '64'")


# --- a TOML key or table given twice: the key and both its lines ------------------------------

def _tomllib_line(text: str) -> int:
    """The line tomllib itself reports for the error (the reference for the line)."""
    with pytest.raises(tomllib.TOMLDecodeError) as caught:
        tomllib.loads(text)
    return int(str(caught.value).rsplit("line ", 1)[1].split(",")[0])


PRESET = '[model]\npreset = "llama-3-8b"\n\n'


@pytest.mark.parametrize("text, path, lines", [
    (PRESET + "[parallel]\ndp = 1\ndp = 2\n", "parallel.dp", "lines 5 and 6"),
    (PRESET + '[parallel]\ndp = 1\n"dp" = 2\n', "parallel.dp", "lines 5 and 6"),
    ("parallel.dp = 1\nparallel.dp = 2\n\n" + PRESET, "parallel.dp", "lines 1 and 2"),
    ("model.preset = 'llama-3-8b'\nparallel = {dp = 1, dp = 2}\n", "parallel.dp", "both on line 2"),
    (PRESET + "[parallel]\ndp = 1\n\n[parallel]\ntp = 2\n", "parallel", "lines 4 and 7"),
    ('parallel = {dp = 1}\n[parallel]\ntp = 2\n', "parallel", "lines 1 and 2"),
    ('[model]\npreset = """\n[parallel]\ndp = 1\n"""\n[parallel]\ndp = 1\ndp = 2\n', "parallel.dp",
     "lines 7 and 8"),  # a multi-line string that looks like TOML is no table
    (PRESET + '[parallel]\n"d\\u0070" = 1\ndp = 2\n', "parallel.dp", "lines 5 and 6"),  # TOML's \u escape
], ids=["key", "quoted-key", "dotted-key", "inline-table", "table", "inline-then-table", "multiline-string",
        "escaped-key"])
def test_a_toml_key_given_twice_is_named_with_both_lines(text, path, lines, write):
    line = _tomllib_line(text)
    job = write("dupkey.toml", text)
    result = run_cli("validate", job)
    assert result.code == 2
    assert f"{job}:{line}: {path}: given twice ({lines})" in result.err_lines, result.err
    problem = _only_problem(run_cli("estimate", job, "--json"))
    assert problem == {"file": job, "line": line, "path": path, "message": f"given twice ({lines})"}
    assert _only_problem(run_cli("validate", job, "--json")) == problem


@pytest.mark.parametrize("text, named, path", [
    ("[[a]]\nx = 1\nx = 2\n", "[a]\nx = 1\nx = 2\n", "a.x"),  # arrays of tables: not followed
    ("x = [{a = 1, a = 2}]\n", "x = {a = 1, a = 2}\n", "x.a"),  # a table inside an array
], ids=["array-of-tables", "table-in-array"])
def test_a_toml_key_the_scan_cannot_name_keeps_tomllib_message(text, named, path, write):
    # Where the key is not certain, tomllib's own message stays; its twin that the scan
    # follows is named.
    line = _tomllib_line(text)
    problem = _only_problem(run_cli("validate", write("job.toml", text), "--json"))
    assert problem["line"] == line and problem["path"] == ""
    assert problem["message"].startswith("invalid TOML: ")
    twin = _only_problem(run_cli("validate", write("twin.toml", named), "--json"))
    assert (twin["line"], twin["path"]) == (_tomllib_line(named), path)


def test_rules_of_the_whole_config_are_at_their_keys_line(write):
    """A rule over several keys (heads against the hidden size) or a bound the job file's shape
    has too (ModelSpec: at most 100,000 layers) names the config.json key at its line, read
    directly and through a job's `[model] hf_config` (they had no line)."""
    path, text = _llama_with(write, LLAMA_3_8B, lambda c: c.update(num_attention_heads=33))
    heads = _config_line(text, '"num_attention_heads"')
    result = run_cli("estimate", path)
    assert result.code == 2
    assert f"{path}:{heads}: num_attention_heads: 33 heads do not divide hidden_size 4096; set head_dim explicitly" \
        in result.err_lines, result.err
    job = write("job.toml", f'[model]\nhf_config = "{path}"\n')
    problems = run_cli("validate", job, "--json").json["error"]["problems"]
    assert {(p["file"], p["line"], p["path"]) for p in problems} >= {(path, heads, "num_attention_heads")}
    path, text = _llama_with(write, LLAMA_3_8B, lambda c: c.update(num_hidden_layers=200_000))
    problem = _only_problem(run_cli("estimate", path, "--json"))
    assert (problem["line"], problem["path"], problem["message"]) == (
        _config_line(text, '"num_hidden_layers"'), "num_hidden_layers", "must be <= 100000 (got 200000)")
