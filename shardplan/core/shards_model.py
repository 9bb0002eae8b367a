"""What each rank of a ZeRO/FSDP shard group holds of a model's parameters, per style.

The sharding unit differs by framework, and with it where the padding goes:

- `fsdp2` (`fully_shard`): every parameter alone, cut along dim 0 with torch.chunk
  semantics; each rank stores ceil(rows / world) rows (`padded_sharded_param_size`), so a
  rank with fewer (or no) rows stores padding rows.
- `zero3` (DeepSpeed ZeRO-3): every parameter alone, flattened, ceil(numel / world) elements
  per rank (`partition_parameters.py`, `_padding_size`).
- `fsdp1` (FullyShardedDataParallel with one unit per transformer block, the usual
  auto-wrap policy): one FlatParameter per block plus one for the root's remaining
  parameters (embedding, final norm, head), each padded to a multiple of the world.
- `zero12` (DeepSpeed ZeRO-1/2): one flat buffer per optimizer parameter group, in the groups
  and order core/deepspeed.py `weight_decay_groups` uses (matrices, then vectors without weight
  decay), each padded on its own to a multiple of 2 * world and split evenly over the ranks
  (deepspeed/runtime/zero/stage_1_and_2.py lines 440-446 `aligned_numel`, `bit16_groups_flat`;
  line 586 `partition_size`): a rank stores padded / world of every group.
- `even`: all parameters in one flat buffer split evenly, no padding (the ideal balance).

Which parameters a pipeline rank holds and each one's tensor-parallel piece come from
`core/stages.py`, the rule `estimate` uses too: Megatron-LM placement (embedding on the first
stage, final norm and head on the last, a tied embedding's copy as the last stage's head),
loop placement of virtual chunks, torch.chunk pieces along `ParamInfo.tp_dim` (DTensor
`Shard(dim)`), and whole replicated key/value heads when tp exceeds them. The shard group
shares one tp rank's pieces. Each pipeline stage has its own shard group over the same
shard ranks, so totals are per (stage, rank).

Under LoRA (`core/lora.py`) the parameters are those `shardplan run` builds: each targeted
linear's frozen weight as peft renames it (`<linear>.base_layer.weight`) followed by its
adapters (`<linear>.lora_A.default.weight`, `<linear>.lora_B.default.weight`), all of them
parameters FSDP2 shards. The adapters are stored like any trainable parameter
(`param_element_bytes`); the frozen base as the estimate counts it (`core/finetune.py`
`frozen_bytes`): bf16, or torchao NF4 for the layer linears under QLoRA, whose dim-0 shards
keep their 4-bit codes, block scalers and factors plus a reference to the tensor's mean and
code book. Only trainable parameters enter a flat optimizer buffer (DeepSpeed stage 1/2 flattens
the parameters that require a gradient): under the flat styles the frozen base stays whole on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..spec.errors import PlanError
from ..spec.model import ModelShape
from .deepspeed import decays, persists, weight_decay_groups
from .finetune import frozen_bytes
from .lora import LoraPlan, adapter_params, stores_nf4
from .precision import FP32, element_bytes as precision_bytes
from .params import ParamInfo, layer_params
from .shards import RankShare, Shard, assign_blocks, ceil_div, chunk_rows, ownership, shard_ranges
from .stages import LocalParam, rank_chunks, rank_params

PER_PARAM_STYLES = ("fsdp2", "zero3")
FLAT_STYLES = ("fsdp1", "zero12", "even")
FROZEN_UNIT = "frozen"  # the unit of LoRA's frozen base under the flat styles: none, kept whole

# Bytes of one stored parameter element. Mixed precision under torch FSDP keeps the sharded
# parameter in fp32 and casts only for compute and communication (FSDP2
# MixedPrecisionPolicy, FSDP1 MixedPrecision); DeepSpeed ZeRO keeps 16-bit model parameters
# (the fp32 master copy is optimizer state).
# Whose accounting each style follows (core.precision); `even` follows the job's framework.
STYLE_FRAMEWORK = {"fsdp1": "fsdp2", "fsdp2": "fsdp2", "zero3": "deepspeed", "zero12": "deepspeed"}


def param_element_bytes(precision: str, style: str, framework: str) -> int:
    """Bytes per stored parameter element (core.precision.element_bytes): fp32 4, bf16 2;
    mixed precision 4 under the torch FSDP styles (fp32 shards), 2 under the DeepSpeed styles
    (16-bit parameters)."""
    return precision_bytes(STYLE_FRAMEWORK.get(style, framework), precision, "adamw").params


def dtype_name(precision: str, element_bytes: int) -> str:
    """The dtype of a trainable parameter stored in `element_bytes` bytes under `precision`."""
    if element_bytes == FP32:
        return "fp32"
    return "fp16" if precision.startswith("fp16") else "bf16"


@dataclass(frozen=True)
class PlacedParam:
    """A parameter as one pipeline rank and one tensor-parallel rank hold it."""

    info: ParamInfo
    stage: int  # the pipeline rank holding it
    local_shape: tuple[int, ...]  # its tensor-parallel piece
    trainable: bool = True  # False: LoRA's frozen base
    runtime_name: str = ""  # the name `shardplan run` gives it, where it differs from info.name

    @property
    def name(self) -> str:
        return self.runtime_name or self.info.name


BASE_LAYER = ".base_layer"  # peft moves a wrapped linear's parameters under this submodule


def _linear_of(param: ParamInfo) -> str:
    """The module path of a parameter (`layers.0.attn.q_proj` of `...q_proj.weight`)."""
    return param.name.rsplit(".", 1)[0]


def _lora_layer(base: list[ParamInfo], templates: tuple[LocalParam, ...], adapters: list[ParamInfo],
                adapter_templates: tuple[LocalParam, ...], stage: int) -> list[PlacedParam]:
    """One layer under LoRA in module order: a wrapped linear's base parameters (renamed
    `<linear>.base_layer.<name>`), then its adapters, as peft's LoraLayer registers them."""
    by_linear: dict[str, list[PlacedParam]] = {}
    for info, template in zip(adapters, adapter_templates):
        linear = info.name.split(".lora_", 1)[0]
        by_linear.setdefault(linear, []).append(PlacedParam(info, stage, template.shape))
    placed: list[PlacedParam] = []
    for index, (info, template) in enumerate(zip(base, templates)):
        linear = _linear_of(info)
        wrapped = linear in by_linear
        name = f"{linear}{BASE_LAYER}.{info.name.rsplit('.', 1)[1]}" if wrapped else ""
        placed.append(PlacedParam(info, stage, template.shape, trainable=False, runtime_name=name))
        last_of_linear = index + 1 == len(base) or _linear_of(base[index + 1]) != linear
        if wrapped and last_of_linear:
            placed += by_linear[linear]
    return placed


def placed_params(
    shape: ModelShape, pp: int = 1, virtual: int = 1, tp: int = 1, tp_rank: int = 0,
    split: tuple[int, int] = (0, 0), lora: LoraPlan | None = None,
) -> list[PlacedParam]:
    """Every parameter of every pipeline rank, stage by stage, in module order inside a stage
    (embeddings, the stage's layers, final norm and head), as `stages.rank_params` places
    and cuts them; with `lora`, the base frozen and each layer's adapters beside their linears."""
    if pp < 1 or virtual < 1 or shape.num_layers < pp * virtual:
        raise PlanError(f"cannot split {shape.num_layers} layers into {pp} x {virtual} pipeline stages")
    if not 0 <= tp_rank < tp:
        raise PlanError(f"tp rank {tp_rank} is out of range 0..{tp - 1}")
    placed: list[PlacedParam] = []
    trainable = lora is None
    for stage in range(pp):
        held = rank_params(shape, pp, virtual, stage, tp, tp_rank, split, lora)
        before = [lp for lp in held.root if lp.info.part in ("embedding", "position")]
        after = [lp for lp in held.root if lp.info.part not in ("embedding", "position")]
        placed += [PlacedParam(lp.info, stage, lp.shape, trainable) for lp in before]
        for chunk in rank_chunks(shape.num_layers, pp, virtual, stage, split):
            for layer in chunk:  # layers are alike: layer i has the template's local shapes
                base = layer_params(shape, layer)
                if lora is not None:
                    placed += _lora_layer(base, held.layer, adapter_params(base, lora), held.adapters, stage)
                    continue
                placed += [PlacedParam(info, stage, template.shape) for info, template in zip(base, held.layer)]
        placed += [PlacedParam(lp.info, stage, lp.shape, trainable) for lp in after]
    return placed


@dataclass(frozen=True)
class ParamShards:
    """One parameter's tensor-parallel piece and what each shard rank holds of it."""

    name: str
    shape: tuple[int, ...]
    local_shape: tuple[int, ...]  # after tensor parallel (the tp rank shown)
    layer: int | None
    stage: int
    unit: str  # the sharding unit: the parameter itself, a block's FlatParameter, a buffer
    replicated: bool  # every rank holds it whole (below min_num_params; LoRA's frozen base in a flat style)
    shards: tuple[Shard, ...]  # element offsets in the flattened local tensor
    rows: tuple[int, ...] | None  # fsdp2: dim-0 rows each rank holds
    dtype: str = "fp32"  # how it is stored: fp32, bf16, fp16, or nf4 (QLoRA's base linears)
    trainable: bool = True
    stored_bytes: tuple[int, ...] = ()  # bytes each rank stores of it, padding included
    persistent_bytes: int = 0  # DeepSpeed stage 3: a whole copy kept on every rank besides the partition
    group: int | None = None  # zero12: the optimizer parameter group (its flat buffer) of the stage

    @property
    def persistent(self) -> bool:
        return self.persistent_bytes > 0

    @property
    def numel(self) -> int:
        return prod(self.local_shape)


@dataclass(frozen=True)
class FlatBuffer:
    """A flat sharding unit holding several parameters (fsdp1, zero12, even)."""

    name: str
    stage: int
    numel: int
    num_params: int
    shards: tuple[Shard, ...]
    group: int | None = None  # zero12: the optimizer parameter group's index in its stage (bit16_groups_flat[i])
    matrices: bool | None = None  # zero12: the group of matrices (weight decay) or of vectors (none)

    @property
    def padded_numel(self) -> int:
        """Elements the ranks store of it together, padding included."""
        return sum(s.stored for s in self.shards)


@dataclass(frozen=True)
class RankTotal:
    """Everything one shard rank of one pipeline stage stores."""

    stage: int
    rank: int
    numel: int  # real parameter elements
    padding: int  # padding elements
    stored_bytes: int  # (numel + padding) * element bytes


@dataclass(frozen=True)
class ModelShards:
    style: str
    world: int
    element_bytes: int  # of the trainable parameters (under LoRA: the adapters)
    params: list[ParamShards]
    buffers: list[FlatBuffer]
    totals: list[RankTotal]
    frozen_dtype: str | None = None  # LoRA: the frozen base's storage (bf16 | nf4); None: full training
    dtype: str = "fp32"  # the trainable parameters' storage (`Storage.dtype`)


@dataclass(frozen=True)
class Storage:
    """How parameters are stored: trainable ones in `element_bytes` each; with `lora`, the
    frozen base as `core/finetune.py` counts it (bf16, or NF4 for QLoRA's layer linears)."""

    element_bytes: int = FP32
    dtype: str = "fp32"
    lora: LoraPlan | None = None

    def param_dtype(self, param: PlacedParam) -> str:
        if param.trainable:
            return self.dtype
        return "nf4" if stores_nf4(param.info, self.lora) else "bf16"

    def bytes(self, param: PlacedParam, shard: Shard, world: int, how: str) -> int:
        """Bytes one rank stores of `param`, whose part is `shard`; a frozen parameter held
        `how` over `world` ranks (`frozen_bytes`: "whole", "fsdp2" or "partition")."""
        if param.trainable or self.lora is None:
            return shard.stored * self.element_bytes
        if shard.stored == 0:  # a flat buffer's member this rank holds nothing of
            return 0
        return frozen_bytes(LocalParam(param.info, param.local_shape), self.lora, world, how)


def _rows_shards(local_shape: tuple[int, ...], world: int) -> tuple[tuple[Shard, ...], tuple[int, ...]]:
    """FSDP2: dim-0 rows per rank, padded to ceil(rows / world) rows each."""
    dim0 = local_shape[0] if local_shape else 1
    row_numel = prod(local_shape[1:]) if local_shape else 1
    rows = chunk_rows(dim0, world)
    chunk = ceil_div(dim0, world)
    shards = []
    for rank, held in enumerate(rows):
        start = min(rank * chunk, dim0) * row_numel
        shards.append(Shard(rank, start, start + held * row_numel, (chunk - held) * row_numel))
    return tuple(shards), tuple(rows)


def _unit_name(style: str, param: ParamInfo, stage: int, pp: int, group: int | None = None) -> str:
    suffix = f".stage{stage}" if pp > 1 else ""
    if style == "fsdp1":
        return f"layers.{param.layer}" if param.layer is not None else f"root{suffix}"
    return f"flat{suffix}" + (f".group{group}" if group is not None else "")


def optimizer_groups_of(members: list[PlacedParam]) -> list[tuple[bool, list[PlacedParam]]]:
    """One pipeline stage's trainable parameters as DeepSpeed's optimizer parameter groups, in
    the groups and order core/deepspeed.py `weight_decay_groups` gives `flat_groups` (matrices,
    then vectors; empty groups dropped), each in module order, with whether it is the matrices'.
    ZeRO-1/2 flattens each group into a buffer of its own (stage_1_and_2.py line 423 `for i,
    param_group in enumerate(self.optimizer.param_groups)`)."""
    local = [LocalParam(p.info, p.local_shape) for p in members]
    placed_of = {id(lp): p for lp, p in zip(local, members)}
    return [(decays(group[0]), [placed_of[id(lp)] for lp in group]) for group in weight_decay_groups(local)]


def model_shards(
    placed: list[PlacedParam],
    world: int,
    style: str,
    element_bytes: int = FP32,
    min_numel: int = 0,
    storage: Storage | None = None,
    persistent_at_most: int | None = None,
    optimizer_groups: bool = True,
) -> ModelShards:
    """Per-parameter shards, flat buffers and per-(stage, rank) totals of a model.

    `placed` gives each parameter's pipeline rank and tensor-parallel piece
    (`placed_params`); `min_numel` keeps smaller trainable parameters whole on every rank
    under the per-parameter styles (FSDP's min_num_params; the estimate cuts LoRA's frozen base
    regardless). `storage` says how each
    parameter is stored (default: `element_bytes` each, full training). `persistent_at_most`
    (the zero3 style, DeepSpeed stage 3's stage3_param_persistence_threshold): parameters of at
    most that many elements, frozen ones too, are partitioned and also kept whole on every
    rank (core/deepspeed.py `persists`); their whole copies count in the totals.
    `optimizer_groups` (the zero12 style): one flat buffer per optimizer parameter group of a
    stage (`optimizer_groups_of`), each padded to a multiple of 2 * world on its own, as
    DeepSpeed's stage_1_and_2.py flattens them (lines 440-446); False: one buffer of all the
    stage's trainable parameters."""
    storage = storage or Storage(element_bytes, dtype_name("", element_bytes))
    if style not in PER_PARAM_STYLES + FLAT_STYLES:
        raise PlanError(f"unknown style {style!r} (styles: {', '.join(PER_PARAM_STYLES + FLAT_STYLES)})")
    if world < 1:
        raise PlanError(f"world must be a positive integer (got {world})")
    if persistent_at_most is not None and style != "zero3":
        raise PlanError(f"persistent parameters are DeepSpeed stage 3's (the zero3 style), not {style}'s")
    if style == "fsdp1" and any(not p.trainable for p in placed):
        # FlatParamHandle._validate_tensors_to_flatten (torch/distributed/fsdp/_flat_param.py).
        raise PlanError("fsdp1 cannot hold LoRA's frozen base beside its adapters: FSDP1 flattens a block into "
                        "one FlatParameter of one dtype (\"Must flatten tensors with uniform dtype\"; and uniform "
                        "requires_grad with use_orig_params=False); use --style fsdp2")
    num_stages = max((p.stage for p in placed), default=0) + 1
    out: list[ParamShards] = []
    buffers: list[FlatBuffer] = []
    held = [[0] * world for _ in range(num_stages)]
    padded = [[0] * world for _ in range(num_stages)]
    stored = [[0] * world for _ in range(num_stages)]
    frozen_how = "fsdp2" if style == "fsdp2" else "partition"

    def add(param: PlacedParam, unit: str, replicated: bool, shards: tuple[Shard, ...],
            rows: tuple[int, ...] | None, counted: bool = True, persistent: bool = False,
            group: int | None = None) -> ParamShards:
        """`counted`: its shards add to the totals (a flat buffer's members are counted as the buffer);
        `persistent`: a whole copy on every rank besides its shard; `group`: its zero12 buffer's group."""
        how = "whole" if replicated else frozen_how
        numel = prod(param.local_shape)
        extra = storage.bytes(param, Shard(0, 0, numel, 0), 1, "whole") if persistent else 0
        sizes = tuple(storage.bytes(param, shard, world, how) + extra for shard in shards)
        for shard, size in zip(shards, sizes):
            stored[param.stage][shard.rank] += size
            if counted:
                held[param.stage][shard.rank] += shard.numel + (numel if persistent else 0)
                padded[param.stage][shard.rank] += shard.padding
        return ParamShards(param.name, param.info.shape, param.local_shape, param.info.layer, param.stage, unit,
                           replicated, shards, rows, storage.param_dtype(param), param.trainable, sizes,
                           extra, group)

    def whole(numel: int) -> tuple[Shard, ...]:
        return tuple(Shard(rank, 0, numel, 0) for rank in range(world))

    if style in PER_PARAM_STYLES:
        for param in placed:
            shape, numel = param.local_shape, prod(param.local_shape)
            rows = None
            replicated = numel < min_numel and param.trainable
            if replicated:
                shards = whole(numel)
            elif style == "fsdp2":
                shards, rows = _rows_shards(shape, world)
            else:
                shards = tuple(shard_ranges(numel, world, "zero3"))
            persistent = persistent_at_most is not None and persists(numel, persistent_at_most)
            out.append(add(param, param.name, replicated, shards, rows, persistent=persistent))
    else:
        flattened = [p for p in placed if p.trainable]  # only trainable parameters are flattened
        units: dict[tuple[int, str], list[PlacedParam]] = {}
        groups: dict[tuple[int, str], tuple[int, bool]] = {}  # zero12: (group index, matrices) of a unit
        if style == "zero12" and optimizer_groups:
            for stage in range(num_stages):
                for index, (matrices, group) in enumerate(optimizer_groups_of([p for p in flattened if p.stage == stage])):
                    name = _unit_name(style, group[0].info, stage, num_stages, index)
                    units[stage, name] = group
                    groups[stage, name] = (index, matrices)
        else:
            for param in flattened:
                units.setdefault((param.stage, _unit_name(style, param.info, param.stage, num_stages)), []).append(param)
        members_of: dict[int, ParamShards] = {}
        for (stage, name), members in units.items():
            numels = [prod(p.local_shape) for p in members]
            unit_shards = shard_ranges(sum(numels), world, style)
            group, matrices = groups.get((stage, name), (None, None))
            buffers.append(FlatBuffer(name, stage, sum(numels), len(members), tuple(unit_shards), group, matrices))
            for shard in unit_shards:
                held[stage][shard.rank] += shard.numel
                padded[stage][shard.rank] += shard.padding
                stored[stage][shard.rank] += shard.padding * storage.element_bytes
            offset = 0
            for param, numel in zip(members, numels):
                end = offset + numel
                shards = []
                for shard in unit_shards:
                    start, stop = max(shard.start, offset), min(shard.end, end)
                    shards.append(
                        Shard(shard.rank, start - offset, stop - offset, 0) if start < stop
                        else Shard(shard.rank, numel, numel, 0)
                    )
                members_of[id(param)] = add(param, name, False, tuple(shards), None, counted=False, group=group)
                offset = end
        for param in placed:
            if not param.trainable:  # LoRA's frozen base: whole on every rank, in no flat buffer
                members_of[id(param)] = add(param, FROZEN_UNIT, True, whole(prod(param.local_shape)), None)
        out = [members_of[id(p)] for p in placed]

    totals = [
        RankTotal(stage, rank, held[stage][rank], padded[stage][rank], stored[stage][rank])
        for stage in range(num_stages) for rank in range(world)
    ]
    frozen = None if storage.lora is None else storage.lora.base_dtype
    return ModelShards(style, world, storage.element_bytes, out, buffers, totals, frozen, storage.dtype)


@dataclass(frozen=True)
class ParamOwner:
    """A whole parameter (its tensor-parallel piece) and the shard rank that owns it."""

    name: str
    stage: int
    owner: int
    numel: int
    stored_bytes: int


def assign_params(
    placed: list[PlacedParam], world: int, assign: str, element_bytes: int = FP32
) -> tuple[list[ParamOwner], list[tuple[int, RankShare]]]:
    """Whole parameters as blocks (`shards.assign_blocks`), in module order within each
    pipeline stage, and each (stage, rank)'s bytes-weighted share of its stage."""
    owned: list[ParamOwner] = []
    shares: list[tuple[int, RankShare]] = []
    for stage in sorted({p.stage for p in placed}):
        members = [p for p in placed if p.stage == stage]
        numels = [prod(p.local_shape) for p in members]
        owners = assign_blocks(len(members), world, assign, numels)
        owned += [
            ParamOwner(p.info.name, stage, owner, numel, numel * element_bytes)
            for p, owner, numel in zip(members, owners, numels)
        ]
        shares += [(stage, share) for share in ownership(owners, [n * element_bytes for n in numels], world)]
    return owned, shares


def whole_param_bytes(placed: list[PlacedParam], storage: Storage) -> dict[int, int]:
    """Bytes of every parameter of each pipeline stage held whole (DDP, ZeRO stage 1: every
    rank of the shard group holds them all), by stage."""
    held: dict[int, int] = {}
    for p in placed:
        numel = prod(p.local_shape)
        held[p.stage] = held.get(p.stage, 0) + storage.bytes(p, Shard(0, 0, numel, 0), 1, "whole")
    return held
