"""Published training runs the time model is held against, with the plans that ran them.

Every number names its source. The runs are Megatron-LM on Selene (DGX A100 80GB: 8 GPUs per
node, NVLink 3 over NVSwitch, one 200 Gb/s HDR InfiniBand NIC per GPU), GPT models with a
vocabulary of 51,200 and sequences of 2,048 tokens, fp16 mixed precision, dropout 0.1, the
attention of the time (no flash attention: the full score matrix is computed, softmax and
dropout run over it).

- Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
  Megatron-LM" (SC'21), Table 1: achieved teraFLOP/s per GPU with full recomputation; the
  microbatch sizes, virtual stages and DDP implementation of each row come from the script
  that ran them, NVIDIA/Megatron-LM examples/sc21/run_table_1.sh. Their FLOPs count
  (section 5.1) is 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration (recomputation
  included); an iteration took that / (teraFLOP/s * 1e12 * GPUs) seconds.
- Narayanan et al. 2021, Table 2: ZeRO-3 (DeepSpeed, no model parallelism) against PTD-P on
  the same GPUs, achieved teraFLOP/s per GPU; PTD-P uses tensor 8 x pipeline 12 (175B) or 35
  (530B) with microbatches of 1.
- Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
  Table 5: iteration seconds with full recomputation, and with sequence parallelism plus
  selective recomputation; configurations from its Table 3 (as transcribed by NVIDIA's
  Calculon, calculon-ai/calculon validation/seqsel/tab5/*.json: microbatch 4 for 22B, 1
  otherwise; the interleaved schedule with 3 chunks for 175B and 530B).

Two references are not Megatron-LM on Selene: torchtitan's FSDP2 runs of Llama 3.1 8B on 8 and
128 H100s (whose GPU peak is unknown, so only their ratio is used), and BLOOM-176B as BigScience
trained it with Megatron-DeepSpeed on Jean Zay (the end of this module).
"""

from __future__ import annotations

from dataclasses import dataclass

from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.hardware import Hardware, TimeConstants
from shardplan.spec.model import ModelShape, resolve_shape

SEQ, VOCAB = 2048, 51200

# DGX A100 80GB as presets/gpus/a100-sxm-80gb.toml describes it (each figure's datasheet there).
A100_80GB = Hardware("a100-sxm-80gb", peak_flops=312e12, peak_fp32_flops=19.5e12, memory_bandwidth=2039e9,
                     intra_node_bandwidth=300e9, inter_node_bandwidth=25e9, host_bandwidth=32e9,
                     host_memory_bandwidth=409.6e9)


def gpt(hidden: int, heads: int, layers: int) -> ModelShape:
    """Megatron-LM's GPT: learned positions, LayerNorm, GeLU MLP of 4h, biases, tied embeddings."""
    shape, problems = resolve_shape(dict(family="gpt2", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                         vocab_size=VOCAB, max_seq_len=SEQ))
    assert not problems, problems
    return shape


def narayanan_flops(batch: int, layers: int, hidden: int) -> float:
    """Narayanan et al. 2021, section 5.1, equation for F (recomputation included)."""
    s, h, v = SEQ, hidden, VOCAB
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


@dataclass(frozen=True)
class Run:
    source: str
    name: str
    inputs: EstimateInputs
    constants: TimeConstants
    measured_seconds: float
    gpus: int

    def measured_tflops(self, batch: int, layers: int, hidden: int) -> float:
        return narayanan_flops(batch, layers, hidden) / (self.measured_seconds * self.gpus) / 1e12


def _megatron(shape: ModelShape, dp: int, tp: int, pp: int, micro: int, microbatches: int, virtual: int,
              recompute: str = "full", sequence_parallel: bool = False, zero: int = 0) -> EstimateInputs:
    # framework "deepspeed": 16-bit gradients reduced, fp32 master weights in the optimizer, and
    # Megatron-LM's sequence parallel (its linears gather their input again in backward);
    # Megatron-LM's fused vocabulary-parallel cross-entropy.
    return EstimateInputs(
        shape=shape, params=None, degrees=Degrees(dp=dp, tp=tp, pp=pp), framework="deepspeed", zero_stage=zero,
        precision="fp16-mixed", seq_len=SEQ, micro_batch=micro, num_microbatches=microbatches,
        schedule="interleaved-1f1b" if virtual > 1 else "1f1b", virtual=virtual, recompute=recompute,
        sequence_parallel=sequence_parallel, attention="eager", dropout=True, loss="fused",
    )


# Narayanan et al. 2021 Table 1 (params, heads, hidden, layers, TP, PP, GPUs, batch, achieved
# teraFLOP/s per GPU) with run_table_1.sh (MBS, --num-layers-per-virtual-pipeline-stage,
# DDP=torch|local: torch's DDP overlaps the gradient all-reduce, Megatron-LM's "local" DDP of
# 2021 reduces after the backward).
NARAYANAN_TABLE_1 = [
    ("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137, 16, 0, "torch"),
    ("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138, 16, 0, "torch"),
    ("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142, 16, 0, "torch"),
    ("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135, 8, 0, "torch"),
    ("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138, 4, 0, "local"),
    ("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140, 2, 5, "local"),
    ("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148, 2, 5, "local"),
    ("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155, 1, 3, "local"),
    ("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163, 1, 1, "local"),
    ("1008.0B", 160, 25600, 128, 8, 64, 3072, 3072, 163, 1, 0, "local"),
]


def narayanan_table_1() -> list[Run]:
    runs = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, tflops, micro, per_virtual, ddp in NARAYANAN_TABLE_1:
        dp = gpus // (tp * pp)
        virtual = layers // pp // per_virtual if per_virtual else 1
        inputs = _megatron(gpt(hidden, heads, layers), dp, tp, pp, micro, batch // (dp * micro), virtual)
        seconds = narayanan_flops(batch, layers, hidden) / (tflops * 1e12 * gpus)
        runs.append(Run("Narayanan et al. 2021, Table 1", name, inputs,
                        TimeConstants(overlap_grad_reduce=ddp == "torch"), seconds, gpus))
    return runs


# Korthikanti et al. 2022 Table 5 iteration seconds (full recomputation; sequence parallel +
# selective recomputation) with Table 3's plans (heads, hidden, layers, TP, PP, GPUs, global
# batch, microbatch, virtual stages).
KORTHIKANTI_TABLE_5 = [
    ("22B", 64, 6144, 48, 8, 1, 8, 4, 4, 1, 1.42, 1.10),
    ("175B", 96, 12288, 96, 8, 8, 64, 64, 1, 3, 18.13, 13.75),
    ("530B", 128, 20480, 105, 8, 35, 280, 280, 1, 3, 49.05, 37.83),
    ("1T", 160, 25600, 128, 8, 64, 512, 512, 1, 1, 94.42, 71.49),
]


def korthikanti_table_5() -> list[Run]:
    runs = []
    for name, heads, hidden, layers, tp, pp, gpus, batch, micro, virtual, full, seqsel in KORTHIKANTI_TABLE_5:
        dp = gpus // (tp * pp)
        shape = gpt(hidden, heads, layers)
        for mode, seconds in (("full recompute", full), ("seq-par + selective", seqsel)):
            selective = mode != "full recompute"
            inputs = _megatron(shape, dp, tp, pp, micro, batch // (dp * micro), virtual,
                               recompute="selective" if selective else "full", sequence_parallel=selective)
            runs.append(Run("Korthikanti et al. 2022, Table 5", f"{name} {mode}", inputs,
                            TimeConstants(overlap_grad_reduce=False), seconds, gpus))
    return runs


# Narayanan et al. 2021 Table 2: (model, heads, hidden, layers, scheme, GPUs, batch,
# microbatch, achieved teraFLOP/s per GPU).
NARAYANAN_TABLE_2 = [
    ("175B", 96, 12288, 96, "ZeRO-3", 384, 1536, 4, 144),
    ("175B", 96, 12288, 96, "ZeRO-3", 768, 1536, 2, 88),
    ("175B", 96, 12288, 96, "ZeRO-3", 1536, 1536, 1, 44),
    ("530B", 128, 20480, 105, "ZeRO-3", 640, 2560, 4, 138),
    ("530B", 128, 20480, 105, "ZeRO-3", 1120, 2240, 2, 98),
    ("530B", 128, 20480, 105, "ZeRO-3", 2240, 2240, 1, 48),
    ("175B", 96, 12288, 96, "PTD-P", 384, 1536, 1, 153),
    ("175B", 96, 12288, 96, "PTD-P", 768, 1536, 1, 149),
    ("175B", 96, 12288, 96, "PTD-P", 1536, 1536, 1, 141),
    ("530B", 128, 20480, 105, "PTD-P", 560, 2240, 1, 171),
    ("530B", 128, 20480, 105, "PTD-P", 1120, 2240, 1, 167),
    ("530B", 128, 20480, 105, "PTD-P", 2240, 2240, 1, 159),
]


def narayanan_table_2() -> list[Run]:
    """ZeRO-3 as DeepSpeed runs it (stage 3, full recomputation, its overlap); PTD-P with the
    pipeline depth the model-parallel size implies and the plain 1F1B schedule (Table 2 does
    not say whether it interleaved)."""
    runs = []
    for model, heads, hidden, layers, scheme, gpus, batch, micro, tflops in NARAYANAN_TABLE_2:
        shape = gpt(hidden, heads, layers)
        if scheme == "ZeRO-3":
            inputs = _megatron(shape, gpus, 1, 1, micro, batch // (gpus * micro), 1, zero=3)
            constants = TimeConstants()
        else:
            pp = 12 if model == "175B" else 35
            dp = gpus // (8 * pp)
            inputs = _megatron(shape, dp, 8, pp, micro, batch // (dp * micro), 1)
            constants = TimeConstants(overlap_grad_reduce=False)
        seconds = narayanan_flops(batch, layers, hidden) / (tflops * 1e12 * gpus)
        runs.append(Run("Narayanan et al. 2021, Table 2", f"{model} {scheme} {gpus} GPUs", inputs, constants,
                        seconds, gpus))
    return runs


# torchtitan's Llama 3.1 benchmark (pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md),
# the two FSDP runs without torch.compile or Float8: Table 1 (8 GPUs, one node) and Table 3 (128
# GPUs, 16 nodes), local batch 2, global batch 16 and 256, selective (operator-level)
# checkpointing, sequence 8,192 (torchtitan's llama3_8b.toml of that date), the loss on fp32
# logits; H100s with 96 GB HBM2e at 2.4 TB/s and 500 W, NVLink in the node, 400 Gb/s RDMA per GPU.
# The authors do not know that GPU's peak (their footnote 2: between the SXM's and the NVL's),
# so only the ratio of the two runs is a reference: 5,605 / 5,762 tokens/s per GPU.
TORCHTITAN_FSDP_TOKENS_PER_GPU = {8: 5762, 128: 5605}
TORCHTITAN_H100 = Hardware("h100-96gb-500w", peak_flops=989.4e12, peak_fp32_flops=67e12, memory_bandwidth=2.4e12,
                           intra_node_bandwidth=450e9, inter_node_bandwidth=50e9, host_bandwidth=64e9,
                           host_memory_bandwidth=614.4e9)  # presets/gpus/h100-sxm.toml, the benchmark's HBM2e


def llama_3_8b() -> ModelShape:
    """meta-llama/Meta-Llama-3-8B's config.json (presets/models/llama-3-8b.toml)."""
    shape, problems = resolve_shape(dict(family="llama", num_layers=32, hidden_size=4096, num_heads=32,
                                         num_kv_heads=8, ffn_hidden_size=14336, vocab_size=128256,
                                         max_seq_len=8192, tie_embeddings=False))
    assert not problems, problems
    return shape


def torchtitan_fsdp(gpus: int) -> EstimateInputs:
    """torchtitan's FSDP2 run of Llama 3.1 8B on `gpus` H100s (above)."""
    return EstimateInputs(
        shape=llama_3_8b(), params=None, degrees=Degrees(dp=gpus), framework="fsdp2", zero_stage=3,
        precision="bf16-mixed", seq_len=8192, micro_batch=2, num_microbatches=1, recompute="op",
        attention="flash", loss="fp32", gpus_per_node=8,
    )


# BLOOM-176B as BigScience trained it (bigscience-workshop/bigscience,
# train/tr11-176B-ml/tr11-176B-ml.slurm and its README.md): Megatron-DeepSpeed, TP_SIZE=4,
# PP_SIZE=12 on 48 nodes of 8 (DP 8), MICRO_BATCH_SIZE=2, GLOBAL_BATCH_SIZE=2048, sequences of
# 2,048; NLAYERS=70, NHIDDEN=14336, NHEADS=112, `--pad-vocab-size-to 250880`, tied embeddings,
# ALiBi, GeLU MLP of 4h, Megatron-LM's default dropout 0.1 (README "Optimizer"), bf16 with
# ZERO_STAGE=0 ("bf16 must use z0! it implements its own zero stage 1 equivalent": DeepSpeed's
# BF16_Optimizer, which partitions the fp32 master and moments over dp), `--checkpoint-activations`
# (full recomputation), `--pp-partition-method 'type:transformer|embedding'`: pp rank 0 holds the
# embedding and 5 blocks, ranks 1-10 six, rank 11 five and the tied head (README "Architecture").
# DeepSpeed's pipeline engine: 1F1B without interleaving, the data-parallel reduction after the
# last microbatch (no overlap). Measured: 105 s per iteration at GBS 2,048 (the README's
# days-left formula, `105 * (341e9 - tokens) / (2048*2048*3600*24)`), which is the "about 150
# TFLOPs" of BigScience's BLOOM page in hardware FLOPs (README "Throughput": recomputation
# counted, the `4*2` coefficient). Jean Zay's A100 partition (README "Hardware"; Scao et al.
# 2022, "BLOOM", Engineering, Hardware): 8 A100 80GB per node on NVLink, four Omni-Path
# 100 Gb/s links per node (400 Gb/s for 8 GPUs: 6.25 GB/s each), 2x AMD EPYC 7543 (8 channels of
# DDR4-3200 each), 512 GB of memory per node.
BLOOM_SECONDS = 105.0
JEAN_ZAY_A100 = Hardware("a100-sxm-80gb-omnipath", peak_flops=312e12, peak_fp32_flops=19.5e12,
                         memory_bandwidth=2039e9, intra_node_bandwidth=300e9, inter_node_bandwidth=6.25e9,
                         host_bandwidth=32e9, host_memory_bandwidth=409.6e9)


def bloom_176b() -> EstimateInputs:
    """BLOOM-176B's plan as it ran (above)."""
    shape, problems = resolve_shape(dict(family="gpt2", num_layers=70, hidden_size=14336, num_heads=112,
                                         vocab_size=250880, max_seq_len=2048, position_embedding="alibi"))
    assert not problems, problems
    return EstimateInputs(
        shape=shape, params=None, degrees=Degrees(dp=8, tp=4, pp=12), framework="deepspeed", zero_stage=0,
        precision="bf16-mixed", seq_len=2048, micro_batch=2, num_microbatches=2048 // (8 * 2), schedule="1f1b",
        stage_split=(5, 5), recompute="full", attention="eager", dropout=True, loss="fused", gpus_per_node=8,
    )
