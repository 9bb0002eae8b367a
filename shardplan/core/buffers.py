"""Transient GPU memory beside model states and saved activations: the terms calculators
forget. Each term states its assumption; the totals are per phase of a step (forward and
backward, then the optimizer step), because the two peaks do not coincide.

fsdp2 (torch `fully_shard`, torch/distributed/fsdp/_fully_shard):
- a block's parameters are all-gathered unsharded in the compute dtype (bf16 under
  MixedPrecisionPolicy) for its forward and again for its backward; with explicit prefetching
  `prefetch_layers` more blocks are gathered ahead. ZeRO-3 (`reshard_after_forward=True`)
  frees them after each block; ZeRO-2 (`reshard_after_forward=False`) keeps every block
  unsharded from its forward to its backward;
- the root module (embedding, final norm, head) stays unsharded between forward and backward;
- backward produces a block's unsharded gradients in the compute dtype and copies them into a
  reduce-scatter input in the reduce dtype (fp32).
Stage 0 runs `fully_shard` on a replicate-only mesh: the same buffers with one rank per
shard group. DDP (stage 1) under autocast keeps a 16-bit copy of every weight used in forward
until its backward (autocast's cast cache, saved by the matmuls); its gradient buckets are
the gradients themselves (`gradient_as_bucket_view=True`).

The allowances for the CUDA context and allocator fragmentation are stated constants.
"""

from __future__ import annotations

from dataclasses import dataclass

from .precision import FP32, ElementBytes
from .stages import LocalParam, RankParams
from .terms import Term

# CUDA context (driver, kernels of torch/cuDNN/NCCL loaded lazily) as seen per process by
# nvidia-smi, and a fraction of the tensor total lost to the caching allocator's
# fragmentation. Both are allowances, stated in `assumptions`, not measurements of a job.
CUDA_CONTEXT_BYTES = 512 * 2**20
FRAGMENTATION = 0.05


@dataclass(frozen=True)
class Phases:
    """Buffer terms of the forward/backward phase and of the optimizer step."""

    forward_backward: list[Term]
    step: list[Term]


def padded_unsharded(params: tuple[LocalParam, ...], degree: int) -> int:
    """Elements of an all-gathered block: each tensor's rows rounded up to a multiple of the
    shard group (FSDP2 pads dim 0 so every rank contributes the same number of rows)."""
    return sum(p.padded_shard_numel(degree) * degree for p in params)


def fsdp2_buffers(
    rp: RankParams, eb: ElementBytes, stage: int, degree: int, prefetch: int, mixed: bool
) -> Phases:
    """Transient buffers of one rank running FSDP2 (stages 0, 2, 3) or DDP (stage 1)."""
    c = eb.compute
    terms: list[Term] = []
    if stage != 1:  # FSDP2: stage 0 replicates (one rank per shard group), 2 and 3 shard
        degree = 1 if stage == 0 else degree
        block = padded_unsharded(rp.layer, degree)
        live = rp.num_layers if stage == 2 else min(rp.num_layers, 1 + prefetch)
        why = "all blocks (reshard_after_forward=False)" if stage == 2 else f"1 + prefetch {prefetch} blocks"
        if live:
            terms.append(Term("unsharded block parameters", live * block * c,
                              lambda: f"{why}: {live} * {block:,} elements * {c} B"))
        root = padded_unsharded(rp.root, degree)
        if root:
            terms.append(Term("unsharded root parameters (embedding/head)", root * c,
                              lambda: f"{root:,} elements * {c} B, kept from forward to backward"))
        if rp.num_layers:
            terms.append(Term("block gradients before reduce-scatter", block * (c + FP32),
                              lambda: f"{block:,} elements * ({c} B unsharded + {FP32} B reduce-scatter input)"))
    elif mixed:
        numel = rp.numel
        terms.append(Term("16-bit weight copies held for backward (autocast)", numel * c,
                          lambda: f"{numel:,} elements * {c} B"))
    return Phases(terms, [])


# DeepSpeed ZeRO defaults (deepspeed/runtime/zero/config.py): elements per gradient reduce
# bucket, parameters fetched ahead (stage 3), parameters kept gathered at most (stage 3).
DS_REDUCE_BUCKET = 500_000_000
DS_PREFETCH_BUCKET = 50_000_000
DS_MAX_LIVE_PARAMETERS = 1_000_000_000


def deepspeed_buffers(rp: RankParams, eb: ElementBytes, stage: int) -> list[Term]:
    """DeepSpeed's own buffers at its default configuration.

    Stage 1/2 (stage_1_and_2.py `setup_buckets`, contiguous_gradients on): one reduce bucket
    of `reduce_bucket_size` elements in the gradient dtype, allocated whole. Stage 3
    (stage3.py): the same reduce bucket, the parameters it fetches ahead
    (`stage3_prefetch_bucket_size`), and gathered parameters kept until released, at most
    `stage3_max_live_parameters` (partitioned_param_coordinator.py).
    """
    if stage == 0:
        return []
    g, c = eb.grads, eb.compute
    terms = [Term("reduce bucket (reduce_bucket_size)", DS_REDUCE_BUCKET * g,
                  lambda: f"{DS_REDUCE_BUCKET:,} elements * {g} B")]
    if stage == 3:
        live = min(DS_MAX_LIVE_PARAMETERS, rp.numel)
        terms.append(Term("prefetched parameters (stage3_prefetch_bucket_size)", DS_PREFETCH_BUCKET * c,
                          lambda: f"{DS_PREFETCH_BUCKET:,} elements * {c} B"))
        terms.append(Term("gathered parameters (up to stage3_max_live_parameters)", live * c,
                          lambda: f"min({DS_MAX_LIVE_PARAMETERS:,}, {rp.numel:,}) elements * {c} B"))
    return terms


def step_buffers(optimizer_elements: int, eb: ElementBytes, optimizer: str) -> list[Term]:
    """The optimizer step's temporaries on the GPU.

    torch's foreach AdamW (torch/optim/adamw.py, `_multi_tensor_adamw`) computes
    `exp_avg_sq.sqrt()` into a new list of tensors the size of the parameters it steps, then
    divides in place: one parameter-sized temporary in the state dtype.
    """
    if optimizer != "adamw" or optimizer_elements == 0:
        return []
    unit = eb.optimizer // 2 if eb.optimizer else 0
    return [Term("AdamW step temporary (sqrt of exp_avg_sq)", optimizer_elements * unit,
                 lambda: f"{optimizer_elements:,} elements * {unit} B")]


def allowance_terms(tensor_bytes: int, on_gpu: bool) -> list[Term]:
    """The CUDA context and the fragmentation allowance (GPU only)."""
    if not on_gpu:
        return []
    fragmentation = int(tensor_bytes * FRAGMENTATION)
    return [
        Term("CUDA context (allowance)", CUDA_CONTEXT_BYTES, "512 MiB per process"),
        Term("allocator fragmentation (allowance)", fragmentation,
             lambda: f"{FRAGMENTATION:.0%} of {tensor_bytes:,} B of tensors"),
    ]
