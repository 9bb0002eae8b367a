"""Bytes per element of each kind of tensor, by precision, optimizer and framework.

Two accountings (`[zero] framework`):

- `deepspeed`, the ZeRO paper's (Rajbhandari et al. 2019, section 3.1): mixed precision
  keeps 16-bit parameters (2 bytes) and gradients (2 bytes) and an fp32 master copy plus
  Adam's momentum and variance (K = 12 bytes). Without mixed precision Adam keeps m and v
  (8 bytes) and no master copy.
- `fsdp2`, what `shardplan run` executes with PyTorch: parameters stay fp32 (FSDP2
  `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` or autocast under DDP (stage 1) only
  cast them for compute), gradients are fp32 like their parameters, AdamW's exp_avg and
  exp_avg_sq are `zeros_like(param)` and its `step` is a 4-byte fp32 scalar per parameter
  tensor (torch/optim/adamw.py, `_init_group`).

SGD means torch's default `SGD(lr)`: no momentum, no state (a master copy under deepspeed).

`adamw8bit` keeps both moments in 8 bits with block-wise scales (Dettmers et al. 2022): 2 bytes
per element nominally (K = 4 + 2 = 6 with the fp32 master copy in the paper's accounting).
Under fsdp2 the exact bytes, scales and quantization maps included, come per tensor from
core/quantized.py `adamw8bit_bytes` (torchao's AdamW8bit); `optimizer` here is the nominal 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

FP32, HALF = 4, 2
STEP_BYTES = 4  # AdamW's per-tensor `step`, a float32 scalar (torch/optim/adamw.py)
MIXED = ("bf16-mixed", "fp16-mixed")
MOMENTS8 = 2  # two 8-bit moments per element (adamw8bit)
ADAM = ("adamw", "adamw8bit")


def uses_autocast(framework: str, zero_stage: int, precision: str) -> bool:
    """`shardplan run` computes under torch.autocast only at ZeRO stage 1 (DDP) with mixed
    precision; FSDP2 (stages 0, 2, 3) casts through MixedPrecisionPolicy instead."""
    return framework == "fsdp2" and zero_stage == 1 and precision in MIXED


@dataclass(frozen=True)
class ElementBytes:
    """Bytes per element of parameters, gradients, optimizer state, and activations."""

    params: int
    grads: int
    optimizer: int  # all optimizer state of one element (master + moments)
    step: int  # per parameter tensor (AdamW's step), 0 when none
    compute: int  # unsharded parameters and activations during forward/backward
    states8: bool = False  # 8-bit moments, counted per tensor (core/quantized.py adamw8bit_bytes)


@lru_cache(maxsize=64)  # a handful of combinations, asked for every plan and stage
def element_bytes(framework: str, precision: str, optimizer: str) -> ElementBytes:
    compute = FP32 if precision == "fp32" else HALF
    if framework != "fsdp2":  # deepspeed, zero-paper
        moments = {"adamw": 2 * FP32, "adamw8bit": MOMENTS8}.get(optimizer, 0)
        if precision == "fp32":
            return ElementBytes(FP32, FP32, moments, 0, FP32)
        # Mixed precision (pure bf16 is run as bf16 mixed precision by DeepSpeed): the fp32
        # master copy, plus m and v for Adam: K = 12 (ZeRO paper, section 3.1); 8-bit moments: 6.
        return ElementBytes(HALF, HALF, FP32 + moments, 0, HALF)
    param = HALF if precision == "bf16" else FP32
    states = {"adamw": 2 * param, "adamw8bit": MOMENTS8}.get(optimizer, 0)
    step = STEP_BYTES if optimizer in ADAM else 0
    return ElementBytes(param, param, states, step, compute, states8=optimizer == "adamw8bit")
