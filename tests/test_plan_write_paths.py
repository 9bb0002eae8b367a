"""Job files written by `plan --write` and `import -o` in another folder than their input:
a Hugging Face config.json given as the job becomes `[model] hf_config`, and relative paths
name the same files from where the job is written, so `validate` and `estimate` take it
unchanged and `estimate` gives the plan's own peak (CONTRACT: `plan --write`)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from conftest import ROOT, run_cli

# Llama-3-8B's config.json (meta-llama/Meta-Llama-3-8B), the keys shardplan reads.
LLAMA_CONFIG = {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
                "vocab_size": 128256, "max_position_embeddings": 8192}
PLAN_ARGS = ("--gpus", "8", "--set", "cluster.preset=h100-80gb", "--global-batch", "16")
DEEPSPEED = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
             "bf16": {"enabled": True}}


@pytest.fixture
def config(write):
    return write("config.json", json.dumps(LLAMA_CONFIG))


@pytest.fixture
def tokens(write):
    return write("tokens.bin", bytes(4096))


def planned(job: str, out: Path, *extra: str) -> dict:
    """`plan JOB --write OUT --json`: the best plan, after checking that `validate` takes the
    written job and `estimate` of it gives the plan's peak and step time."""
    result = run_cli("plan", job, *PLAN_ARGS, *extra, "--json", "--write", str(out))
    assert result.code == 0, result.err
    best = result.json["plans"][0]
    validated = run_cli("validate", str(out))
    assert validated.code == 0, validated.err
    estimate = run_cli("estimate", str(out), "--json")
    assert estimate.code == 0, estimate.err
    assert estimate.json["peak_gpu_bytes"] == best["peak_gpu_bytes"]
    assert estimate.json["time"]["step_seconds"] == best["time"]["step_seconds"]
    return best


def written(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("where", ["b.toml", "sub/b.toml"])
def test_hf_config_as_input_is_written_as_the_model(config, tmp_path, monkeypatch, where):
    """A config.json given as the job is written as the job that names it, never its keys."""
    monkeypatch.chdir(tmp_path)  # the config as a user names it: relative to the working directory
    out = tmp_path / where
    out.parent.mkdir(exist_ok=True)
    planned("config.json", Path(where))
    data = written(out)
    assert data["model"] == {"hf_config": os.path.relpath(config, out.parent)}
    assert not set(LLAMA_CONFIG) & set(data)


def test_hf_config_from_another_folder(config, tmp_path, monkeypatch):
    """The config named from the working directory, the job written in a third folder."""
    (tmp_path / "run").mkdir()
    (tmp_path / "jobs" / "llama").mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "run")
    planned("../config.json", Path("../jobs/llama/b.toml"))
    assert written(tmp_path / "jobs" / "llama" / "b.toml")["model"] == {"hf_config": "../../config.json"}


def test_relative_paths_follow_the_written_job(config, tokens, write, tmp_path):
    """model.hf_config and data.path, relative to the input job, name the same files from the
    written one; checkpoint.dir (used from the working directory by `run`) and absolute paths
    stay as they are."""
    job = write("j.toml", '[model]\nhf_config = "config.json"\n[data]\npath = "./tokens.bin"\n'
                          '[checkpoint]\ndir = "ckpt"\n')
    out = tmp_path / "sub" / "deeper" / "b.toml"
    out.parent.mkdir(parents=True)
    planned(job, out)
    data = written(out)
    assert data["model"]["hf_config"] == os.path.join("..", "..", "config.json")
    assert data["data"]["path"] == os.path.join("..", "..", "tokens.bin")
    assert data["checkpoint"]["dir"] == "ckpt"
    # The same folder: the paths as the job wrote them.
    beside = tmp_path / "beside.toml"
    planned(job, beside)
    assert written(beside)["data"]["path"] == "./tokens.bin"
    # Absolute paths are kept.
    absolute = write("abs/j.toml", f'[model]\nhf_config = {json.dumps(config)}\n')
    planned(absolute, out)
    assert written(out)["model"]["hf_config"] == config


def test_input_job_in_a_subfolder(config, write, tmp_path):
    """The input job's folder, not the working directory, is what its paths are relative to."""
    job = write("jobs/j.toml", '[model]\nhf_config = "../config.json"\n')
    out = tmp_path / "out" / "b.toml"
    out.parent.mkdir()
    planned(job, out)
    assert written(out)["model"]["hf_config"] == "../config.json"
    planned(job, tmp_path / "b.toml")
    assert written(tmp_path / "b.toml")["model"]["hf_config"] == "config.json"


def test_hf_config_set_on_the_command_line(config, write, tmp_path, monkeypatch):
    """`--set model.hf_config=PATH` is relative to the working directory: written relative to
    the written job."""
    monkeypatch.chdir(tmp_path)
    job = write("jobs/j.toml", '[train]\nseq_len = 2048\n')
    planned(job, Path("jobs/b.toml"), "--set", "model.hf_config=config.json")
    assert written(tmp_path / "jobs" / "b.toml")["model"] == {"hf_config": "../config.json"}


def test_written_through_a_linked_folder(config, write, tmp_path):
    """A folder reached through a link: the relative path walks from where the link leads,
    as the system resolves `..` (lexically it would name another file)."""
    job = write("j.toml", '[model]\nhf_config = "config.json"\n')
    (tmp_path / "real" / "deep").mkdir(parents=True)
    try:
        (tmp_path / "link").symlink_to(tmp_path / "real" / "deep", target_is_directory=True)
    except OSError:  # pragma: no cover - no symlinks on this system
        pytest.skip("no symbolic links")
    out = tmp_path / "link" / "b.toml"
    planned(job, out)
    assert written(out)["model"]["hf_config"] == os.path.join("..", "..", "config.json")


def test_json_job_is_what_is_written(config, tmp_path, monkeypatch):
    """`plans[0].job` of `--json` holds the tables the search set, as the written job has them."""
    monkeypatch.chdir(tmp_path)
    best = planned("config.json", tmp_path / "b.toml")
    data = written(tmp_path / "b.toml")
    for table, keys in best["job"].items():
        assert {key: data[table][key] for key in keys} == keys, table


def test_import_writes_paths_for_its_folder(config, tokens, write, tmp_path, monkeypatch):
    """`import -o` in another folder: the same rewriting (the paths the loader took)."""
    monkeypatch.chdir(tmp_path)
    source = write("ds.json", json.dumps(DEEPSPEED))
    out = tmp_path / "sub" / "imp.toml"
    out.parent.mkdir()
    result = run_cli("import", source, "--world", "8", "--set", "model.hf_config=config.json",
                     "--set", "data.path=tokens.bin", "-o", str(out), "--json")
    assert result.code == 0, result.err
    data = written(out)
    assert data["model"] == {"hf_config": "../config.json"}
    assert data["data"]["path"] == "../tokens.bin"
    assert result.json["job"]["model"] == data["model"]
    assert run_cli("validate", str(out)).code == 0
    assert run_cli("estimate", str(out), "--json").code == 0


def test_no_relative_path_falls_back_to_absolute(tmp_path, monkeypatch):
    """Where no relative path leads (another drive on Windows), the path is absolute."""
    from shardplan.io import writing

    def impossible(path, start=None):
        raise ValueError("path is on mount 'C:', start on mount 'D:'")

    monkeypatch.setattr(writing.os.path, "relpath", impossible)
    (tmp_path / "sub").mkdir()
    folders = writing.job_folders(str(tmp_path / "job.toml"))
    data = writing.relocate_job_paths({"model": {"hf_config": "config.json"}}, folders,
                                      str(tmp_path / "sub" / "b.toml"))
    assert data["model"]["hf_config"] == os.path.join(os.path.realpath(tmp_path), "config.json")


def test_data_path_is_opened_from_the_job_files_folder(tmp_path, monkeypatch):
    """`run` opens data.path where `validate` looks for it: relative to the job file, also when
    model.hf_config comes from the command line; a data.path given there is meant from the
    working directory (io/writing.py `job_folders`)."""
    from shardplan.io.job import load_job

    (tmp_path / "tokens.bin").write_bytes(bytes(64))
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "job.toml").write_text('[model]\npreset = "tiny-llama"\n[data]\npath = "../tokens.bin"\n',
                                               encoding="utf-8")
    other = tmp_path / "elsewhere"
    other.mkdir()
    monkeypatch.chdir(other)
    resolved = load_job(str(tmp_path / "sub" / "job.toml"), [], env={})
    assert resolved.data_file == str(tmp_path / "sub" / ".." / "tokens.bin")
    assert os.path.samefile(resolved.data_file, tmp_path / "tokens.bin")
    (other / "config.json").write_text((ROOT / "tests" / "data" / "hf_configs" / "llama-3-8b.json").read_text(),
                                       encoding="utf-8")
    flagged = load_job(str(tmp_path / "sub" / "job.toml"), [("model.hf_config", "config.json")], env={})
    assert os.path.samefile(flagged.data_file, tmp_path / "tokens.bin")
    (other / "tokens.bin").write_bytes(bytes(64))
    given = load_job(str(tmp_path / "sub" / "job.toml"), [("data.path", "tokens.bin")], env={})
    assert os.path.samefile(given.data_file, other / "tokens.bin")


def test_an_output_onto_the_input_is_refused_and_the_input_kept(config, write, tmp_path, monkeypatch):
    """`import ds.json -o ds.json` replaced the DeepSpeed config with the job it gave, silently;
    `plan config.json --write config.json` the model's config.json with a job. Every output
    flag that names its command's input, by any name (here a link), is bad input and the file
    is left as it was."""
    monkeypatch.chdir(tmp_path)
    ds = write("ds.json", json.dumps(DEEPSPEED))
    (tmp_path / "also-ds.json").symlink_to(ds)
    result = run_cli("import", "ds.json", "-o", "also-ds.json", "--set", "model.preset=llama-3-8b")
    assert result.code == 2 and result.err_lines == [
        "--output: 'also-ds.json' is the input file: writing the job file there would replace it; name another file"]
    assert json.loads(Path(ds).read_text()) == DEEPSPEED
    result = run_cli("plan", "config.json", *PLAN_ARGS, "--write", str(config), "--json")
    assert result.code == 2 and result.json["error"]["problems"][0]["path"] == "--write", result.out
    assert json.loads(Path(config).read_text()) == LLAMA_CONFIG
    job = write("job.toml", '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n')
    before = Path(job).read_text()
    result = run_cli("export", "./job.toml", "--to", "deepspeed", "-o", "job.toml")
    assert result.code == 2 and "writing the deepspeed config there would replace it" in result.err
    assert Path(job).read_text() == before
    # Another file is written as before.
    assert run_cli("import", "ds.json", "-o", "job2.toml", "--world", "8", "--set", "model.preset=llama-3-8b").code == 0
