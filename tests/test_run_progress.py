"""`shardplan run` shows rank 0's progress live on a terminal, and nothing off one or with
--json. The launcher reads rank 0's records from a file (io/progress.py): torchrun sends the
workers' stderr to logs."""

from __future__ import annotations

import json
import os
import pty
import subprocess
import sys

import pytest

from conftest import ROOT
from shardplan.io.progress import ProgressFile, ProgressReader


def test_records_cross_the_file_whole(tmp_path):
    path = tmp_path / "progress.jsonl"
    reader = ProgressReader(path)
    assert reader.poll() == []  # before rank 0 starts
    with ProgressFile(path, total=4, completed=1) as progress:
        progress.advance(2, 5.5, 1234.0)
        assert reader.poll() == [{"total": 4, "completed": 1}, {"step": 2, "loss": 5.5, "tokens_per_second": 1234.0}]
        with path.open("a") as half:  # a line caught while being written waits for its end
            half.write('{"step": 3, "loss"')
        assert reader.poll() == []
        with path.open("a") as rest:
            rest.write(': 5.0, "tokens_per_second": 1000.0}\n')
        assert reader.poll() == [{"step": 3, "loss": 5.0, "tokens_per_second": 1000.0}]
    with ProgressFile(path, total=4, completed=3):  # a restarted worker announces itself again
        pass
    assert reader.poll() == [{"total": 4, "completed": 3}]


def _run_on_terminal(*args: str) -> tuple[int, str, str]:
    """`shardplan run ARGS` with stderr on a pseudo-terminal (as a user sees it), stdout piped."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-m", "shardplan", "run", *args], stdout=subprocess.PIPE,
                            stderr=follower, text=True, cwd=ROOT, env=env)
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 65536)
        except OSError:  # the terminal closed with the last process
            break
        if not data:
            break
        chunks.append(data)
    out = proc.stdout.read()
    proc.wait(timeout=300)
    os.close(leader)
    return proc.returncode, out, b"".join(chunks).decode("utf-8", errors="replace")


RUN = ["tiny-gpt2-cpu", "--set", "train.steps=3"]


@pytest.mark.parametrize("cores, workers, threads", [(16, 1, 16), (16, 2, 8), (16, 3, 5), (2, 4, 1), (1, 1, 1)])
def test_workers_share_the_cores(monkeypatch, cores, workers, threads):
    """Each worker's torch gets its share of the launcher's cores (OMP_NUM_THREADS), as
    DeepSpeed's `--bind_cores_to_rank` gives them: a host optimizer on one core each, torchrun's
    own default, left a 16-core host idle (docs/validation.md, the CUDA offload runs)."""
    from shardplan.cli.run_cmd import threads_per_worker

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert threads_per_worker(workers) == threads


@pytest.mark.slow
def test_progress_is_live_on_a_terminal():
    pytest.importorskip("torch")
    code, out, err = _run_on_terminal(*RUN)
    assert code == 0, err[-3000:]
    assert "training" in err and "3/3" in err and "tokens/s" in err, err[-2000:]
    assert "estimate vs measured per rank" in out and "over 3 steps" in out  # the table after the bar


@pytest.mark.slow
def test_no_progress_with_json():
    pytest.importorskip("torch")
    code, out, err = _run_on_terminal(*RUN, "--json")
    assert code == 0, err[-3000:]
    assert "training" not in err
    assert len(json.loads(out)["steps"]) == 3


@pytest.mark.slow
def test_no_progress_off_a_terminal():
    pytest.importorskip("torch")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "shardplan", "run", *RUN], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training" not in proc.stderr and "over 3 steps" in proc.stdout
