"""LoRA / QLoRA / 8-bit AdamW in the planning commands (no torch): counts, states, validation,
and what `run` refuses before starting."""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.lora import LoraPlan, lora_counts
from shardplan.core.degrees import Degrees
from shardplan.core.memory import estimate_memory
from shardplan.core.quantized import adamw8bit_bytes, nf4_bytes
from shardplan.io.job import load_job

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def shape(preset: str):
    return load_job(None, [("model.preset", preset)], env={}).shape


def inputs(preset: str, **changes) -> EstimateInputs:
    base = dict(shape=shape(preset), params=None, degrees=Degrees(dp=changes.pop("dp", 1)), on_gpu=False)
    return EstimateInputs(**{**base, **changes})


def test_llama_3_70b_counts():
    """Hu et al. 2021 count r * (in + out) per adapted matrix: for Llama-3 70B (80 layers,
    hidden 8192, 8 KV heads of 128, MLP 28672) at r = 16 on all seven linears that is
    80 * 16 * (2*8192 + 2*(8192 + 1024) + 2*8192 + 3*(8192 + 28672)) = 207,093,760."""
    counts = lora_counts(shape("llama-3-70b"), LoraPlan(rank=16, targets=ALL))
    assert counts.trainable == 80 * 16 * (2 * 8192 + 2 * (8192 + 1024) + 2 * 8192 + 3 * (8192 + 28672))
    assert counts.total == 70_553_706_496 + counts.trainable  # the preset's source: the HF config's count


def test_estimate_json_reports_the_adapters_as_trainable():
    result = run_cli("estimate", "llama-3-8b-h100", "--set", "lora.rank=16", "--json")
    assert result.code == 0, result.err
    params = result.json["params"]
    counts = lora_counts(shape("llama-3-8b"), LoraPlan(rank=16, targets=("q_proj", "k_proj", "v_proj", "o_proj")))
    assert params["trainable"] == counts.trainable and params["total"] == counts.total


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_frozen_base_has_no_gradients_or_optimizer_states(stage):
    """fsdp2, fp32 adapters (bf16-mixed): the optimizer holds two fp32 moments and a step per
    adapter tensor and nothing for the base; gradients exist only for the adapters."""
    plan = LoraPlan(rank=8, targets=("q_proj", "v_proj"))
    est = estimate_memory(inputs("llama-3-8b", dp=8, zero_stage=stage, lora=plan))
    device = est.devices[0]
    trainable = lora_counts(shape("llama-3-8b"), plan).trainable
    per_rank = trainable if stage == 0 else trainable // 8  # r = 8 rows split evenly over 8
    assert device.states["optimizer"] == 2 * 4 * per_rank + 4 * 2 * 2 * 32
    full = estimate_memory(inputs("llama-3-8b", dp=8, zero_stage=stage))
    assert device.states["params"] < full.devices[0].states["params"] / 1.9  # bf16 base vs fp32


def test_zero_paper_lora_states():
    """The paper's 16 bytes per trainable parameter (Rajbhandari et al. 2019, 3.1) over the
    adapters, the frozen base at 2 bytes, all divided by dp at stage 3."""
    plan = LoraPlan(rank=16, targets=ALL)
    est = estimate_memory(inputs("llama-3-70b", dp=8, zero_stage=3, framework="zero-paper", lora=plan))
    counts = lora_counts(shape("llama-3-70b"), plan)
    states = est.devices[0].states
    base = counts.total - counts.trainable
    assert states["grads"] + states["optimizer"] == pytest.approx(14 * counts.trainable / 8, rel=1e-4)
    assert states["params"] == pytest.approx((2 * base + 2 * counts.trainable) / 8, rel=1e-4)


def test_deepspeed_offload_param_puts_the_frozen_base_on_the_host():
    """ZeRO-3 with offload_param: zero.Init takes offload_param.device as its remote device and
    allocates every parameter's partition there, frozen or not (DeepSpeed
    runtime/zero/partition_parameters.py, `Init.__init__`: remote_device =
    offload_param.device; `_partition_param`: the partition on remote_device), ceil(numel / dp)
    bf16 elements of each tensor. The exception is a persistent tensor, of at most
    stage3_param_persistence_threshold (1e5) elements: its partition is allocated on the local
    device (`_partition_param`, `if param.ds_persist: device = self.local_device`) and, frozen,
    never moves to the optimizer's host buffer; and it is kept whole besides
    (`ds_persist`, partition_parameters.py line 1292: `ds_numel <= param_persistence_threshold`).
    In llama-3-8b those are the 65 RMSNorm weights of 4,096 elements (transformers
    LlamaRMSNorm); every linear and the embeddings are larger."""
    from shardplan.core.stages import rank_params

    plan = LoraPlan(rank=16, targets=ALL)
    common = dict(dp=8, zero_stage=3, framework="deepspeed", lora=plan, offload_optimizer=True)
    on_gpu = estimate_memory(inputs("llama-3-8b", **common)).devices[0]
    offloaded = estimate_memory(inputs("llama-3-8b", offload_params=True, **common)).devices[0]
    rp = rank_params(shape("llama-3-8b"), 1, 1, 0, 1, 0)
    base = rp.num_layers * sum(-(-p.numel // 8) for p in rp.layer) + sum(-(-p.numel // 8) for p in rp.root)
    norms = 65 * 4096  # 2 per layer and the final norm
    norm_parts = 65 * (4096 // 8)

    def frozen(device, where):
        return sum(t.bytes for t in device.terms[f"{where}.params"] if t.label.startswith("frozen base"))

    assert frozen(on_gpu, "gpu") == 2 * (base + norms) and frozen(on_gpu, "cpu") == 0
    assert frozen(offloaded, "gpu") == 2 * (norms + norm_parts)
    assert frozen(offloaded, "cpu") == 2 * (base - norm_parts)
    assert on_gpu.states["params"] - offloaded.states["params"] > 2 * base  # the adapters' partitions too
    assert sum(t.bytes for t in offloaded.host) - sum(t.bytes for t in on_gpu.host) >= 2 * base


def test_qlora_base_is_a_quarter_of_bf16():
    """NF4 stores about 4.13 bits per weight with double quantization (Dettmers et al. 2023,
    section 3: 4 + 8/64 + 32/(64*256) bits; torchao's factors are bf16: 4 + 0.125 + 0.001)."""
    assert nf4_bytes(8192 * 28672) / (8192 * 28672) == pytest.approx(0.5 + 1 / 64 + 2 / 16384, abs=1e-6)
    nf4 = estimate_memory(inputs("llama-3-70b", dp=8, zero_stage=3, lora=LoraPlan(16, ALL, "nf4")))
    bf16 = estimate_memory(inputs("llama-3-70b", dp=8, zero_stage=3, lora=LoraPlan(16, ALL, "bf16")))
    assert nf4.devices[0].states["params"] < 0.35 * bf16.devices[0].states["params"]


def test_adamw8bit_full_training_states():
    """Every tensor of a one-layer view: fsdp2 stage 0 keeps whole tensors, each with its own
    8-bit moments or plain ones (core/quantized.py, checked against torchao in test_quantized)."""
    from shardplan.core.stages import rank_params

    est = estimate_memory(inputs("tiny-llama", optimizer="adamw8bit", precision="fp32"))
    rp = rank_params(shape("tiny-llama"), 1, 1, 0, 1, 0)
    expected = rp.num_layers * sum(adamw8bit_bytes(p.numel, 4) for p in rp.layer) \
        + sum(adamw8bit_bytes(p.numel, 4) for p in rp.root)
    assert est.devices[0].states["optimizer"] == expected
    adamw = estimate_memory(inputs("tiny-llama", optimizer="adamw", precision="fp32"))
    assert expected < 0.4 * adamw.devices[0].states["optimizer"]


@pytest.mark.parametrize("framework", ["deepspeed", "zero-paper"])
def test_adamw8bit_paper_accountings(framework):
    """The paper's K = 12 becomes 4 + 2 with 8-bit moments (mixed precision)."""
    adamw = estimate_memory(inputs("llama-3-8b", dp=8, zero_stage=3, framework=framework))
    eight = estimate_memory(inputs("llama-3-8b", dp=8, zero_stage=3, framework=framework, optimizer="adamw8bit"))
    assert eight.devices[0].states["optimizer"] * 12 == pytest.approx(adamw.devices[0].states["optimizer"] * 6, rel=1e-3)


RUN_REFUSALS = [
    (["--set", "lora.base_dtype=nf4", "--tp", "2", "--dp", "1"], "parallel.tp: torchao's NF4 weights are not split"),
    (["--set", "lora.rank=8", "--tp", "2", "--dp", "1", "--set", "parallel.sequence_parallel=true"],
     "parallel.sequence_parallel: LoRA with sequence parallel"),
    (["--set", "lora.rank=8", "--zero", "1"], "zero.stage: LoRA runs under FSDP2"),
    # tiny-llama's k_proj is 64 x 128 = 8,192 elements: less than one scaler block of 64 * 256.
    (["--set", "lora.base_dtype=nf4", "--zero", "3"], "attn.k_proj.weight has 8,192 elements in 64 rows"),
]


@pytest.mark.parametrize("flags, needle", RUN_REFUSALS)
def test_run_refuses_before_starting(flags, needle):
    result = run_cli("run", "tiny-gpt2-cpu", "--set", "model.preset=tiny-llama", *flags)
    assert result.code == 2 and needle in result.err, result.err


def test_run_names_a_missing_library(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in ("peft", "torchao") else real(name, *a))
    result = run_cli("run", "tiny-gpt2-cpu", "--set", "lora.rank=8", "--set", "train.optimizer=adamw8bit")
    assert result.code == 2, result.err
    assert "lora: `shardplan run` needs peft for this: pip install" in result.err
    assert "[finetune]'" in result.err  # the checkout's extra, or the package's
    assert "train.optimizer: `shardplan run` needs torchao" in result.err


def test_validate_warns_about_weights_nf4_cannot_store():
    result = run_cli("validate", "tiny-gpt2-cpu", "--set", "model.preset=tiny-llama", "--set", "lora.base_dtype=nf4")
    assert result.code == 0
    assert "lora.base_dtype: torchao stores NF4 weights in whole blocks of 64 * 256 elements; " \
           "attn.k_proj.weight has 8,192" in result.err, result.err


def test_offloaded_frozen_base_is_pinned_tensor_by_tensor():
    """LoRA of Llama-3 70B on one H100 with the bf16 base offloaded (docs/finetune.md): FSDP2's
    CPUOffloadPolicy pins every parameter on its own, frozen ones too, and the pinned host
    allocator takes the power of two above each size (docs/estimate.md, "Host memory"). A layer
    of Llama-3 70B (config.json: hidden 8192, intermediate 28672, 8 KV heads of 128) in bf16:
    q and o 8192 x 8192 (2^27 B), k and v 1024 x 8192 (2^24 B), gate, up and down 28672 x 8192
    (469,762,048 B, pinned as 2^29), two norms of 8192 (2^14 B)."""
    pinned_layer = 2 * 2**27 + 2 * 2**24 + 3 * 2**29 + 2 * 2**14
    doc = run_cli("estimate", "presets/jobs/llama-3-70b-qlora.toml", "--dp", "1", "--set", "cluster.gpus_per_node=1",
                  "--set", "lora.base_dtype=bf16", "--json").json
    offloaded = doc["devices"][0]["layers"] - doc["devices"][0]["resident_layers"]
    assert offloaded > 0
    label = "frozen base, offloaded layers (pinned, each rounded up to a power of two)"
    assert doc["host"]["breakdown"][label] == offloaded * pinned_layer
