"""The application shell: `--version` without typer, one command's module per run, `--debug`
anywhere, shell completion, and `validate --json`'s error member."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from shardplan import __version__
from shardplan.cli.app import COMMANDS, command_names


def _python(code: str, env: dict | None = None) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    environment.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=environment,
                          timeout=120)


def test_version_is_answered_before_typer_and_pydantic_load():
    proc = _python("import sys; from shardplan.cli.app import main; code = main(['--version']); "
                   "print(sorted(m for m in ('typer', 'pydantic', 'rich') if m in sys.modules)); sys.exit(code)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == [f"shardplan {__version__}", "[]"]


@pytest.mark.parametrize("argv", [["--version"], ["--debug", "--version"]])
def test_version_in_process(argv):
    result = run_cli(*argv)
    assert (result.code, result.out) == (0, f"shardplan {__version__}\n")


def test_a_command_imports_only_its_own_module():
    # A heavy command (run, presets' pygments, a future exporter) costs the others nothing.
    proc = _python(
        "import sys, io, contextlib; from shardplan.cli.app import main\n"
        "with contextlib.redirect_stdout(io.StringIO()): code = main(['estimate', 'llama-3-8b-h100', '--json'])\n"
        "print(sorted(m.split('.')[-1] for m in sys.modules if m.startswith('shardplan.cli.') and m.endswith('_cmd')))\n"
        "sys.exit(code)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['estimate_cmd']", proc.stdout


def test_the_collector_is_paused_for_a_planning_command_and_restored():
    """Planning commands run with Python's cyclic collector paused (cli/app.py `main`); an
    in-process caller gets it back as it was, also after a failing command, and `run` keeps it."""
    proc = _python(
        "import gc, sys, io, contextlib\n"
        "import shardplan.cli.validate_cmd as v\n"
        "seen = []\n"
        "real = v.register\n"
        "def register(app):\n"
        "    real(app)\n"
        "    seen.append(gc.isenabled())\n"
        "v.register = register\n"
        "from shardplan.cli.app import main, command_names\n"
        "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
        "    codes = [main(['validate', 'llama-3-8b-h100']), main(['validate', 'no-such-file.toml'])]\n"
        "    gc.disable(); main(['validate', 'llama-3-8b-h100']); off = gc.isenabled(); gc.enable()\n"
        "print(codes, seen, gc.isenabled(), off, command_names(['run', 'job.toml']))\n"
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 2] [False, False, False] True False ['run']"


def test_a_planning_command_ends_without_teardown_and_loses_nothing():
    """Planning commands end with os._exit after the atexit handlers and a flush of the
    standard streams (cli/app.py `_end_process`): the whole output arrives through a pipe, the
    exit code is kept, a handler registered during the command runs; `run` exits normally."""
    code = ("import atexit, sys, os\n"
            "import shardplan.cli.app as app\n"
            "real = app._main\n"
            "def traced(argv):\n"
            "    atexit.register(lambda: sys.stderr.write('handler ran\\n'))\n"
            "    return real(argv)\n"
            "app._main = traced\n"
            "real_exit = os._exit\n"
            "os._exit = lambda c: (sys.stderr.write(f'os._exit({c})\\n'), sys.stderr.flush(), real_exit(c))\n"
            "sys.argv = ['shardplan', *sys.argv[1:]]\n"
            "app.main_exit()\n")
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop("WORLD_SIZE", None)
    environment.pop("PYTHONUNBUFFERED", None)  # stdout buffered, as a user's: the final flush must write it

    def command(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=ROOT,
                              env=environment, timeout=120)

    shown = command("estimate", "llama-3-8b-h100", "--json")
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)["peak_gpu_bytes"] > 0  # the whole document, flushed
    assert shown.stderr.splitlines()[-2:] == ["handler ran", "os._exit(0)"]
    failed = command("validate", "no-such-file.toml")
    assert failed.returncode == 2
    assert failed.stderr.splitlines()[-2:] == ["handler ran", "os._exit(2)"]
    for argv in (["validate", "llama-3-8b-h100"], ["estimate", "llama-3-8b-h100", "--json"]):
        closed = subprocess.run([sys.executable, "-m", "shardplan", *argv], cwd=ROOT, env=environment,
                                stderr=subprocess.PIPE, text=True, timeout=120,
                                preexec_fn=lambda: os.close(1))  # started with no stdout at all
        assert closed.returncode == 0 and "Traceback" not in closed.stderr, closed.stderr
    trained = command("run", "no-such-file.toml")  # `run` exits normally: no os._exit
    assert trained.returncode == 2
    assert "os._exit" not in trained.stderr and "handler ran" in trained.stderr


@pytest.mark.parametrize("argv", [["plan", "llama-3-8b-h100", "--set", "parallel.dp=1", "--gpus", "8", "--json"],
                                  ["estimate", "llama-3-8b-h100", "--json"], ["presets"]])
def test_a_reader_that_leaves_is_no_failure(argv):
    # `shardplan ... | head -c 10`: the reader leaves before the command writes (here before it
    # starts to, so that every write meets the closed pipe); the command exits 0 with nothing
    # on stderr (click turns a broken pipe in a command into exit 1).
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop("WORLD_SIZE", None)
    environment.pop("PYTHONUNBUFFERED", None)
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", *argv], cwd=ROOT, env=environment,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 0 and not stderr, stderr


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs Linux's /dev/full")
@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("argv", [["validate", "llama-3-8b-h100"], ["estimate", "llama-3-8b-h100", "--json"]])
def test_output_that_cannot_be_written_fails_in_one_line(argv, unbuffered):
    # A full disk: written in the command (unbuffered, or a document larger than the buffer) or
    # at the final flush (cli/app.py `_end_process`), the command fails with exit 2 and one line
    # (3 is `run`'s, CONTRACT.md).
    environment = dict(os.environ, PYTHONPATH=str(ROOT))
    environment.pop("WORLD_SIZE", None)
    environment.pop("PYTHONUNBUFFERED", None)
    if unbuffered:
        environment["PYTHONUNBUFFERED"] = "1"
    with open("/dev/full", "w") as full:
        proc = subprocess.run([sys.executable, "-m", "shardplan", *argv], cwd=ROOT, env=environment, stdout=full,
                              stderr=subprocess.PIPE, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines()[-1] == "shardplan: could not write the output: [Errno 28] No space left on device"
    assert "Traceback" not in proc.stderr


def test_a_schedule_from_flags_never_reads_a_job():
    proc = _python(
        "import sys, io, contextlib; from shardplan.cli.app import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        "    code = main(['schedule', '--pp', '4', '--microbatches', '8', '--schedule', '1f1b'])\n"
        "print([m for m in ('shardplan.spec.job', 'shardplan.io.job', 'rich.console') if m in sys.modules])\n"
        "sys.exit(code)")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


@pytest.mark.parametrize("argv, expected", [
    (["estimate", "job.toml"], ["estimate"]),
    (["--debug", "layout", "--dp", "2"], ["layout"]),
    (["--help"], list(COMMANDS)),
    ([], list(COMMANDS)),
    (["estimat"], list(COMMANDS)),  # click's "did you mean" needs every name
    (["--bogus", "estimate"], list(COMMANDS)),
    (["-h", "estimate"], list(COMMANDS)),
    (["estimate", "--help"], ["estimate"]),
])
def test_which_commands_are_built(argv, expected):
    assert command_names(argv) == expected


def test_every_command_is_listed_in_help():
    result = run_cli("--help")
    for name in COMMANDS:
        assert name in result.out


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_before_or_after_the_command(where, write):
    job = write("job.toml", "[parallel]\ndp = 0\n")
    argv = ["--debug", "estimate", job] if where == "before" else ["estimate", job, "--debug"]
    result = run_cli(*argv)  # --debug adds the traceback; the exit code is bad input's (CONTRACT)
    assert result.code == 2
    assert "Traceback" in result.err and "parallel.dp: must be >= 1" in result.err_lines[-1]
    assert "SHARDPLAN_DEBUG" not in os.environ  # restored for the next caller


def test_debug_after_the_command_in_a_process(write):
    job = write("job.toml", "[parallel]\ndp = 0\n")
    proc = subprocess.run([sys.executable, "-m", "shardplan", "estimate", job, "--debug"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" in proc.stderr and "No such option" not in proc.stderr


def test_debug_keeps_the_exit_code_of_an_internal_error(write, monkeypatch):
    """An internal error is exit 3 with or without --debug; --debug adds its traceback."""
    from shardplan.cli import validate_cmd

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    job = write("job.toml", "[parallel]\ndp = 1\n")
    monkeypatch.setattr(validate_cmd, "_summary", broken)
    plain, debug = run_cli("validate", job), run_cli("--debug", "validate", job)
    assert plain.code == debug.code == 3
    assert "Traceback" not in plain.err and "Traceback" in debug.err and "RuntimeError: boom" in debug.err
    assert plain.err_lines[-1].endswith("(rerun with --debug)")
    assert debug.err_lines[-1] == "shardplan: internal error: RuntimeError: boom"


def test_show_completion_prints_a_script():
    proc = subprocess.run([sys.executable, "-m", "shardplan", "--show-completion", "bash"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120,
                          env=dict(os.environ, _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1"))
    assert proc.returncode == 0, proc.stderr
    assert "_SHARDPLAN_COMPLETE=complete_bash" in proc.stdout


def test_install_completion_writes_the_script(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path), _TYPER_COMPLETE_TEST_DISABLE_SHELL_DETECTION="1")
    proc = subprocess.run([sys.executable, "-m", "shardplan", "--install-completion", "bash"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    script = tmp_path / ".bash_completions" / "shardplan.sh"
    assert "_SHARDPLAN_COMPLETE" in script.read_text()
    assert str(script) in (tmp_path / ".bashrc").read_text()


def test_completion_builds_only_the_command_typed(monkeypatch):
    monkeypatch.setenv("_SHARDPLAN_COMPLETE", "complete_bash")
    monkeypatch.setenv("COMP_WORDS", "shardplan estimate --ex")
    monkeypatch.setenv("COMP_CWORD", "2")
    assert command_names([]) == ["estimate"]
    monkeypatch.setenv("COMP_WORDS", "shardplan est")
    monkeypatch.setenv("COMP_CWORD", "1")
    assert command_names([]) == list(COMMANDS)  # completing the name itself
    monkeypatch.delenv("COMP_WORDS")
    monkeypatch.setenv("_SHARDPLAN_COMPLETE", "complete_zsh")
    monkeypatch.setenv("_TYPER_COMPLETE_ARGS", "shardplan schedule --sch")
    assert command_names([]) == ["schedule"]
    monkeypatch.setenv("_TYPER_COMPLETE_ARGS", "shardplan sche")
    assert command_names([]) == list(COMMANDS)


@pytest.mark.parametrize("words, cword, expected", [
    ("shardplan est", 1, "estimate"),
    ("shardplan estimate --ex", 2, "--explain"),
    ("shardplan schedule --sched", 2, "--schedule"),
])
def test_completion_answers(words, cword, expected):
    env = dict(os.environ, _SHARDPLAN_COMPLETE="complete_bash", COMP_WORDS=words, COMP_CWORD=str(cword))
    proc = subprocess.run([sys.executable, "-m", "shardplan"], capture_output=True, text=True, cwd=ROOT,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert expected in proc.stdout.split()


def test_validate_json_carries_the_error_document(write):
    good = write("good.toml", "[parallel]\ndp = 2\n")
    bad = write("bad.toml", "[parallel]\ndp = 0\n[train]\nseq_len = 0\n")
    result = run_cli("validate", good, bad, "--json")
    assert result.code == 2
    doc = result.json
    assert doc["valid"] is False and [f["valid"] for f in doc["files"]] == [True, False]
    assert doc["error"]["exit_code"] == 2
    assert [(p["file"], p["line"], p["path"]) for p in doc["error"]["problems"]] == [
        (bad, 2, "parallel.dp"), (bad, 4, "train.seq_len")]
    assert "error" not in run_cli("validate", good, "--json").json


def test_a_flag_is_not_a_file_in_the_error_document():
    """A problem with a command-line value: no file, the flag named (README)."""
    for args, flag in ((["estimate", "llama-3-8b-h100", "--set", "parallel.dp=0"], "--set"),
                       (["layout", "--dp", "0"], "--dp 0")):
        problem = run_cli(*args, "--json").json["error"]["problems"][0]
        assert (problem["file"], problem["flag"], problem["path"]) == (None, flag, "parallel.dp")
