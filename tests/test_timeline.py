"""The step timeline, host memory, and DeepSpeed as its code allocates, held against runs
that really happened.

Published measurements used here, each read off its source:

- DeepSpeed's ZeRO-Offload tutorial (deepspeedai/DeepSpeed, docs/_tutorials/zero-offload.md):
  GPT-2 10B (50 layers, hidden 4096, 32 heads), batch 10, ZeRO-2 with offload_optimizer and
  overlap_comm, Megatron-LM's --checkpoint-activations, fp16, one V100-SXM3 32GB. Its
  nvidia-smi screenshot (docs/assets/images/zero_offload_dp1_10B_smi.png) shows 32290MiB /
  32480MiB on GPU 0; its htop screenshot (zero_offload_dp1_10B_cpu.png) "Mem 296G/1.47T".
- DeepSpeed's ZeRO tutorial (docs/_tutorials/zero.md, "Training a 10B Parameter GPT-2
  model"): the same model on 32 V100 32GB, batch 1, ZeRO-2 with overlap_comm, reduce and
  allgather buckets 5e8; nvidia-smi (zero2_dp32_10B_smi.png): 31570MiB, 31546MiB, 31570MiB.
- torchtitan's Llama 3.1 benchmark (pytorch/torchtitan, benchmarks/
  llama3_h100_202412_torchtitan.md), the two runs without torch.compile or Float8: Table 1
  "FSDP" (8 GPUs, local batch 2, selective op checkpointing): 82.4 GiB; Table 3 "FSDP" (128
  GPUs, same settings): 67.0 GiB. Both are torchtitan's `max_reserved` of an H100 96GB.

The runs' common settings come from the sources' own defaults: Megatron-LM v1.1.5's GPT-2
uses seq 1024, the GPT-2 vocabulary padded to 50304, dropout 0.1, its own (eager) attention
and the vocab-parallel cross entropy (`loss = "fused"`); torchtitan's llama3_8b.toml of that
date uses seq 8192 and selective_ac_option = "op".
"""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.deepspeed import pinned_bytes
from shardplan.core.estimate_inputs import default_cpu_budget, host_reserve
from shardplan.core.timeline import BACKWARD, FORWARD, LOSS, STEP

GIB = 2**30

GPT2_10B = """
[model]
family = "gpt2"
num_layers = 50
hidden_size = 4096
num_heads = 32
vocab_size = 50304
max_seq_len = 1024
dropout = 0.1

[train]
seq_len = 1024
precision = "fp16-mixed"
activation_checkpointing = "full"
attention = "eager"
loss = "fused"
"""


def _estimate(write, name: str, text: str, *flags: str) -> dict:
    result = run_cli("estimate", write(name, text), "--json", *flags)
    assert result.code in (0, 1), result.err
    return result.json


def test_zero_offload_tutorial_run_fits(write):
    job = GPT2_10B + """
[parallel]
micro_batch_size = 10
[zero]
stage = 2
framework = "deepspeed"
overlap_comm = true
[offload]
optimizer = true
[cluster]
gpus_per_node = 1
gpu_memory = "32480MiB"
cpu_memory_per_node = "1505GiB"
"""
    doc = _estimate(write, "offload.toml", job)
    assert doc["fits"] is True
    measured_gpu = 32290 * 2**20  # nvidia-smi, zero_offload_dp1_10B_smi.png
    assert abs(doc["peak_gpu_bytes"] / measured_gpu - 1) < 0.10
    measured_host = 296 * GIB  # htop, zero_offload_dp1_10B_cpu.png
    assert abs(doc["host"]["per_node"] / measured_host - 1) < 0.25
    assert doc["cpu_bytes_per_node"] == doc["host"]["per_node"]
    # The transients that were once added into one peak live in different moments.
    device = doc["devices"][0]
    assert set(device["moments"]) >= {FORWARD, LOSS, BACKWARD, STEP}
    assert device["gpu"]["total"] == max(device["moments"].values())


def test_zero2_tutorial_run(write):
    job = GPT2_10B + """
[parallel]
dp = 32
[zero]
stage = 2
framework = "deepspeed"
overlap_comm = true
[cluster]
gpus_per_node = 16
gpu_memory = "32480MiB"
"""
    doc = _estimate(write, "zero2.toml", job)
    assert doc["fits"] is True
    measured = 31570 * 2**20  # nvidia-smi, zero2_dp32_10B_smi.png
    assert abs(doc["peak_gpu_bytes"] / measured - 1) < 0.10


@pytest.mark.parametrize("dp, measured_gib", [(8, 82.4), (128, 67.0)])
def test_torchtitan_fsdp_runs(dp, measured_gib):
    # torchtitan measures the caching allocator's max_reserved; the estimate counts allocated
    # tensors and allowances, so it reads below (docs/estimate.md, "Held against real runs").
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--dp", str(dp), "--zero", "3",
                     "--set", "parallel.micro_batch_size=2", "--set", "train.seq_len=8192",
                     "--set", "train.activation_checkpointing=op", "--set", "cluster.gpu_memory=96GiB",
                     "--set", "offload.strategy=conservative", "--json")
    assert result.code == 0, result.err
    ratio = result.json["peak_gpu_bytes"] / (measured_gib * GIB)
    assert 0.85 < ratio < 1.0


def test_peak_is_the_largest_moment_and_transients_do_not_coexist():
    result = run_cli("estimate", "llama-3-8b-h100", "--json", "--explain")  # seq 8192, full recomputation
    device = result.json["devices"][0]
    assert device["peak_moment"] == max(device["moments"], key=device["moments"].get)
    labels = {t["label"] for kind in device["terms"] for t in device["terms"][kind]}
    # The peak here is the loss moment: its gradient is there, the recomputed layer is not.
    assert device["peak_moment"] == LOSS
    assert any(label.startswith("loss gradient") for label in labels)
    assert not any(label.startswith("recomputed layer") for label in labels)


LLAMA_65B_QLORA = """
[model]
family = "llama"
num_layers = 80
hidden_size = 8192
num_heads = 64
num_kv_heads = 64
ffn_hidden_size = 22016
vocab_size = 32000
max_seq_len = 2048
[parallel]
dp = 1
micro_batch_size = {mbs}
num_microbatches = {m}
[train]
seq_len = {seq}
precision = "bf16"
activation_checkpointing = "full"
[lora]
rank = 64
targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
base_dtype = "nf4"
[offload]
strategy = "conservative"
"""


def test_backward_peaks_at_whichever_end_of_the_sweep_holds_more(write):
    """Backward frees a layer's saved activations and leaves its gradients behind: the moment
    is the sweep's first layer (every layer's activations) or its last (every other layer's
    gradients), whichever holds more. QLoRA of LLaMA 65B at 512 tokens (docs/finetune.md's job)
    peaked at the last on an H100: allocated 44,879,813,632 B, 1.05 GB above backward through
    the first layer (benchmarks/data/gpu-finetune-h100.json)."""
    def backward(mbs, m, seq):
        result = run_cli("estimate", write("job.toml", LLAMA_65B_QLORA.format(mbs=mbs, m=m, seq=seq)),
                         "--json", "--explain")
        device = result.json["devices"][0]
        return device, {t["label"]: t["bytes"] for kind in device["terms"] for t in device["terms"][kind]}

    device, terms = backward(1, 1, 512)
    assert device["peak_moment"] == BACKWARD
    # LLaMA 65B (hidden 8,192, MLP 22,016, 80 layers; Touvron et al. 2023, Table 2), rank-64
    # adapters on the seven linears (A: r x in, B: out x r), bf16.
    adapters_per_layer = 64 * (4 * (8192 + 8192) + 3 * (8192 + 22016))  # q k v o; gate up down
    layer_grads = 80 * adapters_per_layer * 2
    assert terms["layers grads produced before the sweep's last layer"] == layer_grads - layer_grads // 80
    per_layer = 512 * 8192 * 2  # full recomputation keeps each layer's bf16 input: 2sbh (Korthikanti et al. 2022)
    assert terms["layers of stage 0: the layer in backward (the sweep's last; the others freed)"] == per_layer
    # The planner's figure is the explained estimate's, to the byte.
    assert device["moments"][BACKWARD] == result_moment(write, 1, 1, 512)
    # At 4,096 tokens the activations outweigh the gradients: the first layer's end.
    device, terms = backward(1, 1, 2048 * 2)
    assert not any("sweep's last" in label for label in terms)
    # Accumulating microbatches keep every gradient through backward: no sweep to walk.
    device, terms = backward(1, 2, 512)
    assert not any("sweep's last" in label for label in terms)


def test_zero2_blocks_resharded_in_backward_are_not_counted_at_the_sweeps_end(write):
    """ZeRO-2 keeps every block gathered from forward into backward; backward reshards each
    after its own (torch/distributed/fsdp/_fully_shard: reshard_after_backward, True by
    default), so at the sweep's last layer one block is gathered. Where the resharded blocks
    outweigh the gradients left behind (full training of Llama-3 8B at 1,024 tokens: 13 GiB of
    gathered bf16 blocks against 3.1 GiB of sharded gradients) the first layer's end stays."""
    result = run_cli("estimate", "llama-3-8b-h100", "--zero", "2", "--set", "train.seq_len=1024", "--json", "--explain")
    moments = {m["name"]: m for m in result.json["devices"][0].get("moment_terms", [])}
    labels = {t["label"] for kind in result.json["devices"][0]["terms"] for t in result.json["devices"][0]["terms"][kind]}
    assert not any("sweep's last" in label or "resharded" in label for label in labels), moments
    assert result.json["devices"][0]["peak_moment"] == LOSS
    # QLoRA at ZeRO-2 on one rank gathers the adapters and norms (NF4 stays whole), in bf16
    # under bf16-mixed, while their gradients are fp32: the gradients win, and the gathered
    # blocks count one block at the sweep's end.
    text = LLAMA_65B_QLORA.format(mbs=1, m=1, seq=512).replace('"bf16"', '"bf16-mixed"') + "[zero]\nstage = 2\n"
    device = run_cli("estimate", write("job.toml", text), "--json", "--explain").json["devices"][0]
    terms = {t["label"]: t["bytes"] for kind in device["terms"] for t in device["terms"][kind]}
    assert device["peak_moment"] == BACKWARD
    # One layer: its adapters (q k v o: r (h + h); gate up down: r (h + 22,016); rank 64) and two
    # norms of 8,192, in bf16.
    adapters_per_layer = 64 * (4 * (8192 + 8192) + 3 * (8192 + 22016))
    block = (adapters_per_layer + 2 * 8192) * 2
    assert terms["unsharded block parameters: the block in backward (the others resharded)"] == block
    assert terms["layers grads produced before the sweep's last layer"] == 79 * adapters_per_layer * 4


def result_moment(write, mbs, m, seq) -> int:
    from shardplan.core.estimate import rank_coordinates
    from shardplan.core.estimate_inputs import inputs_from_job
    from shardplan.core.figures import rank_figures
    from shardplan.core.memory import estimate_memory
    from shardplan.io.job import load_job

    resolved = load_job(write("job.toml", LLAMA_65B_QLORA.format(mbs=mbs, m=m, seq=seq)), [], env={})
    inputs = estimate_memory(inputs_from_job(resolved.job, resolved.shape, True)).inputs
    return rank_figures(inputs, rank_coordinates(inputs, 0)).moments[BACKWARD]


def test_pinned_allocations_round_to_powers_of_two():
    # torch 2.13 ATen/core/CachingHostAllocator.h: "Round up the allocation to the nearest
    # power of two"; 41,106,276,352 B (GPT-2 10B's fp32 partition) takes 64 GiB.
    assert pinned_bytes(41_106_276_352) == 64 * GIB
    assert pinned_bytes(2**20) == 2**20 and pinned_bytes(2**20 + 1) == 2**21


def test_default_cpu_budget_follows_the_node():
    ram = 2 * 2**40  # the h100-80gb node: 2 TiB (NVIDIA DGX H100 datasheet)
    assert default_cpu_budget(ram) == ram - host_reserve(ram) == ram - int(ram * 0.10)
    result = run_cli("estimate", "llama-3-8b-h100", "--json")
    assert result.json["host"]["limit"] == default_cpu_budget(ram)
    # 8 ranks, each materializing the root (embedding and head, 3.91 GiB in fp32) before
    # sharding it, with 2 GiB of runtime each: 47.3 GiB, over 32 GiB less the 8 GiB reserve.
    small = run_cli("estimate", "llama-3-8b-h100", "--set", "cluster.cpu_memory_per_node=32GiB")
    assert small.code == 1 and "host memory at start-up" in small.err


def test_zero3_gathers_the_whole_module_whatever_max_live_parameters():
    # Mixtral 8x7B's experts are one module in transformers (MixtralExperts): 8 experts * 3
    # projections * 4096 * 14336 = 1,409,286,144 parameters, gathered whole at once.
    for live in ("1000000000", "1000000"):
        result = run_cli("estimate", "--set", "model.preset=mixtral-8x7b", "--dp", "8", "--zero", "3",
                         "--framework", "deepspeed", "--set", f"zero.max_live_parameters={live}", "--json", "--explain")
        assert result.code == 0, result.err
        terms = [t for device in result.json["devices"] for kind in device["terms"].values() for t in kind]
        gathered = [t for t in terms if t["label"].startswith("gathered module")]
        assert gathered and max(t["bytes"] for t in gathered) == 1_409_286_144 * 2


def test_deepspeed_offload_keeps_fp32_gradients_on_the_host():
    result = run_cli("estimate", "--set", "model.preset=llama-2-7b", "--dp", "8", "--zero", "2",
                     "--framework", "deepspeed", "--set", "offload.optimizer=true", "--json", "--explain")
    device = result.json["devices"][0]
    assert device["gpu"]["optimizer"] == 0 and device["cpu"]["grads"] > 0
    training = {t["label"] for t in device["host_terms"]["training"]}
    assert "fp32 gradient partition (pinned)" in training and "Adam moments (DeepSpeedCPUAdam)" in training
    # Eight ranks each build the 7B model in fp32 before deepspeed.initialize: the node's peak.
    assert result.json["host"]["moment"] == "start-up"


def test_params_only_with_parameter_offload_says_so():
    result = run_cli("estimate", "--params", "7B", "--dp", "8", "--zero", "3", "--set", "offload.params=true", "--json")
    device = result.json["devices"][0]
    assert device["gpu"]["params"] == 0 and device["cpu"]["params"] > 0
    assert any("offload.params puts every parameter on the CPU" in w for w in result.json["warnings"])


def test_first_stage_holds_the_whole_model_of_activations():
    # Korthikanti et al. 2022, section 4.2.3 (eq. 5, behind Figure 1): under 1F1B the first
    # stage holds p microbatches of its L/p layers, sbhL(34 + 5as/h)/t in all with sequence
    # parallel, 34sbhL/t with selective recomputation too. 175B of their Table 3: L 96,
    # h 12288, a 96, t 8, p 8, s 2048, b 1.
    result = run_cli("estimate", "--set", "model.family=gpt2", "--set", "model.num_layers=96",
                     "--set", "model.hidden_size=12288", "--set", "model.num_heads=96",
                     "--set", "model.vocab_size=51200", "--set", "model.max_seq_len=2048", "--set", "model.dropout=0.1",
                     "--tp", "8", "--pp", "8", "--set", "parallel.num_microbatches=64",
                     "--set", "parallel.sequence_parallel=true", "--set", "train.attention=eager",
                     "--set", "train.activation_checkpointing=selective", "--set", "train.seq_len=2048",
                     "--framework", "zero-paper", "--json", "--explain")
    assert result.code == 0, result.err
    first = result.json["devices"][0]
    layers = [t for t in first["terms"]["gpu.activations"] if t["label"].startswith("layers of stage")]
    s, b, h, L, t = 2048, 1, 12288, 96, 8
    assert sum(t_["bytes"] for t_ in layers) == 34 * s * b * h * L // t
