"""Model states and transient buffers of one rank under LoRA / QLoRA.

What trains is the adapters: their parameters, gradients and optimizer states follow the
framework's rules for trainable tensors (core/states.py, core/deepspeed.py) over the adapters
alone. The frozen base has parameters only, no gradients and no optimizer states, stored in
bf16 or, for QLoRA's layer linears, as NF4 (core/quantized.py). Where it lives:

- fsdp2 (`fully_shard` shards every parameter, trainable or not): stages 2 and 3 keep each
  frozen tensor's padded dim-0 shard (an NF4 weight: its shard of codes, scalers and factors,
  and a reference to its mean and code book); stages 0 and 1 whole tensors. Offloaded layers
  keep their frozen base on the host too (`CPUOffloadPolicy` moves the whole block).
- deepspeed: only trainable parameters enter the optimizer's flat buffers; at stages 0-2 the
  frozen base stays in the module as plain, whole tensors on every rank, at stage 3
  (`zero.Init` partitions every parameter) each frozen tensor is partitioned to
  ceil(numel / dp) elements (stage3.py, partition_parameters.py `_padding_size`), on the
  host under `offload_param` (`Init` takes its device as `remote_device` and allocates every
  partition there, pinned as it says: partition_parameters.py, `Init.__init__` and
  `_partition_param`).
- zero-paper: the paper's formulas for the trainable parameters, the frozen base at its stored
  size, partitioned at stage 3.

Buffers under fsdp2: a block is all-gathered for forward and backward with its frozen base in
the compute dtype (FSDP2 casts the bf16 base to `param_dtype`) or, for NF4 weights, as the
gathered codes, scalers and factors (torchao's `fsdp_pre_all_gather` sends those, not bf16);
only the adapters have gradients to reduce-scatter. F.linear on an NF4 weight dequantizes it
whole (torchao's `LinearNF4`, forward and backward): the largest one's working set is a
transient of every forward and backward moment.
"""

from __future__ import annotations

from dataclasses import replace

from ..spec.units import counted
from .buffers import pipelined_buffers, place_gathered_blocks
from .deepspeed import persists, pinned_bytes
from .lora import BASE_BYTES, LoraPlan, stores_nf4
from .precision import FP32, ElementBytes
from .quantized import nf4_bytes, nf4_dequant_bytes, nf4_shared_bytes, nf4_sharded_bytes
from .stages import LocalParam, RankParams
from .terms import Term
from .timeline import BACKWARD, FORWARD, LOSS, MOMENTS

ROOT_FROZEN = "unsharded root parameters (embedding/head, frozen)"


def trainable_params(rp: RankParams) -> RankParams:
    """The adapters as a rank's parameters (layers of adapters, no root)."""
    return RankParams(rp.num_layers, rp.chunk_layers, rp.adapters, (), rp.has_head)


def frozen_bytes(p: LocalParam, lora: LoraPlan, degree: int, how: str) -> int:
    """Bytes one rank stores of the frozen parameter `p`, held `how`: "whole" (as built, every
    rank the same), "fsdp2" (FSDP2's padded dim-0 shard over `degree` ranks, 1 at stage 0: an
    NF4 tensor then holds fresh copies of its pieces) or "partition" (DeepSpeed stage 3's flat
    ceil(numel / degree))."""
    nf4 = stores_nf4(p.info, lora)
    if how == "whole":
        return nf4_bytes(p.numel) if nf4 else p.numel * BASE_BYTES
    numel = p.padded_shard_numel(degree) if how == "fsdp2" else -(-p.numel // degree)
    if nf4:
        return nf4_sharded_bytes(numel) + nf4_shared_bytes()
    return numel * BASE_BYTES


def frozen_terms(rp: RankParams, lora: LoraPlan, degree: int, resident: int,
                 held: str, root_on_host: bool = False) -> tuple[list[Term], list[Term]]:
    """(GPU, host) terms of the frozen base on this rank, held as `frozen_bytes` says; layers
    past `resident` on the host, and the root there too with `root_on_host`."""
    layer = sum(frozen_bytes(p, lora, degree, held) for p in rp.layer)
    root = sum(frozen_bytes(p, lora, degree, held) for p in rp.root)
    how = "NF4 layer linears, bf16 elsewhere" if lora.nf4 else "bf16"
    cut = f", sharded over {degree}" if held != "whole" and degree > 1 else ""
    gpu, cpu = [], []
    for label, count, place in (("layers", resident, gpu), ("offloaded layers", rp.num_layers - resident, cpu)):
        if count and layer:
            place.append(Term(f"frozen base, {label}", count * layer,
                              lambda count=count: f"{count} * {layer:,} B ({how}{cut})"))
    if root:
        (cpu if root_on_host else gpu).append(Term("frozen base, embedding/head", root, f"{root:,} B (bf16{cut})"))
    return gpu, cpu


def pinned_frozen_terms(rp: RankParams, lora: LoraPlan, degree: int, offloaded: int, held: str) -> list[Term]:
    """Host memory of the offloaded layers' frozen base under fsdp2's CPUOffloadPolicy with
    pinned memory: each parameter is pinned on its own (`FSDPParam`: `pin_memory()` per
    parameter, frozen ones too), taking the power of two above its size (core/host.py)."""
    sizes = [frozen_bytes(p, lora, degree, held) for p in rp.layer]
    if not offloaded or not sum(sizes):
        return []
    each = sum(pinned_bytes(size) for size in sizes)
    return [Term("frozen base, offloaded layers (pinned, each rounded up to a power of two)", offloaded * each,
                 lambda: f"{offloaded} * sum over {counted(len(sizes), 'tensor')} of their pinned sizes = {offloaded} * {each:,} B")]


def _gathered(p: LocalParam, lora: LoraPlan, degree: int, compute: int) -> int:
    """Bytes of a frozen tensor all-gathered for compute by FSDP2. NF4 weights on a shard group
    of one rank are left out of FSDP2 whole (runtime/parallel.py `kept_whole`): nothing gathered."""
    if stores_nf4(p.info, lora):
        return nf4_sharded_bytes(p.padded_shard_numel(degree)) * degree if degree > 1 else 0
    return p.padded_shard_numel(degree) * degree * compute


def largest_nf4(rp: RankParams, lora: LoraPlan) -> int:
    """Elements of this rank's largest NF4 weight (0 without NF4)."""
    return max((p.numel for p in rp.layer if stores_nf4(p.info, lora)), default=0) if rp.num_layers else 0


def dequant_terms(rp: RankParams, lora: LoraPlan) -> list[Term]:
    """The working set of dequantizing the rank's largest NF4 weight (forward and backward)."""
    numel = largest_nf4(rp, lora)
    if not numel:
        return []
    size = nf4_dequant_bytes(numel)
    return [Term("NF4 dequantization of one linear (largest)", size,
                 lambda: f"{numel:,} elements * (8 B int64 codes + 3 * 2 B bf16 values) + {numel // 64:,} scalers * 2 B")]


def gathered_block_bytes(rp: RankParams, lora: LoraPlan, degree: int, compute: int) -> int:
    """Bytes of one block FSDP2 gathers under LoRA: its frozen base (`_gathered`) and its
    adapters in the compute dtype."""
    return sum(_gathered(p, lora, degree, compute) for p in rp.layer) + _adapter_elements(rp, degree) * compute


def _adapter_elements(rp: RankParams, degree: int) -> int:
    return sum(p.padded_shard_numel(degree) * degree for p in rp.adapters)


def lora_fsdp2_buffers(rp: RankParams, eb: ElementBytes, lora: LoraPlan, stage: int, degree: int,
                       prefetch: int) -> dict[str, list[Term]]:
    """Transient buffers of an FSDP2 rank (stages 0, 2, 3) under LoRA, by moment."""
    c = eb.compute
    at: dict[str, list[Term]] = {m: [] for m in MOMENTS}
    degree = 1 if stage == 0 else degree
    adapters = _adapter_elements(rp, degree)
    block = gathered_block_bytes(rp, lora, degree, c)
    layers = rp.num_layers
    if layers:
        place_gathered_blocks(at, stage, layers, block, f"{block:,} B (frozen base gathered, adapters in {c} B)",
                              prefetch)
        if adapters:
            at[BACKWARD].append(Term("adapter gradients before reduce-scatter", adapters * (c + FP32),
                                     lambda: f"{adapters:,} elements * ({c} B unsharded + {FP32} B reduce-scatter input)"))
        for moment in (FORWARD, BACKWARD):
            at[moment] += dequant_terms(rp, lora)
    root = sum(_gathered(p, lora, degree, c) for p in rp.root)
    if root:
        unsharded = Term(ROOT_FROZEN, root, lambda: f"{root:,} B in {c}-byte elements, kept from forward to backward")
        for moment in (FORWARD, LOSS, BACKWARD):
            at[moment].append(unsharded)
    return at


def lora_pipelined_buffers(rp: RankParams, eb: ElementBytes, lora: LoraPlan, stage: int, degree: int,
                           prefetch: int, kept_in_loss: bool) -> dict[str, list[Term]]:
    """`lora_fsdp2_buffers` when torch's pipeline schedules run the FSDP2 modules: they keep
    each block gathered after its backward and the adapters' gradients unsharded until the
    step ends, as for full training (core/buffers.py `pipelined_fsdp2_buffers`). Only the
    adapters have gradients, and the root none (it is frozen): when the step ends the root and
    the first block are resharded before anything is allocated for their reduction, so the
    step's end is the moment just before it, every block and the root gathered."""
    c = eb.compute
    degree = 1 if stage == 0 else degree
    adapters = _adapter_elements(rp, degree)
    block = gathered_block_bytes(rp, lora, degree, c)
    root = sum(_gathered(p, lora, degree, c) for p in rp.root)
    grads = Term("adapter gradients before accumulation", adapters * c,
                 lambda: f"{adapters:,} elements * {c} B, added to the unsharded gradients") if adapters else None
    at = pipelined_buffers(stage, rp.num_layers, len(rp.chunk_layers) > 1, block,
                           f"{block:,} B (frozen base gathered, adapters in {c} B)", root,
                           f"{root:,} B in {c}-byte elements", prefetch, kept_in_loss, grads, None, ROOT_FROZEN)
    if rp.num_layers:
        for moment in (FORWARD, BACKWARD):
            at[moment] += dequant_terms(rp, lora)
    return at


def lora_ddp_buffers(rp: RankParams, eb: ElementBytes) -> dict[str, list[Term]]:
    """DDP (stage 1) under autocast: 16-bit copies of the adapters used in forward, kept for
    backward (the frozen base is bf16 already: autocast's cast is a no-op)."""
    at: dict[str, list[Term]] = {m: [] for m in MOMENTS}
    numel = rp.num_layers * sum(p.numel for p in rp.adapters)
    if numel and eb.params != eb.compute:
        copies = Term("16-bit adapter copies held for backward (autocast)", numel * eb.compute,
                      lambda: f"{numel:,} elements * {eb.compute} B")
        for moment in (FORWARD, LOSS, BACKWARD):
            at[moment].append(copies)
    return at


def deepspeed_frozen_buffers(rp: RankParams, lora: LoraPlan, stage: int) -> dict[str, list[Term]]:
    """DeepSpeed stage 3 gathers a module's parameters whole when it runs: a layer's frozen
    base is fetched in forward and again in backward (one layer at a time, prefetch aside)."""
    at: dict[str, list[Term]] = {m: [] for m in MOMENTS}
    if stage != 3 or not rp.num_layers:
        return at
    layer = sum(frozen_bytes(p, lora, 1, "whole") for p in rp.layer)
    gathered = Term("gathered frozen layer (stage 3)", layer, f"{layer:,} B, one layer whole")
    for moment in (FORWARD, BACKWARD):
        at[moment].append(gathered)
        at[moment] += dequant_terms(rp, lora)
    return at


def deepspeed_persistent_frozen(rp: RankParams, lora: LoraPlan, threshold: int, degree: int,
                                on_host: bool) -> tuple[list[Term], RankParams]:
    """DeepSpeed stage 3 keeps small tensors whole besides their partition (`persists`), the
    frozen base's too: its norm weights (and, in small models, whole linears). With
    offload_param their partitions stay on the GPU as well: `_partition_param` allocates a
    persistent tensor's partition on the local device (zero/partition_parameters.py lines
    1829-1830), and only trainable partitions move to the optimizer's host buffer. Returns the
    GPU term and the rank's parameters less those the term holds (all of them on the GPU)."""
    layer = [p for p in rp.layer if persists(p.numel, threshold)]
    root = [p for p in rp.root if persists(p.numel, threshold)]
    count = rp.num_layers * len(layer) + len(root)
    if not count:
        return [], rp
    whole = rp.num_layers * sum(frozen_bytes(p, lora, 1, "whole") for p in layer)
    whole += sum(frozen_bytes(p, lora, 1, "whole") for p in root)
    label = "frozen base, persistent tensors kept whole (stage 3)"
    if not on_host:
        return [Term(label, whole, lambda: f"{counted(count, 'tensor')} of at most {threshold:,} elements, "
                     f"{whole:,} B")], rp
    parts = rp.num_layers * sum(frozen_bytes(p, lora, degree, "partition") for p in layer)
    parts += sum(frozen_bytes(p, lora, degree, "partition") for p in root)
    rest = replace(rp, layer=tuple(p for p in rp.layer if p not in layer),
                   root=tuple(p for p in rp.root if p not in root))
    return [Term(label + " and their partitions", whole + parts,
                 lambda: f"{counted(count, 'tensor')} of at most {threshold:,} elements: {whole:,} B whole "
                 f"+ {parts:,} B of partitions (on the GPU under offload_param)")], rest
