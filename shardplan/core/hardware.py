"""The hardware a plan runs on, as the time model needs it, and the model's constants.

Figures are per GPU (bandwidths per direction) unless they say otherwise. They come from the
GPU presets (`presets/gpus/*.toml`, each figure with its datasheet) and the job's `[cluster]`
table, which overrides them (CONTRACT); `io/hardware.py` builds a `Hardware` from them.

Efficiencies are the fractions of a datasheet figure that real kernels reach. The defaults
below are named constants with the reason for their value; the matmul, memory and network
ones are also `[cluster]` keys, so a GPU preset or a job can set its own. They were checked
jointly against the published runs in docs/time.md (never tuned to one row).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

from ..spec.model import cached_hash

# The three below were fitted together, once, on all 18 published iteration times of
# Narayanan et al. 2021 (Table 1) and Korthikanti et al. 2022 (Table 5), A100 80GB: the grid
# of benchmarks/validate_time.py --fit (matmul 0.68-0.78, memory 0.55-0.80, NVLink
# 0.65-0.85) minimising the mean absolute error over both tables (2.9%; its neighbours stay
# within 3.1%). Fitting on one paper alone and predicting the other gives 5.2-6.3% (docs/time.md).
#
# Large fp16/bf16 matmuls: ~74% of the dense tensor-core peak (231 of 312 TFLOP/s on an A100
# at its sustained clock; cuBLAS alone reaches ~80% on ideal shapes, NVIDIA's "Matrix
# Multiplication Background" guide; whole-step runs lose a little more to clocks and shapes).
MATMUL_EFFICIENCY = 0.74
# Elementwise kernels (softmax, dropout, LayerNorm, GeLU, bias-dropout-add, the optimizer):
# ~65% of the HBM datasheet bandwidth (fused but short kernels; a pure copy reaches ~85%).
MEMORY_EFFICIENCY = 0.65
# NCCL's ring collectives over NVSwitch: ~75% of the per-direction NVLink bandwidth
# (nccl-tests bus bandwidth of ~230 of 300 GB/s on DGX A100, less for the mid-size messages of
# tensor parallelism).
INTRA_NODE_EFFICIENCY = 0.75
# Over InfiniBand NCCL reaches ~90% of the NIC's line rate (nccl-tests bus bandwidth across
# DGX nodes with one HDR/NDR NIC per GPU); Narayanan et al. 2021 Table 2's ZeRO-3 runs move
# their parameters at 21-23 of 25 GB/s per GPU (docs/time.md).
INTER_NODE_EFFICIENCY = 0.90


@dataclass(frozen=True)
class Hardware:
    """One GPU and its links, in FLOP/s and bytes/s (floats)."""

    __hash__ = cached_hash  # planner caches key on this frozen value

    name: str
    peak_flops: float  # dense 16-bit tensor-core FLOP/s
    peak_fp32_flops: float  # fp32 matmul FLOP/s (TF32 tensor cores where the GPU has them)
    memory_bandwidth: float  # HBM bytes/s
    intra_node_bandwidth: float  # per GPU, one direction (NVLink / Infinity Fabric / PCIe)
    inter_node_bandwidth: float  # per GPU, one direction (the GPU's share of the node's NICs)
    host_bandwidth: float  # per GPU, one direction, host <-> device (PCIe)
    host_memory_bandwidth: float  # CPU DRAM bytes/s of one node (the CPU optimizer step)
    matmul_efficiency: float = MATMUL_EFFICIENCY
    memory_efficiency: float = MEMORY_EFFICIENCY
    intra_node_efficiency: float = INTRA_NODE_EFFICIENCY
    inter_node_efficiency: float = INTER_NODE_EFFICIENCY
    intra_node_link: str = "NVLink"  # what intra_node_bandwidth crosses (the explanation's word)

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name in ("name", "intra_node_link"):
                continue
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{f.name} must be a positive number (got {value!r})")
            if f.name.endswith("efficiency") and value > 1:
                raise ValueError(f"{f.name} is a fraction of the datasheet figure, at most 1 (got {value})")

    def peak_for(self, precision: str) -> float:
        """Matmul FLOP/s at the plan's compute precision."""
        return self.peak_fp32_flops if precision == "fp32" else self.peak_flops


@dataclass(frozen=True)
class TimeConstants:
    """The time model's remaining constants; every field says why it has its value."""

    __hash__ = cached_hash  # planner caches key on this frozen value

    # A matmul kernel costs a few microseconds beyond its FLOPs: launch, the ramp-up and the
    # partly filled last wave of tiles. With 5 us a 1024^3 fp16 GEMM on an A100 runs at ~55%
    # of its large-size speed and a 4096^3 one at ~97%, the shape of NVIDIA's "Matrix
    # Multiplication Background" guide (wave quantization).
    matmul_overhead_seconds: float = 5e-6
    # FlashAttention-2 on A100 (Dao 2023, Figure 5-6: head dim 128, sequence 2k-8k) runs its
    # forward at ~60% and its backward at ~50% of the 16-bit peak, counting the backward as
    # 2.5 forwards (it recomputes the scores).
    flash_forward_efficiency: float = 0.60
    flash_backward_efficiency: float = 0.50
    flash_backward_ratio: float = 2.5
    # An elementwise backward reads the saved input and the incoming gradient and writes one
    # gradient: ~1.5x the bytes of its forward (LayerNorm, GeLU, bias-dropout-add).
    elementwise_backward_ratio: float = 1.5
    # Bytes per logit of the cross-entropy, (forward, backward), by `[train] loss`:
    # fused (Megatron-LM's vocab-parallel kernel): the 16-bit logits read, fp32 max, exp and
    # sum passes, the softmax kept (~16); backward softmax minus one-hot, written in place
    # (~8). fp32 (torch on upcast logits): the upcast (2 read, 4 written), max, exp-sum and
    # gather passes (3 x 4) and the log-probabilities kept (4) (~22); backward the fp32
    # gradient written and read, cast back (~14).
    cross_entropy_fused_bytes: tuple[float, float] = (16.0, 8.0)
    cross_entropy_fp32_bytes: tuple[float, float] = (22.0, 14.0)
    # The optimizer step reads every gradient once more for the gradient-norm clipping that
    # large-model training uses (Megatron-LM, torchtitan, DeepSpeed: clip_grad_norm).
    optimizer_extra_grad_reads: int = 1
    # Fixed cost of one collective (NCCL's launch and protocol latency, small-message
    # all-reduce on 8 GPUs ~10 us, across nodes ~20 us; nccl-tests).
    intra_node_latency_seconds: float = 10e-6
    inter_node_latency_seconds: float = 20e-6
    # Communication running beside compute does not hide completely: NCCL kernels take SMs
    # and HBM bandwidth from the compute (Calculon's A100 system charges 15% of the processor
    # to collectives, Isaev et al. 2023), and prefetching starts late. Of the shorter of the
    # two, this fraction hides. Fitted on the six ZeRO-3 runs of Narayanan et al. 2021,
    # Table 2 (mean error 7.4%; 0.85 gives 8.8%, 0.5 gives 12.1%). With torchtitan's FSDP2
    # runs of Llama 3.1 8B on 8 and 128 GPUs added (their ratio; docs/time.md), the joint
    # optimum is flat from 0.7 to 0.85 (8.5% to 8.3% mean): kept.
    overlap_efficiency: float = 0.70
    # Pinned host <-> device copies reach ~80% of the PCIe line rate (25 of 32 GB/s on Gen4).
    host_link_efficiency: float = 0.80
    # A vectorised CPU Adam (DeepSpeedCPUAdam; torch's fused CPU AdamW) streams the fp32
    # parameter, both moments and the gradient through the CPU: bytes per parameter (read and
    # write of 12 bytes of state, a 4-byte gradient read), at this share of the node's DRAM
    # bandwidth (STREAM on two-socket servers reaches ~70%; the update's arithmetic costs some).
    cpu_optimizer_bytes_per_param: float = 28.0
    cpu_memory_efficiency: float = 0.5
    # None: overlap the gradient reduction as the framework does (fsdp2 always; deepspeed's
    # overlap_comm, default on at stage 3 only); True/False force it (Megatron-LM's local DDP
    # of 2021 did not overlap, torch DDP does).
    overlap_grad_reduce: bool | None = None

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "overlap_grad_reduce":
                continue
            if isinstance(value, tuple):
                if not all(isinstance(v, (int, float)) and math.isfinite(v) and v >= 0 for v in value):
                    raise ValueError(f"{f.name} must hold non-negative numbers (got {value!r})")
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{f.name} must be a non-negative number (got {value!r})")
            if f.name.endswith("efficiency") and not 0 < value <= 1:
                raise ValueError(f"{f.name} must be in (0, 1] (got {value})")


DEFAULT_CONSTANTS = TimeConstants()
