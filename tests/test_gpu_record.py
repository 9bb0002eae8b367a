"""The estimate against the allocator peaks measured on an H100 (docs/validation.md, "CUDA";
benchmarks/data/gpu-ladder-h100.json, written by benchmarks/gpu_ladder.py): each recorded
job, estimated by this code, is held to what `torch.cuda.max_memory_allocated` measured. No
GPU is needed: the measurements are data; a change to the estimate that moves it away from
them fails here."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from conftest import ROOT
from shardplan.core.buffers import allowances_in
from shardplan.core.estimate import rank_coordinates, rank_estimate
from shardplan.core.estimate_inputs import inputs_from_job
from shardplan.core.memory import estimate_memory
from shardplan.core.timeline import BACKWARD, BACKWARD_END, LOSS, STEP
from shardplan.io.job import load_job

RECORD = json.loads((ROOT / "benchmarks" / "data" / "gpu-ladder-h100.json").read_text())
# The tiny model is left out: 70 MiB the allocator holds beside it (cuBLAS workspaces, the
# batch) are half its peak (docs/validation.md).
RUNS = [r for r in RECORD["records"] if "run" in r and not r["name"].startswith("tiny")]


def allowance(terms) -> int:
    return sum(allowances_in(terms).values())


def estimate_of(record: dict, tmp_path):
    job = tmp_path / "job.toml"
    job.write_text(record["job"], encoding="utf-8")
    resolved = load_job(str(job), [], env={})
    inputs = estimate_memory(replace(inputs_from_job(resolved.job, resolved.shape, True), on_gpu=True)).inputs
    return rank_estimate(inputs, rank_coordinates(inputs, 0), [0])


def test_the_record_covers_the_ladder():
    assert RECORD["device"].startswith("NVIDIA H100") and len(RUNS) == 20
    assert {r["job"].split('preset = "')[1].split('"')[0] for r in RUNS} == {"gpt2", "gpt2-medium", "gpt2-large",
                                                                               "gpt2-xl"}


@pytest.mark.parametrize("record", RUNS, ids=[r["name"] for r in RUNS])
def test_estimate_holds_to_the_measured_allocator_peak(record, tmp_path):
    device = estimate_of(record, tmp_path)
    measured = record["run"]["measured"]
    # The peak less the allowances against max_memory_allocated: measured within -1.0% to
    # +0.4% (docs/validation.md); held here to 1.5%.
    peak = device.gpu["total"] - allowance(device.terms["gpu.buffers"])
    assert peak == pytest.approx(measured["peak_device"], rel=0.015)
    # The backward phase (the loss moment, each layer's backward, its end) and the optimizer
    # step, each the allocator's peak in that phase of one step (runtime/measure.py CudaMemory).
    moments = {m.name: m.total - allowance(m.terms["buffers"]) for m in device.moments}
    backward = max(moments.get(name, 0) for name in (LOSS, BACKWARD, BACKWARD_END))
    assert backward == pytest.approx(measured["phases"]["backward"], rel=0.015)
    assert moments[STEP] == pytest.approx(measured["phases"]["step"], rel=0.06)
    # Parameters, gradients and optimizer states by placement: what the rank held.
    for kind in ("params", "grads", "optimizer"):
        assert (device.states[kind], device.cpu[kind]) == (measured["placement"][kind]["device"],
                                                           measured["placement"][kind]["host"]), kind


def test_the_ladder_prints_the_recorded_table():
    """benchmarks/gpu_ladder.py --from renders the recorded runs without a GPU (the table of
    docs/validation.md): one row per record, each with its measured allocated peak."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "benchmarks/gpu_ladder.py", "--from",
                           "benchmarks/data/gpu-ladder-h100.json"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) == len(RECORD["records"])
    for row, record in zip(rows, RECORD["records"]):
        measured = record["run"]["measured"]["peak_device"] / 2**30
        assert row.startswith(f"| {record['name']} |") and f"/ {measured:.2f} GiB" in row, row


# Fine-tuning on the same H100 (docs/validation.md, "Fine-tuning on one GPU";
# benchmarks/data/gpu-finetune-h100.json): QLoRA of Llama-3 8B at micro batch 1, 4 and 18 and
# of Llama-3 70B at micro batch 1, LLaMA 65B at 512 tokens, the tests/test_run_gpu.py LoRA, QLoRA, AdamW8bit and fp16 host-state plans.
FINETUNE = json.loads((ROOT / "benchmarks" / "data" / "gpu-finetune-h100.json").read_text())


def test_the_finetune_record_covers_qlora_at_full_scale():
    assert FINETUNE["device"].startswith("NVIDIA H100") and len(FINETUNE["runs"]) == 9
    for preset, runs in (("llama-3-8b", 3), ("llama-3-70b", 1)):
        assert sum(f'preset = "{preset}"' in r["job"] and 'base_dtype = "nf4"' in r["job"]
                   for r in FINETUNE["runs"].values()) == runs
    # LLaMA 65B at 512 tokens: small activations beside the adapters' gradients, so the peak
    # is backward through the sweep's last layer (core/estimate.py last_layer_backward).
    assert sum("hidden_size = 8192" in r["job"] and "ffn_hidden_size = 22016" in r["job"]
               for r in FINETUNE["runs"].values()) == 1


@pytest.mark.parametrize("name", list(FINETUNE["runs"]))
def test_estimate_holds_to_the_measured_finetune_runs(name, tmp_path):
    record = FINETUNE["runs"][name]
    device = estimate_of(record, tmp_path)
    measured = record["ranks"][0]["measured"]
    # The allocated peak: measured -1.7% to +0.7% (docs/validation.md); held here to 2%.
    # The LLaMA 65B run was -2.3% before the estimate counted the sweep's last layer, -0.3% with it.
    peak = device.gpu["total"] - allowance(device.terms["gpu.buffers"])
    assert peak == pytest.approx(measured["peak_device"], rel=0.02)
    # Saved activations (LoRA's inputs and dropout masks at CUDA's 1 byte): measured within 0.15%.
    assert device.saved_activations == pytest.approx(measured["activations"], rel=0.01)
    # The NF4 base (codes, block scales, their quantized scales), the adapters, their
    # gradients and AdamW (or 8-bit AdamW, or fp16 host) states, by placement, to the byte.
    for kind in ("params", "grads", "optimizer"):
        assert (device.states[kind], device.cpu[kind]) == (measured["placement"][kind]["device"],
                                                           measured["placement"][kind]["host"]), kind
