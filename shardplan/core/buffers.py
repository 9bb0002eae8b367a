"""Transient GPU memory beside model states and saved activations, moment by moment: the
terms calculators forget. Each term states its assumption; `core/timeline.py` says which
moments there are.

fsdp2 (torch `fully_shard`, torch/distributed/fsdp/_fully_shard):
- a block's parameters are all-gathered unsharded in the compute dtype (bf16 under
  MixedPrecisionPolicy) for its forward and again for its backward; with explicit prefetching
  `prefetch_layers` more blocks are gathered ahead. ZeRO-3 (`reshard_after_forward=True`)
  frees them after each block; ZeRO-2 (`reshard_after_forward=False`) keeps every block
  unsharded from its forward to its backward;
- the root module (embedding, final norm, head) stays unsharded between forward and backward;
  its gradients are reduce-scattered only when backward ends (the root's post-backward runs
  in `_root_post_backward_final_callback`: the root's inputs, token ids, need no gradient),
  so the head's unsharded gradient is alive through the whole backward;
- backward produces a block's unsharded gradients in the compute dtype and copies them into a
  reduce-scatter input in the reduce dtype (fp32).
Stage 0 runs `fully_shard` on a replicate-only mesh: the same buffers with one rank per
shard group. DDP (stage 1) under autocast keeps a 16-bit copy of every weight used in forward
until its backward (autocast's cast cache, saved by the matmuls); its gradient buckets are
the gradients themselves (`gradient_as_bucket_view=True`), allocated once and kept.

The allowances for the CUDA context and allocator fragmentation are stated constants.
"""

from __future__ import annotations

from functools import lru_cache

from .precision import FP32, ElementBytes
from .stages import LocalParam, RankParams
from .terms import Term
from .timeline import BACKWARD, BACKWARD_END, FORWARD, LOSS, MOMENTS

# CUDA context (driver, kernels of torch/cuBLAS/NCCL loaded lazily, NCCL's communicator): the
# device memory a `shardplan run` process uses beside what its caching allocator holds,
# measured as cudaMemGetInfo's used bytes less torch.cuda.memory_reserved: 1,329 to 1,361 MiB
# over 18 runs on an H100 (torch 2.11, CUDA 13.0, NCCL 2.28, one rank; docs/validation.md,
# benchmarks/data/gpu-ladder-h100.json), rounded up to the next 64 MiB. A fraction of the
# tensor total is lost to the caching allocator's fragmentation: the reserved peak was 5.0%
# and 7.3% over the allocated peak in the two runs without offload that filled the GPU beyond
# 70%, 11.9% to 18.8% with the optimizer offloaded (the same data). Both are allowances,
# stated in `assumptions`, not measurements of a job.
CUDA_CONTEXT_BYTES = 1408 * 2**20
FRAGMENTATION = 0.05

HEAD_PARTS = ("final_norm", "head")


def padded_unsharded(params: tuple[LocalParam, ...], degree: int) -> int:
    """Elements of an all-gathered block: each tensor's rows rounded up to a multiple of the
    shard group (FSDP2 pads dim 0 so every rank contributes the same number of rows)."""
    return sum(p.padded_shard_numel(degree) * degree for p in params)


def head_params(rp: RankParams) -> tuple[LocalParam, ...]:
    """The parameters the output head uses on this rank: final norm and head, or, with tied
    embeddings on a rank that holds both ends, the token embedding itself. Autograd sums a
    tensor's gradients from all its uses before its hooks run, so the head's share of a tied
    embedding's gradient waits in autograd's input buffer until the embedding's backward."""
    head = tuple(p for p in rp.root if p.info.part in HEAD_PARTS)
    if rp.has_head and not any(p.info.part == "head" for p in rp.root):
        head += tuple(p for p in rp.root if p.info.part == "embedding")
    return head


# The label of the blocks FSDP2 gathers (core/finetune.py's too): core/estimate.py finds the
# ZeRO-2 term that backward frees block by block by it.
UNSHARDED_BLOCKS = "unsharded block parameters"


def place_gathered_blocks(at: dict[str, list[Term]], stage: int, layers: int, block_bytes: int, one: str,
                          prefetch: int, every_in_backward: bool = False) -> None:
    """Add the blocks FSDP2 holds gathered (each `block_bytes`, `one` says of what) to their
    moments: at ZeRO-2 (`reshard_after_forward=False`) every block from forward to backward;
    otherwise the one running with its prefetch in forward and backward, or,
    `every_in_backward`, every block in backward (kept there by a pipeline schedule)."""
    every = Term(UNSHARDED_BLOCKS, layers * block_bytes, lambda: f"all {layers} blocks: {layers} * {one}")
    if stage == 2:
        for moment in (FORWARD, LOSS, BACKWARD):
            at[moment].append(every)
        return
    live = min(layers, 1 + prefetch)
    gathered = Term(UNSHARDED_BLOCKS, live * block_bytes, lambda: f"1 + prefetch {prefetch} blocks: {live} * {one}")
    at[FORWARD].append(gathered)
    at[BACKWARD].append(every if every_in_backward else gathered)


def no_buffers() -> dict[str, list[Term]]:
    return {moment: [] for moment in MOMENTS}


def fsdp2_buffers(rp: RankParams, eb: ElementBytes, stage: int, degree: int, prefetch: int,
                  mixed: bool) -> dict[str, list[Term]]:
    """Transient buffers of one rank running FSDP2 (stages 0, 2, 3) or DDP (stage 1), by moment."""
    cached = _fsdp2_buffers(rp, eb, stage, degree, prefetch, mixed)
    return {moment: list(terms) for moment, terms in cached.items()}


@lru_cache(maxsize=2048)
def _fsdp2_buffers(rp: RankParams, eb: ElementBytes, stage: int, degree: int, prefetch: int,
                   mixed: bool) -> dict[str, tuple[Term, ...]]:
    at = _fsdp2_buffer_lists(rp, eb, stage, degree, prefetch, mixed)
    return {moment: tuple(terms) for moment, terms in at.items()}


def _fsdp2_buffer_lists(rp: RankParams, eb: ElementBytes, stage: int, degree: int, prefetch: int,
                        mixed: bool) -> dict[str, list[Term]]:
    c = eb.compute
    at = no_buffers()
    if stage == 1:
        if mixed:
            numel = rp.numel
            copies = Term("16-bit weight copies held for backward (autocast)", numel * c,
                          lambda: f"{numel:,} elements * {c} B")
            for moment in (FORWARD, LOSS, BACKWARD):
                at[moment].append(copies)
        return at
    degree = 1 if stage == 0 else degree  # stage 0: replicate-only mesh, one rank per shard group
    block = padded_unsharded(rp.layer, degree)
    layers = rp.num_layers
    if layers:
        place_gathered_blocks(at, stage, layers, block * c, f"{block:,} elements * {c} B", prefetch)
        at[BACKWARD].append(Term("block gradients before reduce-scatter", block * (c + FP32),
                                 lambda: f"{block:,} elements * ({c} B unsharded + {FP32} B reduce-scatter input)"))
    root = padded_unsharded(rp.root, degree)
    if root:
        unsharded = Term("unsharded root parameters (embedding/head)", root * c,
                         lambda: f"{root:,} elements * {c} B, kept from forward to backward")
        for moment in (FORWARD, LOSS, BACKWARD):
            at[moment].append(unsharded)
        head = padded_unsharded(head_params(rp), degree)
        if head:
            grads = Term("unsharded head gradients (reduced when backward ends)", head * c,
                         lambda: f"{head:,} elements * {c} B")
            at[LOSS].append(grads)
            at[BACKWARD].append(grads)
        at[BACKWARD_END].append(Term("root gradients and their reduce-scatter input", root * (c + FP32),
                                     lambda: f"{root:,} elements * ({c} + {FP32}) B"))
    return at


# The labels of what torch's pipeline schedules keep until the step ends under FSDP2.
DEFERRED_GRADS = "gradients accumulated unsharded (reduced when the step ends)"
KEPT_BLOCKS = "blocks kept gathered since their backward"


def deferred_grads(rp: RankParams, eb: ElementBytes, stage: int, degree: int) -> list[Term]:
    """The gradients FSDP2 accumulates unsharded when torch's pipeline schedules run its
    modules: every backward but the step's last runs with `set_requires_gradient_sync(False)`
    (torch/distributed/pipelining/stage.py, `backward_maybe_with_nosync`), so each parameter's
    unsharded gradient is kept, in the reduce dtype (fp32 under bf16-mixed:
    `FSDPParam.to_accumulated_grad_if_needed`; the parameter dtype otherwise), summed over the
    microbatches, and reduce-scattered only by the stage's `perform_reduce_grad` at the end of
    the step. Every parameter of the rank, all-gather padding included."""
    degree = 1 if stage == 0 else degree
    numel = rp.num_layers * padded_unsharded(rp.layer, degree) + padded_unsharded(rp.root, degree)
    r = eb.grads
    return [Term(DEFERRED_GRADS, numel * r, lambda: f"{numel:,} elements * {r} B")] if numel else []


def pipelined_fsdp2_buffers(rp: RankParams, eb: ElementBytes, stage: int, degree: int, prefetch: int,
                            kept_in_loss: bool) -> dict[str, list[Term]]:
    """Transient buffers of one rank whose FSDP2 modules run in torch's pipeline stages.

    The schedules set `set_reshard_after_backward(False)` for every backward
    (`backward_maybe_with_nosync`) and reshard only in `perform_reduce_grad` when the step
    ends; the multi-stage schedules also unshard whole stages ahead (`_add_unshard_reshard`).
    So a block, once through its backward, stays gathered until its next forward reshards it
    (ZeRO-3, and stage 0's 16-bit copies: `reshard_after_forward=True`) or until the step
    ends (ZeRO-2). Under one-chunk 1F1B each forward follows a backward: at the end of the
    forward and at the start of a backward sweep the blocks of the previous sweep are
    resharded, and the sweep's end, where they are all gathered again, is core/estimate.py's
    `last_layer_backward`. Where a backward (or the loss) can follow another backward with no
    forward between them (gpipe, round-robin, several chunks per rank), every block is
    counted gathered there: an upper bound. When the step ends every block is gathered and
    the first group reduced (the root, whose parameters are resharded first, else a block)
    allocates its reduce-scatter input in the reduce dtype (`foreach_reduce`)."""
    c, r = eb.compute, eb.grads
    degree = 1 if stage == 0 else degree
    block = padded_unsharded(rp.layer, degree)
    root = padded_unsharded(rp.root, degree)
    several = len(rp.chunk_layers) > 1
    first = max(root, block) if several else (root or block)
    what = "the root's or a block's" if several else "the root's" if root else "a block's"
    reduced = Term(f"reduce-scatter input of the first group reduced ({what})", first * r,
                   lambda: f"{first:,} elements * {r} B") if first else None
    grads = Term("block gradients before accumulation", block * c,
                 lambda: f"{block:,} elements * {c} B, added to the unsharded gradients")
    return pipelined_buffers(stage, rp.num_layers, several, block * c, f"{block:,} elements * {c} B",
                             root * c, f"{root:,} elements * {c} B", prefetch, kept_in_loss, grads, reduced)


def pipelined_buffers(stage: int, layers: int, several: bool, block: int, one: str, root: int, root_source: str,
                      prefetch: int, kept_in_loss: bool, block_grads: Term | None, reduced: Term | None,
                      root_label: str = "unsharded root parameters (embedding/head)") -> dict[str, list[Term]]:
    """`pipelined_fsdp2_buffers` of blocks of `block` gathered bytes (`one` says of what) and
    a root of `root` gathered bytes; `block_grads`: a backward's unsharded block gradients
    before they are added to the accumulated ones. `reduced`: the reduce-scatter input of
    the first group reduced when the step ends, after its parameters were resharded (a
    block's when there is no root and one chunk); None where the gradients are too small for
    that moment to matter (LoRA's adapters): then the step's end is the moment just before
    the reduction, every block and the root gathered."""
    at = no_buffers()
    if layers:
        place_gathered_blocks(at, stage, layers, block, one, prefetch, every_in_backward=several)
        if stage != 2 and kept_in_loss:
            at[LOSS].append(Term(KEPT_BLOCKS, layers * block,
                                 lambda: f"{layers} * {one} (a backward before, no forward since)"))
        if block_grads is not None:
            at[BACKWARD].append(block_grads)
        kept = layers if root or several or reduced is None else layers - 1
        if kept:
            at[BACKWARD_END].append(Term(KEPT_BLOCKS, kept * block,
                                         lambda: f"{kept} * {one} until their reduction"))
    if root:
        unsharded = Term(root_label, root, lambda: f"{root_source}, kept from forward to backward")
        for moment in (FORWARD, LOSS, BACKWARD):
            at[moment].append(unsharded)
        if several or reduced is None:  # not yet resharded (or the first stage reduced may not hold it)
            at[BACKWARD_END].append(unsharded)
    if reduced is not None:
        at[BACKWARD_END].append(reduced)
    return at


def grads_in_flight(rp: RankParams, eb: ElementBytes, stage: int, degree: int,
                    resident: int) -> dict[str, list[Term]]:
    """Gradients on the device between their reduction and their copy to the host, when the
    offload engine frees them once copied (`offload.grads` + `offload.optimizer`): one
    resident block's sharded gradients during backward, the root's when backward ends."""
    at = no_buffers()
    degree = 1 if stage == 0 else degree
    block = sum(p.padded_shard_numel(degree) for p in rp.layer) * eb.grads
    if block and resident:
        at[BACKWARD].append(Term("one block's sharded gradients awaiting their copy to the host", block,
                                 lambda: f"{block // eb.grads:,} elements * {eb.grads} B"))
    root = sum(p.padded_shard_numel(degree) for p in rp.root) * eb.grads
    if root:
        at[BACKWARD_END].append(Term("root gradients awaiting their copy to the host", root,
                                     lambda: f"{root // eb.grads:,} elements * {eb.grads} B"))
    return at


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


ALLOWANCE = " (allowance)"  # how the allowances' labels end


def allowance_terms(tensor_bytes: int, on_gpu: bool) -> list[Term]:
    """The CUDA context and the fragmentation allowance (GPU only)."""
    if not on_gpu:
        return []
    fragmentation = int(tensor_bytes * FRAGMENTATION)
    return [
        Term("CUDA context" + ALLOWANCE, CUDA_CONTEXT_BYTES, "1,408 MiB per process (measured on an H100)"),
        Term("allocator fragmentation" + ALLOWANCE, fragmentation,
             lambda: f"{FRAGMENTATION:.0%} of {tensor_bytes:,} B of tensors"),
    ]


def allowances_in(terms) -> dict[str, int]:
    """The allowances among a moment's buffer terms, by name ("CUDA context", "allocator
    fragmentation"): what the estimate adds beside the tensors the allocator counts."""
    return {t.label.removesuffix(ALLOWANCE): t.bytes for t in terms if t.label.endswith(ALLOWANCE)}
