"""Input and output edges: an input that is no regular file (a FIFO, whose open() would wait
forever for a writer), a write that fails on the way (a full disk: exit 2 naming the flag,
never 3, which the CONTRACT keeps for `run`), and `import --dp 0` of a DeepSpeed config
(the flag's fault, not the config's)."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import ROOT, OsWith, run_cli

JOB = '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n'
PLAN_JOB = ('[model]\npreset = "llama-3-8b"\n[cluster]\npreset = "h100-80gb"\nnodes = 1\n'
            '[train]\nglobal_batch_size = 64\n')
SCHEDULE = ("schedule", "--pp", "2", "--microbatches", "4", "--schedule", "1f1b")
DEEPSPEED = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
             "zero_optimization": {"stage": 3}, "bf16": {"enabled": True}}
# Far above a refused input's start-up (under a second); a regression that opens the FIFO
# blocks until the timeout instead of failing the suite's run forever.
TIMEOUT_S = 60

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")


def _shardplan(*args: str, cwd) -> subprocess.CompletedProcess:
    """`shardplan ARGS` in its own process, killed after TIMEOUT_S: a FIFO opened by mistake
    blocks there, not in the test process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "shardplan", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S, stdin=subprocess.DEVNULL)


# --- 1. an input that is no regular file -----------------------------------------------------

@needs_fifo
@pytest.mark.parametrize("args", [("validate", "fifo"), ("estimate", "fifo", "--json"), ("import", "fifo"),
                                  ("plan", "fifo", "--json"), ("validate", "hf.toml"),
                                  ("estimate", "hf.toml", "--json")])
def test_a_fifo_is_refused_before_it_is_opened(tmp_path, args):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "hf.toml").write_text('[model]\nhf_config = "fifo"\n')
    result = _shardplan(*args, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == ["fifo: is a named pipe (FIFO), not a regular file"]
    if "--json" in args:
        assert json.loads(result.stdout) == {"schema_version": 1, "error": {"exit_code": 2, "problems": [
            {"file": "fifo", "line": None, "path": "", "message": "is a named pipe (FIFO), not a regular file"}]}}
    else:
        assert result.stdout == ""


@needs_fifo
def test_a_link_to_a_fifo_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "job.toml").symlink_to(tmp_path / "fifo")
    result = _shardplan("validate", "job.toml", cwd=tmp_path)
    assert (result.returncode, result.stderr) == (2, "job.toml: is a named pipe (FIFO), not a regular file\n")


def test_a_socket_is_refused(tmp_path, monkeypatch):
    if not hasattr(socket, "AF_UNIX"):
        pytest.skip("needs Unix sockets")
    monkeypatch.chdir(tmp_path)  # a socket's path is limited to about 100 bytes: a short relative one
    server = socket.socket(socket.AF_UNIX)
    try:
        server.bind("job.sock")
        result = run_cli("validate", "job.sock")
    finally:
        server.close()
    assert (result.code, result.err_lines) == (2, ["job.sock: is a socket, not a regular file"])


@pytest.mark.skipif(not os.path.exists("/dev/null"), reason="needs /dev/null")
def test_character_devices_are_still_read():
    # /dev/null is an empty job (all defaults); /dev/zero is read up to the size limit and refused.
    assert run_cli("validate", "/dev/null").code == 0
    if os.path.exists("/dev/zero"):
        result = run_cli("validate", "/dev/zero")
        assert result.code == 2 and result.err_lines[0].startswith("/dev/zero: holds more than")


# --- 2. a write that fails on the way ---------------------------------------------------------

def _args(kind: str, write) -> tuple[str, ...]:
    """A command that writes to `OUT` with its flag, inputs written by `write`."""
    if kind == "plan":
        return ("plan", write("plan.toml", PLAN_JOB), "--write", "OUT")
    if kind == "export":
        return ("export", write("job.toml", JOB), "--to", "deepspeed", "-o", "OUT")
    if kind == "import":
        return ("import", write("ds.json", json.dumps(DEEPSPEED)), "--set", "model.preset=llama-3-8b", "-o", "OUT")
    return (*SCHEDULE, "--svg", "OUT")


FLAGS = {"plan": "--write", "export": "--output", "import": "--output", "schedule": "--svg"}


@needs_dev_full
@pytest.mark.parametrize("kind", ["plan", "export", "import", "schedule"])
def test_a_full_device_is_bad_output_exit_2(write, kind):
    args = tuple("/dev/full" if a == "OUT" else a for a in _args(kind, write))
    line = f"{FLAGS[kind]}: cannot write '/dev/full': No space left on device"
    result = run_cli(*args)
    assert (result.code, result.err_lines) == (2, [line])
    result = run_cli(*args, "--json")
    assert (result.code, result.err_lines) == (2, [line])
    assert result.json == {"schema_version": 1, "error": {"exit_code": 2, "problems": [
        {"file": None, "line": None, "path": FLAGS[kind], "message": "cannot write '/dev/full': No space left on device"}]}}


@pytest.mark.parametrize("kind", ["plan", "export", "import", "schedule"])
def test_a_disk_full_mid_way_keeps_the_old_file(write, tmp_path, monkeypatch, kind):
    import shardplan.io.writing as writing

    out = tmp_path / "out.txt"
    out.write_text("the user's file\n")
    args = tuple(str(out) if a == "OUT" else a for a in _args(kind, write))
    before = sorted(p.name for p in tmp_path.iterdir())

    def full(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(writing, "os", OsWith(write=full))
    for extra in ((), ("--json",)):
        result = run_cli(*args, *extra)
        assert result.code == 2, result.err
        assert result.err_lines == [f"{FLAGS[kind]}: cannot write {str(out)!r}: {os.strerror(errno.ENOSPC)}"]
        if extra:
            problem = result.json["error"]["problems"][0]
            assert result.json["error"]["exit_code"] == 2
            assert problem["path"] == FLAGS[kind]
            assert not problem["message"].startswith("shardplan:")
        assert out.read_text() == "the user's file\n"  # atomic: never half-written
        assert sorted(p.name for p in tmp_path.iterdir()) == before  # no temporary file left
    monkeypatch.undo()
    assert run_cli(*args).code == 0  # the same command, the disk not full, replaces the file
    assert out.read_text() != "the user's file\n"


@needs_dev_full
def test_stdout_on_a_full_disk_is_exit_2(tmp_path):
    with open("/dev/full", "w") as full:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        env.pop("WORLD_SIZE", None)
        proc = subprocess.run([sys.executable, "-m", "shardplan", "validate", "llama-3-8b-h100"], cwd=tmp_path,
                              env=env, stdout=full, stderr=subprocess.PIPE, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == ["shardplan: could not write the output: [Errno 28] No space left on device"]


# --- 3. import --dp 0 of a DeepSpeed config ---------------------------------------------------

@pytest.mark.parametrize("flags, lines", [
    (("--dp", "0"), ["--dp 0: parallel.dp: must be >= 1 (got 0)"]),
    (("--dp", "-3"), ["--dp -3: parallel.dp: must be >= 1 (got -3)"]),
    (("--dp", "0", "--world", "8"), ["--dp 0: parallel.dp: must be >= 1 (got 0)"]),
    (("--set", "parallel.dp=0"), ["--set: parallel.dp: must be >= 1 (got 0)"]),
    (("--dp", "2", "--set", "parallel.dp=0"), ["--set: parallel.dp: must be >= 1 (got 0)"]),
    (("--dp", "0", "--tp", "0"), ["--dp 0: parallel.dp: must be >= 1 (got 0)",
                                  "--tp 0: parallel.tp: must be >= 1 (got 0)"]),
])
def test_import_deepspeed_blames_a_bad_dp_flag_not_the_file(write, flags, lines):
    config = write("ds.json", json.dumps(DEEPSPEED))
    result = run_cli("import", config, *flags)
    assert (result.code, result.err_lines) == (2, lines)
    result = run_cli("import", config, *flags, "--json")
    assert result.code == 2
    problems = result.json["error"]["problems"]
    assert [(p["file"], p["path"]) for p in problems] == [(None, line.split(": ")[1]) for line in lines]


def test_import_deepspeed_dp_message_matches_accelerate(write):
    deepspeed = run_cli("import", write("ds.json", json.dumps(DEEPSPEED)), "--dp", "0", "--json")
    accelerate = run_cli("import", write("acc.yaml", "distributed_type: MULTI_GPU\nnum_processes: 8\n"),
                         "--dp", "0", "--json")
    assert deepspeed.code == accelerate.code == 2
    assert deepspeed.json == accelerate.json
    assert deepspeed.err_lines == accelerate.err_lines


@pytest.mark.parametrize("world", ["0", "-2"])
def test_import_deepspeed_world_below_one_is_the_flags_fault(write, world):
    result = run_cli("import", write("ds.json", json.dumps(DEEPSPEED)), "--world", world)
    assert result.code == 2
    assert len(result.err_lines) == 1 and "--world" in result.err_lines[0] and "ds.json" not in result.err_lines[0]


def test_import_deepspeed_good_dp_still_checked_against_the_file(write):
    # dp 8 = 16 / (2 * 1) imports; dp 2 disagrees with the config, which is then the file's fault.
    config = write("ds.json", json.dumps(DEEPSPEED))
    assert run_cli("import", config, "--dp", "8").code == 0
    result = run_cli("import", config, "--dp", "2")
    assert result.code == 2 and result.err_lines[0].startswith(f"{config}:1: train_batch_size:")
