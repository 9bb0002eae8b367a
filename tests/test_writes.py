"""Files the commands write (`export -o`, `import -o`, `schedule --svg`; `plan --write` in
test_plan_cli.py): written whole or not at all. A full disk or a file-size limit mid-way is
exit 2 naming the flag and the file, the old file stays as it was and no temporary file is left; a target
that is not a regular file (/dev/full) is written directly and fails the same way."""

from __future__ import annotations

import os
import resource
import signal
import stat
import subprocess
import sys

import pytest

from conftest import run_cli

SCHEDULE = ("schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b")
JOB = '[model]\npreset = "llama-3-8b"\n[parallel]\ndp = 8\n'


def _limited(limit: int):
    def start():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of a signal
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return start


def _cli(*args: str, limit: int) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run([sys.executable, "-m", "shardplan", *args], capture_output=True, text=True, env=env,
                          preexec_fn=_limited(limit), timeout=120)


@pytest.mark.parametrize("command", ["export", "schedule", "import"])
def test_a_file_size_limit_mid_way_keeps_the_old_file(tmp_path, command):
    out = tmp_path / "out.txt"
    out.write_text("the user's file\n")
    job = tmp_path / "job.toml"
    job.write_text(JOB)
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}')
    args = {"export": ("export", str(job), "--to", "deepspeed", "-o", str(out)),
            "schedule": (*SCHEDULE, "--svg", str(out)),
            "import": ("import", str(config), "-o", str(out), "--set", "model.preset=llama-3-8b")}[command]
    result = _cli(*args, limit=40)
    flag = "--svg" if command == "schedule" else "--output"
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [f"{flag}: cannot write '{out}': File too large"]
    assert out.read_text() == "the user's file\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "job.toml", "out.txt"]
    # Without the limit the same command replaces the file.
    assert _cli(*args, limit=resource.RLIM_INFINITY).returncode == 0
    assert out.read_text() != "the user's file\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full")
@pytest.mark.parametrize("args", [(*SCHEDULE, "--svg", "/dev/full"), ("export", "JOB", "--to", "deepspeed", "-o", "/dev/full")])
def test_dev_full_is_exit_2(write, args):
    args = tuple(write("job.toml", JOB) if a == "JOB" else a for a in args)
    flag = "--svg" if "--svg" in args else "--output"
    for extra in ((), ("--json",)):
        result = run_cli(*args, *extra)
        assert result.code == 2, result.err
        assert result.err_lines == [f"{flag}: cannot write '/dev/full': No space left on device"]
        if extra:
            import json

            assert json.loads(result.out)["error"]["exit_code"] == 2


def test_permissions_and_links_kept(tmp_path):
    out = tmp_path / "pipe.svg"
    out.write_text("old")
    out.chmod(0o640)
    link = tmp_path / "link.svg"
    link.symlink_to(out)
    assert run_cli(*SCHEDULE, "--svg", str(link)).code == 0
    assert link.is_symlink() and out.read_text().startswith("<?xml")
    assert stat.S_IMODE(out.stat().st_mode) == 0o640
    new = tmp_path / "new.svg"
    umask = os.umask(0o022)
    try:
        assert run_cli(*SCHEDULE, "--svg", str(new)).code == 0
    finally:
        os.umask(umask)
    assert stat.S_IMODE(new.stat().st_mode) == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.svg", "new.svg", "pipe.svg"]


def test_unwritable_paths_are_bad_input(tmp_path):
    for target in (tmp_path / "no" / "x.svg", tmp_path):
        result = run_cli(*SCHEDULE, "--svg", str(target))
        assert result.code == 2 and result.err_lines[0].startswith("--svg: cannot write"), result.err
    result = run_cli("export", "llama-3-8b-h100", "--to", "deepspeed", "-o", str(tmp_path / "no" / "x.json"))
    assert result.code == 2 and result.err_lines == [
        f"--output: cannot write {str(tmp_path / 'no' / 'x.json')!r}: No such file or directory"]


def test_dash_is_stdout_where_stdout_is_free(tmp_path, monkeypatch):
    """`-o -` is stdout, as the POSIX utility convention has it (`tar -f -`): the same output as
    no -o, and no file named `-`. Where the command prints its own output on stdout (plan's
    table, schedule's timeline) `-` is refused before any work, and an empty name is refused
    everywhere: before, `-o ''` printed to stdout and `-o -` wrote a file named `-`."""
    monkeypatch.chdir(tmp_path)
    job = str(tmp_path / "job.toml")
    (tmp_path / "job.toml").write_text(JOB)
    config = tmp_path / "ds.json"
    config.write_text('{"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3}}')
    for args in (("export", job, "--to", "deepspeed"),
                 ("import", str(config), "--set", "model.preset=llama-3-8b")):
        plain = run_cli(*args)
        for extra in ((), ("--json",)):
            assert run_cli(*args, "-o", "-", *extra).out == run_cli(*args, *extra).out
        assert plain.code == 0 and plain.out
        empty = run_cli(*args, "-o", "")
        assert (empty.code, empty.out, empty.err_lines) == (2, "", ["--output: needs a file name (got an empty one)"])
    for args, holds in ((("plan", job, "--top", "1", "--write", "-"), "the table of plans"),
                        ((*SCHEDULE, "--svg", "-"), "the schedule")):
        for extra, what in (((), holds), (("--json",), "the JSON document")):
            result = run_cli(*args, *extra)
            assert result.code == 2 and result.err_lines == [
                f"{args[-2]}: '-' would write to stdout, which holds {what}: name a file (or /dev/stdout to have both there)"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.json", "job.toml"]
