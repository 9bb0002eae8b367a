"""Rough edges of `shardplan run` a new user meets: resuming from something that is no
checkpoint, a token file that cannot serve, a failure named by the phase it happened in, and
torchrun's automatic restarts announced instead of passing unseen.

The refusals are docs/recovery.md's table ("Refused, with exit 3 and one line"); bad input is
CONTRACT's exit 2. Most checks happen before torchrun starts and run in-process; the ones that
need workers start torchrun (2 CPU ranks, a few steps) and carry the `slow` marker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, run_cli
from test_recovery import JOB as RECOVERY_JOB

pytest.importorskip("torch")  # `run` checks for torch before anything else

JOB = RECOVERY_JOB.replace("{model}", "tiny-gpt2")  # tests/test_recovery.py's job


def _files(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*")}


def _refused(result, line: str) -> None:
    """docs/recovery.md: exit 3 and one line, no traceback."""
    assert result.code == 3, (result.code, result.err)
    assert result.err_lines == [line], result.err


# -- 1. resuming from something that is no checkpoint: exit 3, `checkpoint: ...` ---------------------
def _fake_checkpoint(path: Path) -> Path:
    """A folder `find` takes for a complete checkpoint (its meta file is what marks one)."""
    path.mkdir(parents=True)
    (path / "shardplan.json").write_text("{}", encoding="utf-8")
    return path


def test_resuming_from_the_latest_of_an_empty_folder(tmp_path):
    empty = tmp_path / "ckpt"
    empty.mkdir()
    result = run_cli("run", "tiny-gpt2-cpu", "--set", f"checkpoint.dir={empty}", "--resume")
    _refused(result, f"checkpoint: no complete checkpoint in {empty}")
    assert list(empty.iterdir()) == []  # nothing written


def test_resuming_from_the_latest_where_only_a_partial_one_is(tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "step-00000004.partial").mkdir(parents=True)
    before = _files(folder)
    result = run_cli("run", "tiny-gpt2-cpu", "--set", f"checkpoint.dir={folder}", "--resume")
    _refused(result, f"checkpoint: no complete checkpoint in {folder} (only the unfinished step-00000004.partial)")
    assert _files(folder) == before


@pytest.mark.parametrize("kind", ["empty folder", "missing", "file"])
def test_resuming_from_a_path_that_is_no_checkpoint(tmp_path, kind):
    path = tmp_path / "somewhere"
    if kind == "empty folder":
        path.mkdir()
    elif kind == "file":
        path.write_text("x", encoding="utf-8")
    _refused(run_cli("run", "tiny-gpt2-cpu", f"--resume={path}"), f"checkpoint: {path} is not a checkpoint folder")


def test_resuming_from_the_folder_of_the_checkpoints_names_its_latest(tmp_path):
    folder = tmp_path / "ckpt"
    _fake_checkpoint(folder / "step-00000002")
    latest = _fake_checkpoint(folder / "step-00000004")
    result = run_cli("run", "tiny-gpt2-cpu", f"--resume={folder}")
    _refused(result, f"checkpoint: {folder} is not a checkpoint folder (it holds checkpoints: --resume={latest} "
                     "is its latest)")


@pytest.mark.parametrize("name, shards", [("step-00000004.partial", []), ("step-00000004.partial", ["shardplan.json"]),
                                          ("step-00000004", [".metadata", "__0_0.distcp"])],
                         ids=["partial", "partial-with-meta", "shards-without-meta"])
def test_resuming_from_an_unfinished_checkpoint(tmp_path, name, shards):
    path = tmp_path / name
    path.mkdir()
    for shard in shards:
        (path / shard).write_bytes(b"")
    before = _files(tmp_path)
    result = run_cli("run", "tiny-gpt2-cpu", f"--resume={path}")
    _refused(result, f"checkpoint: {path} is incomplete (written by a run that stopped while saving)")
    assert _files(tmp_path) == before


def test_a_refused_resume_with_json(tmp_path):
    result = run_cli("run", "tiny-gpt2-cpu", f"--resume={tmp_path}", "--json")
    assert result.code == 3
    assert result.json["error"]["exit_code"] == 3
    assert [p["message"] for p in result.json["error"]["problems"]] == [f"checkpoint: {tmp_path} is not a checkpoint folder"]


def test_a_job_without_a_checkpoint_folder_is_still_bad_input():
    # docs/recovery.md: this one is exit 2 (the job cannot resume at all).
    result = run_cli("run", "tiny-gpt2-cpu", "--resume")
    assert result.code == 2 and result.err_lines == [
        "--resume: the job has no [checkpoint] dir to resume from (set checkpoint.dir, or name a checkpoint: "
        "--resume=PATH)"]


def test_a_checkpoint_folder_that_cannot_be_one_is_bad_input_before_torchrun(tmp_path):
    """A file where `[checkpoint] dir` names a folder (or above it) would fail the first save,
    `checkpoint.every` steps into the run: exit 2 before any worker starts, naming the key."""
    afile = tmp_path / "afile"
    afile.write_text("", encoding="utf-8")
    result = run_cli("run", "tiny-gpt2-cpu", "--set", f"checkpoint.dir={afile}")
    assert result.code == 2 and result.err_lines == [f"--set: checkpoint.dir: {str(afile)!r} is a file, not a folder"]
    below = afile / "ckpt"
    result = run_cli("run", "tiny-gpt2-cpu", "--set", f"checkpoint.dir={below}")
    assert result.code == 2 and result.err_lines == [
        f"--set: checkpoint.dir: {str(below)!r} cannot be made: {str(afile)!r} is a file"]
    job = tmp_path / "job.toml"
    job.write_text(f'[model]\npreset = "tiny-gpt2"\n[parallel]\ndp = 2\n[checkpoint]\ndir = "{afile}"\n',
                   encoding="utf-8")
    result = run_cli("run", str(job), "--json")
    assert result.code == 2 and result.json["error"]["problems"][0]["line"] == 6


def test_a_restarted_worker_takes_the_latest_checkpoint_over_the_one_it_began_from(tmp_path):
    from shardplan.runtime.resume import restart_line, resume_request

    folder = tmp_path / "ckpt"
    assert resume_request(str(folder), None, restarted=True) is None  # nothing saved yet: start afresh
    assert resume_request(str(folder), "/elsewhere/step-00000008", restarted=True) == "/elsewhere/step-00000008"
    _fake_checkpoint(folder / "step-00000002")
    assert resume_request(str(folder), None, restarted=False) is None  # a first attempt resumes when asked only
    assert resume_request(str(folder), "/elsewhere/step-00000008", restarted=False) == "/elsewhere/step-00000008"
    # The run began further on than anything in the folder: a restart goes back there, not to step 2.
    assert resume_request(str(folder), "/elsewhere/step-00000008", restarted=True) == "/elsewhere/step-00000008"
    assert resume_request(str(folder), "/elsewhere/step-00000001", restarted=True) == "latest"
    assert resume_request("", "latest", restarted=True) == "latest"
    assert restart_line(1, 3, str(folder), None, "local rank 1: killed by SIGKILL") == (
        f"restart 1 of 3 (after local rank 1: killed by SIGKILL): resuming from {folder / 'step-00000002'} after step 2")
    assert restart_line(2, 3, str(tmp_path / "none"), None) == (
        f"restart 2 of 3: no complete checkpoint in {tmp_path / 'none'} yet: training from step 1")
    assert restart_line(1, 1, "", None) == (
        "restart 1 of 1: the job writes no checkpoints ([checkpoint] dir): training from step 1")


# -- 3. a token file that cannot serve: bad input (exit 2), before torchrun starts ---------------------
# tiny-gpt2: vocabulary 512 (uint16 ids); tiny-gpt2-cpu trains sequences of 128 tokens.
def _tokens(count: int, value: int | None = None) -> bytes:
    import numpy as np

    ids = np.full(count, value, dtype="<u2") if value is not None else (np.arange(count) % 512).astype("<u2")
    return ids.tobytes()


@pytest.mark.parametrize("content, message", [
    (b"\x01" * 1001, "1,001 bytes is not a whole number of uint16 token ids (2 bytes each); is data.dtype right?"),
    (_tokens(10), "holds 10 tokens, fewer than train.seq_len + 1 = 129"),
    (b"", "holds 0 tokens, fewer than train.seq_len + 1 = 129"),
    (_tokens(100) + _tokens(4000, 600), "token 600 at position 100 is outside the vocabulary (512); "
                                        "is data.dtype right?"),
], ids=["odd-size", "too-short", "empty", "outside-vocabulary"])
def test_a_bad_token_file_is_bad_input_before_torchrun(tmp_path, content, message):
    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(content)
    result = run_cli("run", "tiny-gpt2-cpu", "--set", f"data.path={tokens}")
    assert result.code == 2, (result.code, result.err)
    assert result.err_lines == [f"--set: data.path: {str(tokens)!r}: {message}"]
    # Written in the job file: the file and line that name it, as for every bad input.
    job = tmp_path / "job.toml"
    job.write_text('[model]\npreset = "tiny-gpt2"\n[parallel]\ndp = 2\n[train]\nseq_len = 128\n'
                   '[data]\npath = "tokens.bin"\n', encoding="utf-8")
    result = run_cli("run", str(job), "--json")
    assert result.code == 2 and result.err_lines == [f"{job}:8: data.path: 'tokens.bin': {message}"]
    assert result.json["error"]["problems"] == [
        {"file": str(job), "line": 8, "path": "data.path", "message": f"'tokens.bin': {message}"}]


def test_token_file_check_reads_a_bounded_head(tmp_path):
    from shardplan.runtime.token_file import check

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(_tokens(4096) + _tokens(8, 9999))
    assert check(str(tokens), "t", "auto", 512, 128, scan_bytes=2 * 4096) is None  # past the head: the ranks' check
    assert "token 9999 at position 4096" in check(str(tokens), "t", "auto", 512, 128)
    assert check(str(tokens), "t", "uint32", 512, 128) is not None  # read as uint32: ids far outside
    assert check(str(tmp_path), "t", "auto", 512, 128).startswith("t: cannot read: ")  # an unreadable path


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="named pipes are POSIX")
def test_a_named_pipe_as_token_file_is_refused_before_it_is_opened(tmp_path):
    """open() of a FIFO waits for a writer: `run` hung there. The kind of file is looked at
    first, by validate, by the launcher's check and by each rank (under a torchrun of the
    user's own), each time bad input."""
    from shardplan.runtime.data import FileTokens
    from shardplan.runtime.token_file import check
    from shardplan.spec.errors import InputError

    fifo = tmp_path / "tokens.fifo"
    os.mkfifo(fifo)
    said = f"'{fifo}': is a named pipe (FIFO), not a file of token ids"
    for command in ("validate", "run"):
        result = run_cli(command, "tiny-gpt2-cpu", "--set", f"data.path={fifo}")
        assert result.code == 2 and result.err_lines == [f"--set: data.path: {said}"], (command, result.err)
    assert check(str(fifo), "t", "auto", 512, 128) == "t: is a named pipe (FIFO), not a file of token ids"
    with pytest.raises(InputError, match=r"is a named pipe \(FIFO\)"):
        FileTokens(str(fifo), "auto", 512, 128, seed=0)


def test_the_ranks_refuse_a_bad_token_file_as_bad_input(tmp_path):
    """Under a torchrun of the user's own the launcher's check does not run: each rank's is
    the same, and bad input too (exit 2)."""
    from shardplan.runtime.data import FileTokens
    from shardplan.spec.errors import EXIT_BAD_INPUT, InputError

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(b"\x01" * 1001)
    with pytest.raises(InputError, match="not a whole number of uint16 token ids") as refused:
        FileTokens(str(tokens), "auto", 512, 128, seed=0)
    assert refused.value.exit_code == EXIT_BAD_INPUT
    tokens.write_bytes(_tokens(4000, 600))
    with pytest.raises(InputError, match=r"token 600 at position \d+ is outside the vocabulary \(512\)"):
        FileTokens(str(tokens), "auto", 512, 128, seed=0).sample(0)
    tokens.write_bytes(_tokens(4000))
    assert FileTokens(str(tokens), "auto", 512, 128, seed=0).sample(0).shape == (129,)


# -- 4. restarts announced: the launcher's view of torchrun's log folders ------------------------------
def test_each_restart_is_announced_once(tmp_path, capsys):
    from shardplan.cli.run_cmd import Restarts

    logs, folder = tmp_path / "logs", tmp_path / "ckpt"
    _fake_checkpoint(folder / "step-00000004")
    run = logs / "run-id"
    (run / "attempt_0" / "0").mkdir(parents=True)
    (run / "attempt_0" / "0" / "stderr.log").write_text("some warning\nrank 0: RuntimeError during step 5 "
                                                         "(forward, backward, optimizer): boom\n")
    captured = ["W1123 ... Sending process 1 closing signal SIGTERM\n",
                "E1123 ... failed (exitcode: -9) local_rank: 1 (pid: 2) of binary: python\n"]
    restarts = Restarts(logs, 2, captured, str(folder), None)
    restarts.poll()
    assert capsys.readouterr().err == ""  # the first attempt is no restart
    (run / "attempt_1" / "1").mkdir(parents=True)
    restarts.poll()
    (run / "attempt_1" / "1" / "stderr.log").write_text("rank 1: checkpoint: cannot load x\n")
    captured.append("E1123 ... failed (exitcode: 3) local_rank: 1 (pid: 3) of binary: python\n")
    restarts.poll()
    assert capsys.readouterr().err == (
        "restart 1 of 2 (after local rank 1: killed by SIGKILL; rank 0: RuntimeError during step 5 (forward, backward, "
        f"optimizer): boom): resuming from {folder / 'step-00000004'} after step 4\n")
    # The final failure is the last attempt's: its logs and torchrun's lines since the restart.
    attempt, text = restarts.last_attempt(logs)
    assert attempt == run / "attempt_1" and "exitcode: 3" in text and "exitcode: -9" not in text


# -- runs under torchrun ---------------------------------------------------------------------------
def shardplan_run(job: Path, *args: str, fault: str | None = None, pythonpath: str | None = None):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                             "SHARDPLAN_INJECT_FAULT", "SHARDPLAN_DEBUG")}
    if fault:
        env["SHARDPLAN_INJECT_FAULT"] = fault
    if pythonpath:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [pythonpath, env.get("PYTHONPATH")]))
    return subprocess.run([sys.executable, "-m", "shardplan", "run", str(job), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)


@pytest.mark.slow
def test_a_failing_import_is_named_by_its_phase(tmp_path):
    """An installed library that fails to import (here torchao, for adamw8bit) fails while the
    libraries load, not while the checkpoint is read."""
    broken = tmp_path / "lib" / "torchao"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text('raise ImportError("libtorchao.so: cannot open shared object file")\n')
    proc = shardplan_run(ROOT / "presets" / "jobs" / "tiny-gpt2-cpu.toml", "--set", "train.steps=2",
                         "--set", "train.optimizer=adamw8bit", pythonpath=str(broken.parent))
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == ["ranks 0,1: ImportError during loading the fine-tuning libraries: "
                                        "libtorchao.so: cannot open shared object file"], proc.stderr[-3000:]


@pytest.mark.slow
def test_restarts_are_announced_and_resume_from_the_latest_checkpoint(tmp_path):
    job, folder = tmp_path / "job.toml", tmp_path / "ckpt"
    job.write_text(JOB.format(folder=folder), encoding="utf-8")
    # The launcher's own line: what failed and where the workers resume, nothing else.
    first = shardplan_run(job, "--max-restarts", "1", "--json", fault="kill:step=5:rank=1")
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stderr.splitlines() == [
        f"restart 1 of 1 (after local rank 1: killed by SIGKILL): resuming from {folder / 'step-00000004'} after step 4"]
    assert [s["step"] for s in json.loads(first.stdout)["steps"]] == [5, 6]
    # Begun from an older checkpoint with --resume=PATH, a restart takes the latest one saved
    # since (step 6), not PATH again; under --verbose rank 0 announces it itself, once.
    again = shardplan_run(job, f"--resume={folder / 'step-00000004'}", "--set", "train.steps=8", "--max-restarts", "1",
                          "--verbose", "--report", str(tmp_path / "r.json"), fault="kill:step=7:rank=1")
    assert again.returncode == 0, again.stderr[-3000:]
    restarts = [line for line in again.stderr.splitlines() if line.startswith("restart ")]
    assert restarts == [f"restart 1 of 1: resuming from {folder / 'step-00000006'} after step 6"], again.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["resumed_from"]["step"] == 6 and [s["step"] for s in report["steps"]] == [7, 8]


def _session(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:  # gone meanwhile
        return None


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc"), reason="lists processes through /proc (Linux)")
@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_run_says_where_it_resumes(tmp_path, sig, code):
    """A signal sent to the launcher alone (a scheduler's SIGTERM, `kill -INT`; a terminal's
    Ctrl-C reaches torchrun too) stops torchrun and its workers, and the launcher says which
    checkpoint `--resume` continues from, exiting as a process that signal stopped (128 + n)."""
    job, folder = tmp_path / "job.toml", tmp_path / "ckpt"
    job.write_text(JOB.format(folder=folder).replace("steps = 6", "steps = 100000").replace("every = 2", "every = 1"),
                   encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "SHARDPLAN_DEBUG")}
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", "run", str(job)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env, start_new_session=True,
                            # a shell's background job ignores SIGINT, and a child inherits that
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 240
        while not list(folder.glob("step-*[0-9]")) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=120)
        time.sleep(1)
        # torchrun and its workers are gone: nothing in the launcher's session is left running.
        left = [pid for pid in map(int, filter(str.isdigit, os.listdir("/proc"))) if _session(pid) == proc.pid]
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever is left of the session
        except ProcessLookupError:
            pass
    assert left == []
    assert proc.returncode == code, err[-3000:]
    (line,) = err.splitlines()
    assert line.startswith(f"run: stopped by {sig.name}; the latest complete checkpoint is {folder / 'step-'}")
    assert line.endswith("the same command with --resume continues from it")
    step = int(line.split("(step ")[1].split(")")[0])
    assert (folder / f"step-{step:08d}").is_dir()
