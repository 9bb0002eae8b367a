"""`shardplan run` on CPU/gloo: each plan against a single-process run on the same global
batch (fp32 losses within 1e-5 relative), and measured bytes against the estimate
(parameters, gradients and optimizer states to the byte, saved activations within 5%)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytest.importorskip("torch")
pytestmark = pytest.mark.slow

# Every plan trains on the same global batch: 8 sequences of 64 tokens per step.
COMMON = """
[parallel]
micro_batch_size = {mbs}
num_microbatches = {m}
[train]
seq_len = 64
precision = "fp32"
steps = 3
lr = 1e-3
seed = 7
[cluster]
gpus_per_node = 4
gpu_memory = "4GiB"
cpu_memory_per_node = "16GiB"
"""
LOSS_TOLERANCE = 1e-5
ACTIVATION_TOLERANCE = 0.05


def run(model: str, mbs: int, m: int, *flags: str, tmp_path, name: str, extra: str = "") -> dict:
    """Run a job (model: a preset name, or an inline [model] table) and return its report."""
    job = tmp_path / f"{name}.toml"
    table = model if model.startswith("[model]") else f'[model]\npreset = "{model}"\n'
    job.write_text(table + COMMON.format(mbs=mbs, m=m) + extra, encoding="utf-8")
    report = tmp_path / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run(
        [sys.executable, "-m", "shardplan", "run", str(job), "--report", str(report), *flags],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(report.read_text())


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reference")
    return {
        "tiny-gpt2": run("tiny-gpt2", 8, 1, tmp_path=tmp, name="gpt2"),
        "tiny-llama": run("tiny-llama", 8, 1, tmp_path=tmp, name="llama"),
    }


PLANS = [
    # (id, model, micro batch, microbatches, flags)
    ("dp2-zero0", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "0"]),
    ("dp2-zero1", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "1"]),
    ("dp2-zero2", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "2"]),
    ("dp2-zero3", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "3"]),
    ("dp2-zero3-offload", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "3", "--set", "offload.params=true",
                                              "--set", "offload.gpu_param_budget=120000"]),
    ("tp2", "tiny-llama", 8, 1, ["--tp", "2", "--zero", "3"]),
    ("pp2-gpipe", "tiny-llama", 2, 4, ["--pp", "2", "--set", "parallel.pipeline_schedule=gpipe"]),
    ("pp2-1f1b", "tiny-llama", 2, 4, ["--pp", "2", "--set", "parallel.pipeline_schedule=1f1b"]),
    ("pp2-interleaved", "tiny-llama", 2, 4, ["--pp", "2", "--set", "parallel.pipeline_schedule=interleaved-1f1b",
                                             "--set", "parallel.virtual_stages=2"]),
    # torch's interleaved 1F1B with fewer microbatches than pp: one round of 1 (torch 2.13
    # ScheduleInterleaved1F1B's max(1, m // pp) rounds).
    ("pp2-interleaved-m1", "tiny-llama", 8, 1, ["--pp", "2", "--set", "parallel.pipeline_schedule=interleaved-1f1b",
                                                "--set", "parallel.virtual_stages=2"]),
    ("dp2-tp2", "tiny-llama", 4, 1, ["--dp", "2", "--tp", "2", "--zero", "3"]),
    # Hybrid sharding: 2 "nodes" of 2 ranks, sharded inside a node, replicated across.
    ("dp4-hybrid", "tiny-gpt2", 2, 1, ["--dp", "4", "--zero", "3", "--set", "zero.hybrid=true",
                                       "--set", "cluster.gpus_per_node=2", "--set", "cluster.nodes=2"]),
    # GPT-2 ties its head to the embedding: the last stage keeps a copy, gradients summed.
    ("pp2-tied", "tiny-gpt2", 2, 4, ["--pp", "2"]),
    ("dp2-selective", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "3", "--set", "train.activation_checkpointing=selective",
                                          "--set", "train.attention=eager"]),
    ("dp2-full-recompute", "tiny-llama", 4, 1, ["--dp", "2", "--zero", "3",
                                                "--set", "train.activation_checkpointing=full"]),
    # The offload strategy decides (24 MiB "GPUs"): 2 of 4 layers stay resident; the run
    # builds, checks and reports that decision.
    ("dp2-strategy-offload", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "3", "--set", "cluster.gpu_memory=24MiB",
                                                 "--set", "cluster.gpus_per_node=2"]),
    # A budget of one layer per rank over two chunks: one block resident in all, not one per chunk.
    ("pp2-interleaved-offload", "tiny-llama", 2, 4, ["--pp", "2", "--zero", "3",
                                                     "--set", "parallel.pipeline_schedule=interleaved-1f1b",
                                                     "--set", "parallel.virtual_stages=2", "--set", "offload.params=true",
                                                     "--set", "offload.gpu_param_budget=800000"]),
    # Pipeline stages under DDP (ZeRO-1) with tied embeddings: 4 ranks.
    ("pp2-dp2-zero1-tied", "tiny-gpt2", 1, 4, ["--pp", "2", "--dp", "2", "--zero", "1"]),
]


# Mixed precision: bytes against the estimate only (the fp32 reference does not apply).
MIXED_PLANS = [
    ("dp2-zero0-bf16", "tiny-gpt2", 4, 1, ["--dp", "2", "--zero", "0", "--set", "train.precision=bf16-mixed"]),
    ("dp2-zero1-bf16-autocast", "tiny-llama", 4, 1, ["--dp", "2", "--zero", "1",
                                                     "--set", "train.precision=bf16-mixed"]),
    ("dp2-zero3-bf16", "tiny-llama", 4, 1, ["--dp", "2", "--zero", "3", "--set", "train.precision=bf16-mixed"]),
]


@pytest.mark.parametrize("name, model, mbs, m, flags", MIXED_PLANS, ids=[p[0] for p in MIXED_PLANS])
def test_mixed_precision_matches_estimate(name, model, mbs, m, flags, tmp_path):
    report = run(model, mbs, m, *flags, tmp_path=tmp_path, name=name)
    losses = [s["loss"] for s in report["steps"]]
    assert losses[-1] < losses[0]
    for entry in report["ranks"]:
        measured, estimated = entry["measured"], entry["estimated"]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == estimated[kind], (entry["rank"], kind)
        error = abs(measured["activations"] - estimated["activations"]) / measured["activations"]
        assert error <= ACTIVATION_TOLERANCE, (entry["rank"], measured["activations"], estimated["activations"])


@pytest.mark.parametrize("name, model, mbs, m, flags", PLANS, ids=[p[0] for p in PLANS])
def test_plan_matches_reference_and_estimate(name, model, mbs, m, flags, references, tmp_path):
    report = run(model, mbs, m, *flags, tmp_path=tmp_path, name=name)
    reference = [s["loss"] for s in references[model]["steps"]]
    losses = [s["loss"] for s in report["steps"]]
    for got, want in zip(losses, reference):
        assert abs(got - want) <= LOSS_TOLERANCE * abs(want), (losses, reference)
    for entry in report["ranks"]:
        measured, estimated = entry["measured"], entry["estimated"]
        for kind in ("params", "grads", "optimizer", "resident_layers", "placement"):
            assert measured[kind] == estimated[kind], (entry["rank"], kind, measured, estimated)
        error = abs(measured["activations"] - estimated["activations"]) / measured["activations"]
        assert error <= ACTIVATION_TOLERANCE, (entry["rank"], measured["activations"], estimated["activations"])


def test_loss_falls(references):
    losses = [s["loss"] for s in references["tiny-gpt2"]["steps"]]
    assert losses[-1] < losses[0]


def test_report_document(references):
    report = references["tiny-llama"]
    assert report["schema_version"] == 1 and report["world_size"] == 1 and report["device"] in ("cpu", "cuda")
    assert report["tokens_per_second"] > 0
    # One worker gets every core this process may use (cli/run_cmd.py threads_per_worker),
    # unless the caller set its own OMP_NUM_THREADS.
    assert report["cpu_threads"] == int(os.environ.get("OMP_NUM_THREADS") or len(os.sched_getaffinity(0)))
    rank = report["ranks"][0]
    keys = {"params", "grads", "optimizer", "activations", "peak_device", "resident_layers", "placement"}
    cuda = {"reserved_device", "device_used", "context", "device_capacity", "alloc_retries", "phases"}
    assert set(rank["measured"]) == (keys | cuda if report["device"] == "cuda" else keys)
    assert set(rank["estimated"]) == keys | {"peak_moment", "allowances", "phases"}
    # The CUDA allowances apply on a GPU only; the phases are the step's forward, backward and
    # optimizer step (runtime/train.py estimated_phases).
    assert (rank["estimated"]["allowances"] == {}) == (report["device"] == "cpu")
    assert set(rank["estimated"]["phases"]) == {"forward", "backward", "step"}
    # Without offload everything is on the device (CONTRACT: placement, measured and estimated).
    for side in ("measured", "estimated"):
        assert rank[side]["placement"] == {kind: {"device": rank[side][kind], "host": 0}
                                           for kind in ("params", "grads", "optimizer")}
    assert rank["estimated"]["peak_moment"] in ("forward", "loss", "backward", "backward end", "step")


@pytest.mark.parametrize("preset,pp,recompute", [("tiny-llama", 1, "none"), ("tiny-gpt2", 2, "full"),
                                                 ("gpt2", 1, "selective")])
def test_estimated_phases_hold_the_peak(preset, pp, recompute):
    """On a GPU the report compares the allocator's peak with the estimate's peak less its
    allowances; the phases it reads are the estimate's moments less theirs, so the largest
    phase is that peak (the allowances grow with the tensors: the peak moment stays the peak)."""
    from dataclasses import replace

    from shardplan.core.estimate import rank_coordinates, rank_estimate
    from shardplan.core.estimate_inputs import inputs_from_job
    from shardplan.core.memory import estimate_memory
    from shardplan.io.job import load_job
    from shardplan.runtime.train import estimated_phases, rank_estimates

    resolved = load_job(None, [("model.preset", preset), ("parallel.pp", pp), ("parallel.num_microbatches", 4),
                               ("train.seq_len", 128), ("train.activation_checkpointing", recompute),
                               ("cluster.gpu_memory", "80GiB")], env={})
    inputs = estimate_memory(replace(inputs_from_job(resolved.job, resolved.shape, True), on_gpu=True)).inputs
    for rank in range(pp):
        device = rank_estimate(inputs, rank_coordinates(inputs, rank), [rank])
        figures = rank_estimates(device, on_gpu=True)
        assert set(figures["allowances"]) == {"CUDA context", "allocator fragmentation"}
        assert max(estimated_phases(device).values()) == figures["peak_device"]
        assert figures["peak_device"] == device.gpu["total"] - sum(figures["allowances"].values())


def test_token_file(tmp_path):
    import struct

    tokens = tmp_path / "tokens.bin"
    tokens.write_bytes(struct.pack("<4096H", *[(7 * i) % 512 for i in range(4096)]))
    job = tmp_path / "data.toml"
    job.write_text('[model]\npreset = "tiny-gpt2"\n' + COMMON.format(mbs=8, m=1)
                   + f'[data]\npath = "{tokens}"\ndtype = "uint16"\n', encoding="utf-8")
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    ok = subprocess.run([sys.executable, "-m", "shardplan", "run", str(job)], capture_output=True, text=True,
                        cwd=ROOT, env=env, timeout=300)
    assert ok.returncode == 0, ok.stderr[-3000:]
    tokens.write_bytes(struct.pack("<4096H", *[1000] * 4096))  # outside the 512-token vocabulary
    bad = subprocess.run([sys.executable, "-m", "shardplan", "run", str(job)], capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=300)
    assert bad.returncode == 2 and "outside the vocabulary (512)" in bad.stderr, bad.stderr[-2000:]  # bad input


# torch's DTensor sequence parallel (tiny Llama, tp 2, micro batch 8, fp32, ZeRO-3).
SEQUENCE_PARALLEL = ("tp2-sequence-parallel", "tiny-llama", 8, 1,
                     ["--tp", "2", "--zero", "3", "--set", "parallel.sequence_parallel=true"])


def gathered_inputs_bytes(model: str, mbs: int, tp: int) -> int:
    """What torch's sequence parallel keeps beyond the paper: the gathered inputs of the QKV,
    MLP and head linears, whole instead of 1/tp (ActivationShape.keeps_gathered), fp32."""
    from shardplan.core.activations import ActivationShape, head_terms, stored_layer_terms
    from shardplan.io.job import load_job

    shape = load_job(None, [("model.preset", model)], env={}).shape
    paper = ActivationShape(shape, mbs, 64, tp=tp, sequence_parallel=True, act_bytes=4)
    torch_sp = ActivationShape(shape, mbs, 64, tp=tp, sequence_parallel=True, act_bytes=4, keeps_gathered=True)
    extra = shape.num_layers * (sum(t.bytes for t in stored_layer_terms(torch_sp))
                                - sum(t.bytes for t in stored_layer_terms(paper)))
    return extra + sum(t.bytes for t in head_terms(torch_sp)) - sum(t.bytes for t in head_terms(paper))


def test_sequence_parallel_keeps_the_gathered_inputs(references, tmp_path):
    """torch's sequence parallel trains the same model; its linears keep the gathered inputs,
    which the paper's formula (the estimate, CONTRACT) leaves out: the measurement equals the
    estimate plus exactly those tensors (ActivationShape.keeps_gathered), within 5%."""
    name, model, mbs, m, flags = SEQUENCE_PARALLEL
    report = run(model, mbs, m, *flags, tmp_path=tmp_path, name=name)
    reference = [s["loss"] for s in references[model]["steps"]]
    for step, want in zip(report["steps"], reference):
        assert abs(step["loss"] - want) <= LOSS_TOLERANCE * abs(want)
    extra = gathered_inputs_bytes(model, mbs, 2)
    assert extra > 0
    for entry in report["ranks"]:
        measured, estimated = entry["measured"], entry["estimated"]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == estimated[kind]
        expected = estimated["activations"] + extra
        assert abs(measured["activations"] - expected) / measured["activations"] <= ACTIVATION_TOLERANCE


# Fine-tuning at dp 2 under ZeRO-3 (bf16 mixed precision, as fine-tuning runs): peft's LoRA,
# QLoRA with torchao's NF4 base, torchao's 8-bit AdamW. A model whose layer linears torchao can
# store as NF4 and FSDP2 split in two (64 * 256 * 2 elements each).
FINETUNE_MODEL = """[model]
family = "llama"
num_layers = 2
hidden_size = 256
num_heads = 4
num_kv_heads = 2
ffn_hidden_size = 512
vocab_size = 512
max_seq_len = 128
"""
LORA = dict(rank=8, dropout=0.1, targets=["q_proj", "v_proj", "o_proj", "up_proj", "down_proj"])
FINETUNE = [
    # (id, [lora] table or None, micro batch, flags); each step trains on 8 sequences
    ("dp2-zero3-lora", LORA, 4, ["--dp", "2"]),
    ("dp2-zero3-qlora", dict(rank=16, base_dtype="nf4"), 4, ["--dp", "2"]),
    # One rank: FSDP2 would skip the all-gather NF4Tensor needs; the NF4 weights are left out
    # of it, whole (runtime/parallel.py kept_whole).
    ("dp1-qlora", dict(rank=16, base_dtype="nf4"), 8, ["--dp", "1"]),
    ("dp2-zero3-adamw8bit", None, 4, ["--dp", "2", "--set", "train.optimizer=adamw8bit"]),
    # Tensor parallel splits the adapters with their linears (B of q/v/up, A of o/down).
    ("tp2-zero3-lora", LORA, 8, ["--tp", "2"]),
]


def toml_table(name: str, table: dict | None) -> str:
    if table is None:
        return ""
    return f"[{name}]\n" + "".join(f"{key} = {json.dumps(value)}\n" for key, value in table.items())


@pytest.mark.parametrize("name, lora, mbs, flags", FINETUNE, ids=[p[0] for p in FINETUNE])
def test_finetune_matches_estimate(name, lora, mbs, flags, tmp_path):
    pytest.importorskip("peft")
    pytest.importorskip("torchao")
    report = run(FINETUNE_MODEL, mbs, 1, "--zero", "3", "--set", "train.precision=bf16-mixed",
                 "--set", "train.steps=4", "--set", "train.lr=1e-2", *flags, tmp_path=tmp_path, name=name,
                 extra=toml_table("lora", lora))
    losses = [s["loss"] for s in report["steps"]]
    assert losses[-1] < losses[0], losses
    tp = 2 if "--tp" in flags else 1
    cpu_masks = dropout_mask_bytes(lora, mbs, tp)
    for entry in report["ranks"]:
        measured, estimated = entry["measured"], entry["estimated"]
        for kind in ("params", "grads", "optimizer"):
            assert measured[kind] == estimated[kind], (entry["rank"], kind, measured, estimated)
        expected = estimated["activations"] + cpu_masks
        assert abs(measured["activations"] - expected) / measured["activations"] <= ACTIVATION_TOLERANCE, \
            (entry["rank"], measured["activations"], expected)


def dropout_mask_bytes(lora: dict | None, mbs: int, tp: int) -> int:
    """On CPU torch's dropout keeps its noise in the input's dtype (bf16 here) where CUDA's
    fused kernel keeps a 1-byte mask, which the estimate counts: one more byte per masked
    element (aten/src/ATen/native/Dropout.cpp, `is_fused_kernel_acceptable`)."""
    if not lora or not lora.get("dropout"):
        return 0
    from shardplan.core.activations import ActivationShape, stored_layer_terms
    from shardplan.core.lora import LoraPlan
    from shardplan.spec.model import resolve_shape

    table = dict(line.split(" = ") for line in FINETUNE_MODEL.splitlines()[1:])
    shape, _ = resolve_shape({k: json.loads(v) for k, v in table.items()})
    plan = LoraPlan(rank=lora["rank"], targets=tuple(lora["targets"]), dropout=True)
    act = ActivationShape(shape, mbs, 64, tp=tp, act_bytes=2, lora=plan)
    layers = [stored_layer_terms(act, grad_in=False)] + [stored_layer_terms(act)] * (shape.num_layers - 1)
    return sum(t.bytes for terms in layers for t in terms if "dropout mask" in t.label)
