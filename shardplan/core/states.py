"""Model states of one rank: parameters, gradients and optimizer states, on the GPU and CPU.

Sharding (`degree` ranks in the ZeRO/FSDP group, this rank at `index`):

- fsdp2 stage 2/3 (`fully_shard`): every tensor is cut along dim 0 into ceil(rows/degree)
  rows per rank; each rank stores that many rows, padding the missing ones (FSDP2
  `FSDPParam._init_sharded_param` pads dim 0 to a multiple of the world). Gradients after
  reduce-scatter have the padded shape too; AdamW's states are `zeros_like` of the unpadded
  local tensor, plus a 4-byte `step` per tensor.
- fsdp2 stage 1: DDP with torch's ZeroRedundancyOptimizer, which gives each whole parameter
  to one rank (see `zero_optimizer_partition`); stage 0: `fully_shard` on a replicate-only
  mesh, nothing sharded.
- deepspeed stage 1/2: one flat buffer of all parameters padded to a multiple of 2*degree
  elements (DeepSpeed stage_1_and_2.py, `flatten_dense_tensors_aligned` with alignment
  nccl_start_alignment_factor=2 times the data-parallel size), each rank owning 1/degree;
  stage 3: each parameter padded to a multiple of degree (partition_parameters.py `_padding_size`).

Parameters with fewer than `min_num_params` elements stay whole on every rank.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from functools import lru_cache

from .precision import ElementBytes
from .quantized import adamw8bit_bytes
from .shards import chunk_size as flat_chunk_size
from .stages import LocalParam, RankParams, chunk_size
from .terms import Term

# int8 compression of CPU copies stores one fp32 scale per group of this many elements (the
# group size GPTQ/AWQ-style weight quantizers use).
INT8_GROUP = 128
COMPRESSED_BYTES = {"fp16": 2.0, "bf16": 2.0, "int8": 1.0 + 4.0 / INT8_GROUP}


@dataclass(frozen=True)
class Sharding:
    """Where model states are sharded: framework, ZeRO stage, group size, this rank's index."""

    framework: str
    stage: int
    degree: int = 1
    index: int = 0
    min_num_params: int = 0


@dataclass(frozen=True)
class Offload:
    """What of this rank's model states lives on the CPU."""

    params: bool = False
    grads: bool = False
    optimizer: bool = False
    resident_layers: int | None = None  # layers whose parameters stay on the GPU (params offload)
    compression: str = "none"


@dataclass
class States:
    """Model-state terms of one rank, by device and kind."""

    gpu: dict[str, list[Term]] = field(default_factory=lambda: {"params": [], "grads": [], "optimizer": []})
    cpu: dict[str, list[Term]] = field(default_factory=lambda: {"params": [], "grads": [], "optimizer": []})

    def gpu_bytes(self, kind: str) -> int:
        return sum(t.bytes for t in self.gpu[kind])

    def cpu_bytes(self, kind: str) -> int:
        return sum(t.bytes for t in self.cpu[kind])


@dataclass(frozen=True)
class TensorStates:
    """Elements one rank stores for a group of tensors, before multiplying by dtype sizes."""

    params: int
    grads: int
    optimizer: int
    tensors: int  # tensors with an optimizer state on this rank (AdamW's step each)

    def __add__(self, other: TensorStates) -> TensorStates:
        return TensorStates(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int]:
        return (self.params, self.grads, self.optimizer, self.tensors)


NONE = TensorStates(0, 0, 0, 0)


def zero_optimizer_partition(numels: list[int], degree: int) -> list[int]:
    return list(_zero_partition(tuple(numels), degree))


@lru_cache(maxsize=1024)
def _zero_partition(numels: tuple[int, ...], degree: int) -> tuple[int, ...]:
    """The rank torch's ZeroRedundancyOptimizer gives each parameter (in module order):
    parameters sorted by size, largest first (a stable sort), each to the rank holding the
    fewest elements so far, the lowest such rank on ties
    (torch/distributed/optim/zero_redundancy_optimizer.py, `_partition_parameters`)."""
    loads = [(0, rank) for rank in range(degree)]  # a heap: the least loaded, lowest rank first
    owners = [0] * len(numels)
    for position in sorted(range(len(numels)), key=lambda i: -numels[i]):
        size, rank = heapq.heappop(loads)
        owners[position] = rank
        heapq.heappush(loads, (size + numels[position], rank))
    return tuple(owners)


def _zero1_optimizer(rp: RankParams, sharding: Sharding, eb: ElementBytes) -> tuple[int, int, int, int]:
    """(layer elements, layer tensors, root elements, root tensors) whose optimizer state
    this rank holds under ZeroRedundancyOptimizer; layers are summed over all of them (8-bit
    moments: their bytes, and no tensors)."""
    first = [p for p in rp.root if p.info.part in ("embedding", "position")]
    last = [p for p in rp.root if p.info.part not in ("embedding", "position")]
    ordered = first + list(rp.layer) * rp.num_layers + last
    owners = zero_optimizer_partition([p.numel for p in ordered], sharding.degree)
    layer_elements = layer_tensors = root_elements = root_tensors = 0
    for position, (p, owner) in enumerate(zip(ordered, owners)):
        if owner != sharding.index and p.numel >= sharding.min_num_params:
            continue
        amount, counted = (adamw8bit_bytes(p.numel, eb.params), 0) if eb.states8 else (p.numel, 1)
        if len(first) <= position < len(first) + len(rp.layer) * rp.num_layers:
            layer_elements, layer_tensors = layer_elements + amount, layer_tensors + counted
        else:
            root_elements, root_tensors = root_elements + amount, root_tensors + counted
    return layer_elements, layer_tensors, root_elements, root_tensors


def _fsdp2_elements(params: tuple[LocalParam, ...], sharding: Sharding, eb: ElementBytes) -> TensorStates:
    """Elements stored per kind; with 8-bit moments (`eb.states8`) `optimizer` is their exact
    bytes, steps included, tensor by tensor (AdamW8bit quantizes only some tensors)."""
    stored = grads = optimizer = tensors = 0
    degree, index = sharding.degree, sharding.index
    for p in params:
        whole = p.numel < sharding.min_num_params or degree == 1
        if sharding.stage >= 2 and not whole:
            padded = p.padded_shard_numel(degree)
            stored += padded
            grads += padded
            local = chunk_size(p.rows, degree, index) * p.row_numel
        else:
            stored += p.numel
            grads += p.numel
            local = p.numel
        optimizer += adamw8bit_bytes(local, eb.params) if eb.states8 else local
        tensors += 0 if eb.states8 else 1
    return TensorStates(stored, grads, optimizer, tensors)


def _deepspeed_zero3(params: tuple[LocalParam, ...], sharding: Sharding) -> TensorStates:
    result = NONE
    for p in params:
        part = -(-p.numel // sharding.degree)
        stored = p.numel if p.numel < sharding.min_num_params else part
        result += TensorStates(stored, part, part, 0)
    return result


def _elements(rp: RankParams, sharding: Sharding, eb: ElementBytes) -> tuple[TensorStates, TensorStates]:
    """(one layer, root) elements on this rank. Under fsdp2 stage 1 the layer figures are
    an average: ZeroRedundancyOptimizer gives whole tensors to ranks, not equal shares of
    each layer, so only the total over all layers is exact."""
    if sharding.framework != "fsdp2":  # deepspeed, zero-paper
        if sharding.stage == 3:
            return _deepspeed_zero3(rp.layer, sharding), _deepspeed_zero3(rp.root, sharding)
        layer = TensorStates(rp.layer_numel, rp.layer_numel, rp.layer_numel, 0)
        root = TensorStates(rp.root_numel, rp.root_numel, rp.root_numel, 0)
        return layer, root
    layer, root = _fsdp2_elements(rp.layer, sharding, eb), _fsdp2_elements(rp.root, sharding, eb)
    if sharding.stage == 1 and sharding.degree > 1:
        layer_elements, layer_tensors, root_elements, root_tensors = _zero1_optimizer(rp, sharding, eb)
        layers = max(rp.num_layers, 1)
        # Spread the layers' total evenly so that num_layers * per-layer is exact.
        layer = TensorStates(layer.params, layer.grads, layer_elements // layers, layer_tensors // layers)
        root = TensorStates(root.params, root.grads,
                            root_elements + layer_elements % layers, root_tensors + layer_tensors % layers)
    return layer, root


def _on_cpu(kind: str, group_offloaded: bool, framework: str, offload: Offload) -> bool:
    """Where a kind of state of a group of tensors lives.

    fsdp2 offloads layer by layer: an offloaded layer's parameters, gradients and optimizer
    states all live on the CPU (`CPUOffloadPolicy` moves gradients to the CPU and the
    optimizer steps where the parameters are); the grads/optimizer flags add nothing.
    deepspeed moves each kind by its own flag (ZeRO-Offload: gradients, optimizer states;
    ZeRO-Infinity: parameters layer by layer).
    """
    if kind == "params" or framework == "fsdp2":
        return group_offloaded
    return offload.grads if kind == "grads" else offload.optimizer


def _term(kind: str, label: str, count: int, elements: int, unit: float, steps: int, eb: ElementBytes) -> Term:
    step_bytes = steps * eb.step if kind == "optimizer" else 0

    def formula() -> str:
        what = f"{elements:,} elements * {unit:g} B"
        if step_bytes:
            what += f" + {steps} steps * {eb.step} B"
        return f"{count} * ({what})" if count > 1 else what

    return Term(label, count * (int(elements * unit) + step_bytes), formula)


def _states8_term(label: str, count: int, amount: int) -> Term:
    """8-bit moments, their block scales and maps, and the steps: exact bytes per tensor."""
    why = "AdamW8bit: per tensor 2 * (N codes + N/256 * 4 B scales + 1,024 B map) + 4 B step, or plain moments under 4,096 elements"
    return Term(label, count * amount, lambda: f"{count} * {amount:,} B ({why})" if count > 1 else f"{amount:,} B ({why})")


@lru_cache(maxsize=2048)
def rank_states(
    rp: RankParams,
    eb: ElementBytes,
    sharding: Sharding,
    offload: Offload = Offload(),
) -> States:
    """Model states of one rank, split between GPU and CPU (cached: callers must not change
    the lists it returns)."""
    layer, root = _elements(rp, sharding, eb)
    resident = rp.num_layers
    if offload.params and offload.resident_layers is not None:
        resident = min(rp.num_layers, offload.resident_layers)
    flat_count = len(rp.root) == 1 and rp.root[0].info.name == "params"
    groups = (
        ("layers", layer, resident, False),
        ("offloaded layers", layer, rp.num_layers - resident, True),
        # A bare parameter count has no layers: parameter offload moves all of it.
        ("all" if flat_count else "embedding/head", root, 1, flat_count and offload.params),
    )
    flat = sharding.framework != "fsdp2" and sharding.stage in (1, 2)
    states = States()
    for kind, unit, index in (("params", eb.params, 0), ("grads", eb.grads, 1), ("optimizer", eb.optimizer, 2)):
        if flat and kind != "params":
            numel = rp.numel
            elements = flat_chunk_size(numel, sharding.degree, "zero12")  # DeepSpeed flat buffer, padded to 2*degree
            why = f"DeepSpeed flat partition ceil({numel:,} / 2*{sharding.degree}) * 2"
            if kind == "grads" and sharding.stage == 1:
                elements, why = numel, "all local gradients"
            place = states.cpu if _on_cpu(kind, False, sharding.framework, offload) else states.gpu
            place[kind].append(Term(kind, elements * unit, f"{why} = {elements:,} elements * {unit} B"))
            continue
        for label, elements, count, offloaded in groups:
            amount = elements.astuple()[index]
            if count == 0 or amount == 0:
                continue
            cpu = _on_cpu(kind, offloaded, sharding.framework, offload)
            cost: float = unit
            if cpu and kind == "params" and offload.compression != "none":
                cost, label = COMPRESSED_BYTES[offload.compression], f"{label} ({offload.compression})"
            steps = elements.tensors if kind == "optimizer" else 0
            if kind == "optimizer" and eb.states8 and sharding.framework == "fsdp2":
                term = _states8_term(f"{label} {kind}", count, amount)
            else:
                term = _term(kind, f"{label} {kind}", count, amount, cost, steps, eb)
            (states.cpu if cpu else states.gpu)[kind].append(term)
    return states
