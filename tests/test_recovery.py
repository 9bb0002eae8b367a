"""Long-job safety of `shardplan run`: checkpoints, resume, restart, preflight, timeouts.

Faults are injected with SHARDPLAN_INJECT_FAULT (runtime/faults.py): a rank is SIGKILLed at
a step or while writing a checkpoint, or stops answering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

JOB = """
[model]
preset = "{model}"
[parallel]
dp = 2
micro_batch_size = 4
[zero]
stage = 3
[train]
seq_len = 64
precision = "fp32"
steps = 6
lr = 1e-3
seed = 3
[checkpoint]
dir = "{folder}"
every = 2
keep = 2
"""


def shardplan_run(job: Path, *args: str, fault: str | None = None, timeout: int = 300):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK",
                                                             "SHARDPLAN_INJECT_FAULT")}
    if fault:
        env["SHARDPLAN_INJECT_FAULT"] = fault
    return subprocess.run([sys.executable, "-m", "shardplan", "run", str(job), *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=timeout)


def write_job(tmp_path: Path, name: str, model: str = "tiny-gpt2") -> tuple[Path, Path]:
    folder = tmp_path / f"{name}-checkpoints"
    job = tmp_path / f"{name}.toml"
    job.write_text(JOB.format(model=model, folder=folder), encoding="utf-8")
    return job, folder


def losses(report: Path) -> dict[int, float]:
    return {s["step"]: s["loss"] for s in json.loads(report.read_text())["steps"]}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, Path]:
    """A job run to its last step (6) with checkpoints, and its report."""
    tmp = tmp_path_factory.mktemp("uninterrupted")
    job, _ = write_job(tmp, "full")
    proc = shardplan_run(job, "--report", str(tmp / "full.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return job, tmp / "full.json"


@pytest.fixture(scope="module")
def uninterrupted(finished):
    return losses(finished[1])


@pytest.mark.parametrize("json_out", [False, True], ids=["table", "json"])
def test_resuming_a_finished_run_says_it_is_complete(finished, json_out):
    job, _ = finished
    proc = shardplan_run(job, "--resume", *(["--json"] if json_out else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "nan" not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    if json_out:
        doc = json.loads(proc.stdout)
        assert (doc["complete"], doc["step"], doc["steps"]) == (True, 6, [])
        assert doc["checkpoint"].endswith("step-00000006")
    else:
        assert proc.stdout.startswith("run complete: "), proc.stdout
        assert "step-00000006 is at step 6 of 6; nothing to train" in proc.stdout


def test_killed_rank_then_resume_continues_exactly(uninterrupted, tmp_path):
    job, folder = write_job(tmp_path, "killed")
    crashed = shardplan_run(job, fault="kill:step=5:rank=1")
    assert crashed.returncode == 3
    assert "killed by SIGKILL" in crashed.stderr and "Traceback" not in crashed.stderr
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000002", "step-00000004"]
    resumed = shardplan_run(job, "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(tmp_path / "resumed.json")
    assert sorted(after) == [5, 6]
    for step, loss in after.items():
        assert loss == uninterrupted[step]  # bit-exact on CPU in fp32


def test_crash_while_checkpointing_keeps_the_previous_one(uninterrupted, tmp_path):
    job, folder = write_job(tmp_path, "midsave")
    crashed = shardplan_run(job, fault="kill:checkpoint=4:rank=0")
    assert crashed.returncode == 3
    names = sorted(p.name for p in folder.iterdir())
    assert names == ["step-00000002", "step-00000004.partial"], names
    resumed = shardplan_run(job, "--resume", "--report", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    after = losses(tmp_path / "resumed.json")
    assert sorted(after) == [3, 4, 5, 6]
    assert all(after[s] == uninterrupted[s] for s in after)
    assert sorted(p.name for p in folder.iterdir()) == ["step-00000004", "step-00000006"]


def test_torchrun_restarts_from_the_last_checkpoint(uninterrupted, tmp_path):
    job, _ = write_job(tmp_path, "restart")
    proc = shardplan_run(job, "--max-restarts", "1", "--report", str(tmp_path / "r.json"), fault="kill:step=5:rank=1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["resumed_from"]["step"] == 4
    after = losses(tmp_path / "r.json")
    assert sorted(after) == [5, 6]  # the steps after the checkpoint, each once
    assert all(loss == uninterrupted[step] for step, loss in after.items())


def test_resume_into_another_layout(uninterrupted, tmp_path):
    job, folder = write_job(tmp_path, "reshard")
    first = shardplan_run(job, "--set", "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    # Written by dp2 (ZeRO-3); read by one rank with the whole batch (DCP reshards).
    proc = shardplan_run(job, f"--resume={folder / 'step-00000004'}", "--dp", "1",
                         "--set", "parallel.micro_batch_size=8", "--set", f"checkpoint.dir={tmp_path / 'other'}",
                         "--report", str(tmp_path / "r.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["resumed_from"]["resharded"] == "resharding from dp2 (ZeRO 3) to 1 rank (ZeRO 3)"
    for step, loss in losses(tmp_path / "r.json").items():
        assert abs(loss - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step])


PIPELINE = ("--pp", "2", "--dp", "1", "--set", "parallel.num_microbatches=2")  # the same 8 sequences a step


def test_pipeline_checkpoints_resume_and_reshard(finished, uninterrupted, tmp_path):
    """Pipeline ranks hold different parameters: the optimizer state is saved flattened by
    parameter name (torch's `flatten_optimizer_state_dict`, as torchtitan saves it under
    pipeline parallel), so a pp 2 run resumes on its own layout, and a dp 2 checkpoint of
    tiny-gpt2 (tied embeddings: no `lm_head` of its own) loads into pp 2, whose last stage
    takes its head copy and that copy's optimizer states from the embedding's."""
    job, folder = write_job(tmp_path, "pipeline")
    first = shardplan_run(job, *PIPELINE, "--set", "train.steps=4")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = shardplan_run(job, *PIPELINE, "--resume", "--report", str(tmp_path / "same.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    into_pp = shardplan_run(finished[0], *PIPELINE, f"--resume={finished[0].parent / 'full-checkpoints' / 'step-00000004'}",
                            "--set", f"checkpoint.dir={tmp_path / 'into-pp'}", "--report", str(tmp_path / "into.json"))
    assert into_pp.returncode == 0, into_pp.stderr[-3000:]
    resumed = json.loads((tmp_path / "into.json").read_text())["resumed_from"]
    assert resumed["resharded"] == "resharding from dp2 (ZeRO 3) to pp2 (ZeRO 3)" and resumed["checkpoint_lr"] is None
    for report in ("same.json", "into.json"):
        after = losses(tmp_path / report)
        assert sorted(after) == [5, 6]
        for step, loss in after.items():  # the dp 2 run's losses: the same sequences and updates
            assert abs(loss - uninterrupted[step]) <= 1e-5 * abs(uninterrupted[step]), (report, step)


def test_resume_takes_the_jobs_learning_rate(finished, uninterrupted, tmp_path):
    """The optimizer's saved learning rate is the job's of the day it was written; a resume with
    another `train.lr` (lowered after a divergence) trains at that one, and says so."""
    checkpoint = finished[0].parent / "full-checkpoints" / "step-00000004"
    proc = shardplan_run(finished[0], f"--resume={checkpoint}", "--set", "train.lr=5e-2",
                         "--set", f"checkpoint.dir={tmp_path / 'lr'}", "--report", str(tmp_path / "lr.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "learning rate: the job's 0.05; the checkpoint's optimizer had 0.001" in proc.stdout
    resumed = json.loads((tmp_path / "lr.json").read_text())["resumed_from"]
    assert (resumed["lr"], resumed["checkpoint_lr"]) == (5e-2, 1e-3)
    after = losses(tmp_path / "lr.json")
    assert after[5] == uninterrupted[5]  # step 5's loss comes before its update
    assert abs(after[6] - uninterrupted[6]) > 1e-3 * abs(uninterrupted[6])


def _snapshot(folder: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime for p in folder.rglob("*") if p.is_file()}


def test_unusable_checkpoints_are_refused(tmp_path):
    job, folder = write_job(tmp_path, "refuse")
    assert shardplan_run(job, "--set", "train.steps=2").returncode == 0
    before = _snapshot(folder)
    # Another model.
    other, _ = write_job(tmp_path, "other", model="tiny-llama")
    proc = shardplan_run(other, "--set", f"checkpoint.dir={folder}", "--resume")
    assert proc.returncode == 3 and "was written for another model" in proc.stderr
    # Corrupt: a shard file cut short.
    shard = next(folder.glob("step-*/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    before = _snapshot(folder)
    proc = shardplan_run(job, "--resume")
    assert proc.returncode == 3 and "cannot load" in proc.stderr and "Traceback" not in proc.stderr
    assert _snapshot(folder) == before  # nothing overwritten
    # Missing.
    proc = shardplan_run(job, "--set", f"checkpoint.dir={tmp_path / 'empty'}", "--resume")
    assert proc.returncode == 3 and "no complete checkpoint" in proc.stderr
    proc = shardplan_run(job, f"--resume={tmp_path / 'nowhere'}")  # refused before torchrun starts
    assert proc.returncode == 3 and proc.stderr == f"checkpoint: {tmp_path / 'nowhere'} is not a checkpoint folder\n"


def test_preflight_refuses_a_plan_that_does_not_fit(tmp_path):
    job, _ = write_job(tmp_path, "big", model="llama-3-70b")
    started = time.monotonic()
    proc = shardplan_run(job, "--set", "train.seq_len=128")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "preflight: the plan does not fit" in proc.stderr
    assert time.monotonic() - started < 120  # refused before building 70B parameters


def test_a_hung_collective_fails_within_the_timeout(tmp_path):
    job, _ = write_job(tmp_path, "hang")
    started = time.monotonic()
    proc = shardplan_run(job, "--set", "parallel.communication_timeout=5", fault="hang:step=2:rank=1", timeout=120)
    elapsed = time.monotonic() - started
    assert proc.returncode == 3
    assert "rank 0: a collective did not complete within communication_timeout (5 s) during step 2" in proc.stderr
    assert elapsed < 60
