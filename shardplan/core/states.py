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

from dataclasses import dataclass, field
from functools import lru_cache

from ..spec.units import counted
from .offload import blocks, describe_moments, frees_device_grads, moment_bytes
from .precision import FP32, ElementBytes
from .quantized import adamw8bit_bytes
from .shards import chunk_size as flat_chunk_size, zero_optimizer_partition
from .stages import LocalParam, RankParams, chunk_size
from .terms import Term


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
    compression: str = "none"  # how host optimizer states are stored (fsdp2, core/offload.py)
    optimizer_kind: str = "adamw"


@dataclass(frozen=True)
class HostGroup:
    """A group of tensors whose optimizer steps on the host (fsdp2): `count` alike groups
    (layers) of `elements` local elements each; `offloaded` when the parameters live on the
    host too (CPUOffloadPolicy) rather than on the device with a host master copy."""

    label: str
    count: int
    elements: int
    offloaded: bool
    blocks: int = 0  # int8 blocks over its tensors


# Labels of the engine's host terms that are pinned on a GPU (core/host.py rounds them).
MASTER, HOST_GRADS = "fp32 master weights", "grads (host copy)"


@dataclass
class States:
    """Model-state terms of one rank, by device and kind."""

    gpu: dict[str, list[Term]] = field(default_factory=lambda: {"params": [], "grads": [], "optimizer": []})
    cpu: dict[str, list[Term]] = field(default_factory=lambda: {"params": [], "grads": [], "optimizer": []})
    host_groups: list[HostGroup] = field(default_factory=list)  # what the offload engine steps
    gpu_optimizer_elements: int = 0  # elements the GPU optimizer steps (its optimizer bytes less the steps)

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
    blocks: int = 0  # int8 blocks of those tensors (core/offload.py), for compressed host states
    states8: int = 0  # bytes of AdamW8bit's states of those tensors, steps included (core/quantized.py)

    def __add__(self, other: TensorStates) -> TensorStates:
        return TensorStates(*(a + b for a, b in zip(self.astuple(), other.astuple())))

    def astuple(self) -> tuple[int, int, int, int, int, int]:
        return (self.params, self.grads, self.optimizer, self.tensors, self.blocks, self.states8)


NONE = TensorStates(0, 0, 0, 0, 0, 0)


def _states8(local: int, eb: ElementBytes) -> int:
    """AdamW8bit's bytes for a tensor of `local` elements (0 for another optimizer): torchao
    quantizes each tensor's moments or keeps them plain by its size (core/quantized.py)."""
    return adamw8bit_bytes(local, eb.params) if eb.states8 else 0


def _zero1_order(rp: RankParams) -> tuple[list[LocalParam], int]:
    """A stage's parameters in module order (embeddings, every layer, then the rest of the
    root), as ZeroRedundancyOptimizer receives them, and how many come before the layers."""
    first = [p for p in rp.root if p.info.part in ("embedding", "position")]
    last = [p for p in rp.root if p.info.part not in ("embedding", "position")]
    return first + list(rp.layer) * rp.num_layers + last, len(first)


def fullest_zero1_index(rp: RankParams, degree: int, eb: ElementBytes) -> int:
    """The shard index whose ZeroRedundancyOptimizer partition holds the most optimizer-state
    bytes (the lowest index on a tie): per tensor AdamW8bit's own bytes, else its elements at
    the optimizer's bytes plus a step, as `_group_terms` counts them. The greedy partition
    balances elements, not bytes, and does not put rank 0 first."""
    ordered, _ = _zero1_order(rp)
    return _fullest(tuple(p.numel for p in ordered), degree, eb)


@lru_cache(maxsize=1024)
def _fullest(numels: tuple[int, ...], degree: int, eb: ElementBytes) -> int:
    held = [0] * degree
    for numel, owner in zip(numels, zero_optimizer_partition(list(numels), degree)):
        held[owner] += _states8(numel, eb) if eb.states8 else numel * eb.optimizer + eb.step
    return max(range(degree), key=lambda index: (held[index], -index))


def _zero1_optimizer(rp: RankParams, sharding: Sharding, eb: ElementBytes) -> tuple[TensorStates, TensorStates]:
    """(layers, root) optimizer elements, tensors and int8 blocks whose optimizer state this
    rank holds under ZeroRedundancyOptimizer; layers are summed over all of them."""
    ordered, before = _zero1_order(rp)
    owners = zero_optimizer_partition([p.numel for p in ordered], sharding.degree)
    layers, root = NONE, NONE
    for position, (p, owner) in enumerate(zip(ordered, owners)):
        if owner != sharding.index and p.numel >= sharding.min_num_params:
            continue
        held = TensorStates(0, 0, p.numel, 1, blocks(p.numel), _states8(p.numel, eb))
        if before <= position < before + len(rp.layer) * rp.num_layers:
            layers += held
        else:
            root += held
    return layers, root


_ELEMENTS: dict[tuple, tuple[tuple[LocalParam, ...], TensorStates]] = {}


def _fsdp2_elements(params: tuple[LocalParam, ...], sharding: Sharding, eb: ElementBytes) -> TensorStates:
    """`_fsdp2_sum` of a tensor-parallel rank's layer or root parameters, found by the tuple's
    identity: core/stages.py gives every pipeline rank and layer split the same tuples, so a
    search sums each once per sharding. The cache keeps the tuple it was asked about, which
    therefore cannot be freed and its id reused while the entry lives."""
    key = (id(params), sharding, eb)
    found = _ELEMENTS.get(key)
    if found is not None:
        return found[1]
    if len(_ELEMENTS) >= 4096:
        _ELEMENTS.clear()
    result = _fsdp2_sum(params, sharding, eb)
    _ELEMENTS[key] = (params, result)
    return result


def _fsdp2_sum(params: tuple[LocalParam, ...], sharding: Sharding, eb: ElementBytes) -> TensorStates:
    stored = grads = optimizer = tensors = num_blocks = states8 = 0
    degree, index = sharding.degree, sharding.index
    for p in params:
        whole = p.numel < sharding.min_num_params or degree == 1
        if sharding.stage >= 2 and not whole:
            padded = p.padded_shard_numel(degree)
            local = chunk_size(p.rows, degree, index) * p.row_numel
            stored += padded
            grads += padded
        else:
            local = p.numel
            stored += local
            grads += local
        optimizer += local
        tensors += 1
        num_blocks += blocks(local)
        states8 += _states8(local, eb)
    return TensorStates(stored, grads, optimizer, tensors, num_blocks, states8)


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
        held_layers, held_root = _zero1_optimizer(rp, sharding, eb)
        layers = max(rp.num_layers, 1)
        # Spread the layers' totals evenly so that num_layers * per-layer is exact.
        layer = TensorStates(layer.params, layer.grads, held_layers.optimizer // layers,
                             held_layers.tensors // layers, held_layers.blocks // layers,
                             held_layers.states8 // layers)
        root = TensorStates(root.params, root.grads, held_root.optimizer + held_layers.optimizer % layers,
                            held_root.tensors + held_layers.tensors % layers,
                            held_root.blocks + held_layers.blocks % layers,
                            held_root.states8 + held_layers.states8 % layers)
    return layer, root


def _on_cpu(kind: str, offload: Offload) -> bool:
    """Where a kind of state lives under deepspeed and zero-paper: each kind by its own flag
    (ZeRO-Offload: gradients, optimizer states; ZeRO-Infinity: parameters layer by layer,
    decided per group by the caller)."""
    return offload.grads if kind == "grads" else offload.optimizer


def _fsdp2_group(states: States, label: str, elements: TensorStates, count: int, offloaded: bool,
                 eb: ElementBytes, sharding: Sharding, offload: Offload) -> None:
    """One group's terms under fsdp2 and the runtime's offload engine (core/offload.py).

    An offloaded layer (CPUOffloadPolicy) keeps everything on the CPU and steps there without
    a master copy (fp32 parameters are their own); with `offload.optimizer`, a layer on the
    device keeps host optimizer states, an fp32 master and a host copy of its gradients."""
    def add(place: dict[str, list[Term]], kind: str, what: str, per_group: int, formula: str) -> None:
        if per_group:
            place[kind].append(Term(f"{label} {what}", count * per_group,
                                    f"{count} * ({formula})" if count > 1 else formula))

    params, grads, local = elements.params, elements.grads, elements.optimizer
    (states.cpu if offloaded else states.gpu)["params"].append(
        _term("params", f"{label} params", count, params, eb.params, 0, eb))
    host_steps = offloaded or offload.optimizer
    if not host_steps:
        states.gpu["grads"].append(_term("grads", f"{label} grads", count, grads, eb.grads, 0, eb))
        # A group may hold no element and still some tensors' steps or 8-bit bytes: under
        # ZeroRedundancyOptimizer the root takes what the layers' totals leave over (`_elements`).
        if eb.states8 and elements.states8:
            states.gpu["optimizer"].append(_states8_term(f"{label} optimizer", count, elements.states8))
        elif not eb.states8 and eb.optimizer and (local or elements.tensors):
            states.gpu["optimizer"].append(_term("optimizer", f"{label} optimizer", count, local, eb.optimizer,
                                                 elements.tensors, eb))
            states.gpu_optimizer_elements += count * local
        return
    if offloaded:
        states.cpu["grads"].append(_term("grads", f"{label} grads", count, grads, eb.grads, 0, eb))
    else:
        add(states.cpu, "grads", HOST_GRADS, local * eb.grads, f"{local:,} elements * {eb.grads} B")
        if not frees_device_grads(offload.grads, offload.optimizer, sharding.stage):
            states.gpu["grads"].append(_term("grads", f"{label} grads", count, grads, eb.grads, 0, eb))
    states.host_groups.append(HostGroup(label, count, local, offloaded, elements.blocks))
    moments = moment_bytes(local, elements.blocks, offload.compression, offload.optimizer_kind)
    add(states.cpu, "optimizer", "optimizer states", moments,
        describe_moments(local, elements.blocks, offload.compression, offload.optimizer_kind))
    if eb.step:
        add(states.cpu, "optimizer", "optimizer steps", elements.tensors * eb.step,
            f"{counted(elements.tensors, 'tensor')} * {eb.step} B")
    if not offloaded or eb.params != FP32:
        add(states.cpu, "optimizer", MASTER, local * FP32, f"{local:,} elements * {FP32} B")


def _states8_term(label: str, count: int, amount: int) -> Term:
    """8-bit moments, their block scales and maps, and the steps: exact bytes per tensor."""
    why = ("AdamW8bit: per tensor 2 * (N codes + N/256 * 4 B scales + 1,024 B map) + 4 B step, "
           "or plain moments under 4,096 elements")
    return Term(label, count * amount, lambda: f"{count} * {amount:,} B ({why})" if count > 1 else f"{amount:,} B ({why})")


def _term(kind: str, label: str, count: int, elements: int, unit: float, steps: int, eb: ElementBytes) -> Term:
    step_bytes = steps * eb.step if kind == "optimizer" else 0

    def formula() -> str:
        what = f"{elements:,} elements * {unit:g} B"
        if step_bytes:
            what += f" + {steps} steps * {eb.step} B"
        return f"{count} * ({what})" if count > 1 else what

    return Term(label, count * (int(elements * unit) + step_bytes), formula)


# The label of the resident layers' states ("layers params", "layers grads", ...).
LAYERS = "layers"


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
        (LAYERS, layer, resident, False),
        ("offloaded layers", layer, rp.num_layers - resident, True),
        # A bare parameter count has no layers: parameter offload moves all of it.
        ("all" if flat_count else "embedding/head", root, 1, flat_count and offload.params),
    )
    flat = sharding.framework != "fsdp2" and sharding.stage in (1, 2)
    states = States()
    if sharding.framework == "fsdp2":
        for label, elements, count, offloaded in groups:
            if count and (elements.params or elements.tensors):
                _fsdp2_group(states, label, elements, count, offloaded, eb, sharding, offload)
        return states
    for kind, unit, index in (("params", eb.params, 0), ("grads", eb.grads, 1), ("optimizer", eb.optimizer, 2)):
        if flat and kind != "params":
            numel = rp.numel
            elements = flat_chunk_size(numel, sharding.degree, "zero12")  # DeepSpeed flat buffer, padded to 2*degree
            why = f"DeepSpeed flat partition ceil({numel:,} / 2*{sharding.degree}) * 2"
            if kind == "grads" and sharding.stage == 1:
                elements, why = numel, "all local gradients"
            place = states.cpu if _on_cpu(kind, offload) else states.gpu
            place[kind].append(Term(kind, elements * unit, f"{why} = {elements:,} elements * {unit} B"))
            if kind == "optimizer" and place is states.gpu:
                states.gpu_optimizer_elements += elements
            continue
        for label, elements, count, offloaded in groups:
            amount = elements.astuple()[index]
            if count == 0 or amount == 0:
                continue
            cpu = offloaded if kind == "params" else _on_cpu(kind, offload)
            steps = elements.tensors if kind == "optimizer" else 0
            term = _term(kind, f"{label} {kind}", count, amount, unit, steps, eb)
            (states.cpu if cpu else states.gpu)[kind].append(term)
            if kind == "optimizer" and not cpu:
                states.gpu_optimizer_elements += count * amount
    return states
