"""The offload engine under `shardplan run` on CPU/gloo, dp2, ZeRO 1, 2 and 3, every mode with
and without compressed optimizer states: losses against the same stage without offload,
bytes by placement (device / host) against the estimate to the byte, and resuming from a
checkpoint bit for bit. All plans run in one torchrun launch (tests/dist/run_many.py)."""

from __future__ import annotations

import json
import os
import random
import struct
import subprocess

import pytest

from conftest import ROOT

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

STEPS = 10
JOB = """
[model]
preset = "tiny-gpt2"
[parallel]
dp = 2
micro_batch_size = {mbs}
num_microbatches = {m}
[zero]
stage = {stage}
[data]
path = "{data}"
dtype = "uint16"
[train]
seq_len = 64
precision = "fp32"
steps = {steps}
lr = 1e-3
seed = 7
[cluster]
gpus_per_node = 2
gpu_memory = "4GiB"
cpu_memory_per_node = "16GiB"
[offload]
{offload}
{checkpoint}
"""
MODES = {
    "o": "optimizer = true",
    "go": "optimizer = true\ngrads = true",
    # A sharded tiny-gpt2 layer holds 99,136 fp32 elements per rank (396,544 B): a budget of
    # 400,000 B keeps the first of the four layers on the device and offloads three.
    "p": "params = true\ngpu_param_budget = 400000",
    "po": "params = true\noptimizer = true\ngpu_param_budget = 400000",
}
# (stage, mode, compression, checkpointed): every mode each stage allows, with and without
# compression; every compression at every stage; checkpoints where `run` writes them (not
# ZeroRedundancyOptimizer's states, zero.stage 1).
CASES = [
    (1, "o", "none", False), (1, "o", "int8", False), (1, "o", "fp16", False),
    (1, "go", "none", False), (1, "go", "bf16", False),
    (2, "o", "none", False), (2, "o", "int8", True), (2, "o", "fp16", False),
    (2, "go", "none", True), (2, "go", "bf16", False),
    (3, "o", "none", False), (3, "o", "bf16", False),
    (3, "go", "none", False), (3, "go", "int8", True),
    (3, "p", "none", True), (3, "p", "fp16", False),
    (3, "po", "none", False), (3, "po", "bf16", True),
]
# Gradient accumulation (2 microbatches of 2, the same global batch): the device gradient
# copied once after the last microbatch ("o"), or freed after each and summed on the host ("go").
ACCUMULATING = [(1, "o"), (2, "o"), (3, "go")]

# fp32: the engine runs torch's fused CPU AdamW where the reference runs the single-tensor
# loop; the arithmetic differs only in rounding.
FP32_TOLERANCE = 1e-5
# Compressed states perturb each Adam update u = m / (sqrt(v) + eps) by at most the relative
# rounding error of m plus half that of v; to first order the loss reached after t steps then
# differs from the fp32 run's by at most that share of the progress made, loss_0 - loss_t
# (Adam's update is aligned with the gradient). The rounding errors:
# - bf16, stochastic rounding: below one unit in the last place, 2^-7 of the value;
# - fp16 with a per-block scale: 2^-10 for values within 2^14 of the block's absmax;
# - int8, the signed dynamic map (torchao create_dynamic_map): 64 codes spaced 0.9/64 over
#   [0.1, 1] of the block's absmax, half a step of 0.1 is 7%; the unsigned map's 128 codes, 3.5%.
UPDATE_ERROR = {"bf16": 1.5 * 2**-7, "fp16": 1.5 * 2**-10, "int8": 0.07 + 0.035 / 2}


def name(stage: int, mode: str, compression: str) -> str:
    return f"zero{stage}-{mode}-{compression}"


def _job(tmp, label: str, stage: int, offload: str, mbs: int = 4, m: int = 1, steps: int = STEPS,
         checkpoint: str = "") -> str:
    path = tmp / f"{label}.toml"
    path.write_text(JOB.format(stage=stage, offload=offload, mbs=mbs, m=m, steps=steps, checkpoint=checkpoint,
                               data=tmp / "tokens.bin"), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """Every plan's report, from one launch: the references (no offload), the cases, the
    accumulating runs, and the resumed halves of the checkpointed cases."""
    tmp = tmp_path_factory.mktemp("offload")
    # One sequence of seq_len + 1 tokens: every sample is that window, so each step trains on
    # the same batch and the loss falls step after step (the progress the tolerance scales with).
    tokens = random.Random(5).choices(range(512), k=65)
    (tmp / "tokens.bin").write_bytes(struct.pack("<65H", *tokens))
    plan = []

    def add(label: str, job: str, resume: str | None = None) -> None:
        plan.append({"job": job, "report": str(tmp / f"{label}.json"), "resume": resume})

    for stage in (1, 2, 3):
        add(f"reference{stage}", _job(tmp, f"reference{stage}", stage, ""))
    resumes = []
    for stage, mode, compression, checkpointed in CASES:
        label = name(stage, mode, compression)
        folder = tmp / f"{label}-checkpoints"
        checkpoint = f'[checkpoint]\ndir = "{folder}"\nevery = {STEPS // 2}\nkeep = 2' if checkpointed else ""
        offload = MODES[mode] + f'\ncpu_compression = "{compression}"'
        job = _job(tmp, label, stage, offload, checkpoint=checkpoint)
        add(label, job)
        if checkpointed:
            resumes.append((f"{label}-resumed", job, str(folder / f"step-{STEPS // 2:08d}")))
    for stage, mode in ACCUMULATING:
        label = f"zero{stage}-{mode}-accumulating"
        add(label, _job(tmp, label, stage, MODES[mode], mbs=2, m=2))
    for label, job, path in resumes:
        add(label, job, resume=path)
    plan_file = tmp / "plan.json"
    plan_file.write_text(json.dumps(plan), encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(["torchrun", "--nproc_per_node", "2", str(ROOT / "tests" / "dist" / "run_many.py"),
                           str(plan_file)], capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return {item["report"].rsplit("/", 1)[-1][:-5]: json.loads(open(item["report"]).read()) for item in plan}


def losses(report: dict) -> list[float]:
    return [s["loss"] for s in report["steps"]]


@pytest.mark.parametrize("stage, mode, compression", [c[:3] for c in CASES], ids=[name(*c[:3]) for c in CASES])
def test_losses_follow_the_run_without_offload(stage, mode, compression, reports):
    got, want = losses(reports[name(stage, mode, compression)]), losses(reports[f"reference{stage}"])
    assert len(got) == len(want) == STEPS
    for step, (a, b) in enumerate(zip(got, want)):
        allowed = FP32_TOLERANCE * abs(b)
        if compression != "none":
            allowed += UPDATE_ERROR[compression] * (want[0] - b)
        assert abs(a - b) <= allowed, (step + 1, got, want)


@pytest.mark.parametrize("stage, mode", ACCUMULATING, ids=[f"zero{s}-{m}" for s, m in ACCUMULATING])
def test_accumulated_gradients_follow_the_run_without_offload(stage, mode, reports):
    got, want = losses(reports[f"zero{stage}-{mode}-accumulating"]), losses(reports[f"reference{stage}"])
    for a, b in zip(got, want):
        assert abs(a - b) <= FP32_TOLERANCE * abs(b), (got, want)


PLACED = [name(*c[:3]) for c in CASES] + [f"zero{s}-{m}-accumulating" for s, m in ACCUMULATING]


@pytest.mark.parametrize("label", PLACED)
def test_bytes_by_placement_equal_the_estimate(label, reports):
    for entry in reports[label]["ranks"]:
        measured, estimated = entry["measured"], entry["estimated"]
        assert measured["placement"] == estimated["placement"], (entry["rank"], measured["placement"],
                                                                 estimated["placement"])
        for kind in ("params", "grads", "optimizer", "resident_layers"):
            assert measured[kind] == estimated[kind], (entry["rank"], kind)


def test_each_mode_moves_what_it_says(reports):
    """Optimizer states leave the device in every mode; device gradients go with `grads`
    (except under DDP's buckets, stage 1); parameters only with `params`."""
    for stage, mode, compression, _ in CASES:
        placement = reports[name(stage, mode, compression)]["ranks"][0]["measured"]["placement"]
        assert placement["optimizer"]["host"] > 0
        if "o" in mode:
            assert placement["optimizer"]["device"] == 0 and placement["grads"]["host"] > 0
        frees = "g" in mode and stage != 1
        assert (placement["grads"]["device"] == 0) == frees, (stage, mode, placement)
        assert (placement["params"]["host"] > 0) == ("p" in mode), (stage, mode, placement)


def test_compression_shrinks_the_host_states(reports):
    """int8 stores 1 byte and a 4-byte scale per 256 elements, bf16 and fp16 2 bytes, fp32 4
    (two moments each, beside the same fp32 master and steps)."""
    host = {c: reports[name(2, "o", c) if c != "bf16" else name(2, "go", c)]["ranks"][0]["measured"]["placement"]
            ["optimizer"]["host"] for c in ("none", "int8", "fp16", "bf16")}
    assert host["int8"] < host["fp16"] < host["none"] and host["bf16"] < host["none"]


RESUMED = [name(*c[:3]) for c in CASES if c[3]]


@pytest.mark.parametrize("label", RESUMED)
def test_resume_continues_bit_for_bit(label, reports):
    full, resumed = reports[label], reports[f"{label}-resumed"]
    assert resumed["resumed_from"]["step"] == STEPS // 2
    after = {s["step"]: s["loss"] for s in resumed["steps"]}
    assert sorted(after) == list(range(STEPS // 2 + 1, STEPS + 1))
    for step in after:
        assert after[step] == full["steps"][step - 1]["loss"], (label, step)
