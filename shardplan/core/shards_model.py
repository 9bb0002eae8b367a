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
- `zero12` (DeepSpeed ZeRO-1/2): all parameters in one flat buffer padded to a multiple of
  2 * world (`flatten_dense_tensors_aligned`).
- `even`: all parameters in one flat buffer split evenly, no padding (the ideal balance).

Which parameters a pipeline rank holds and each one's tensor-parallel piece come from
`core/stages.py`, the rule `estimate` uses too: Megatron-LM placement (embedding on the first
stage, final norm and head on the last, a tied embedding's copy as the last stage's head),
loop placement of virtual chunks, torch.chunk pieces along `ParamInfo.tp_dim` (DTensor
`Shard(dim)`), and whole replicated key/value heads when tp exceeds them. The shard group
shares one tp rank's pieces. Each pipeline stage has its own shard group over the same
shard ranks, so totals are per (stage, rank).
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod

from ..spec.errors import PlanError
from ..spec.model import ModelShape
from .precision import FP32, element_bytes as precision_bytes
from .params import ParamInfo, layer_params
from .shards import RankShare, Shard, assign_blocks, ceil_div, chunk_rows, ownership, shard_ranges
from .stages import rank_chunks, rank_params

PER_PARAM_STYLES = ("fsdp2", "zero3")
FLAT_STYLES = ("fsdp1", "zero12", "even")

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


@dataclass(frozen=True)
class PlacedParam:
    """A parameter as one pipeline rank and one tensor-parallel rank hold it."""

    info: ParamInfo
    stage: int  # the pipeline rank holding it
    local_shape: tuple[int, ...]  # its tensor-parallel piece


def placed_params(
    shape: ModelShape, pp: int = 1, virtual: int = 1, tp: int = 1, tp_rank: int = 0,
    split: tuple[int, int] = (0, 0),
) -> list[PlacedParam]:
    """Every parameter of every pipeline rank, stage by stage, in module order inside a stage
    (embeddings, the stage's layers, final norm and head), as `stages.rank_params` places
    and cuts them."""
    if pp < 1 or virtual < 1 or shape.num_layers < pp * virtual:
        raise PlanError(f"cannot split {shape.num_layers} layers into {pp} x {virtual} pipeline stages")
    if not 0 <= tp_rank < tp:
        raise PlanError(f"tp rank {tp_rank} is out of range 0..{tp - 1}")
    placed: list[PlacedParam] = []
    for stage in range(pp):
        held = rank_params(shape, pp, virtual, stage, tp, tp_rank, split)
        before = [lp for lp in held.root if lp.info.part in ("embedding", "position")]
        after = [lp for lp in held.root if lp.info.part not in ("embedding", "position")]
        placed += [PlacedParam(lp.info, stage, lp.shape) for lp in before]
        for chunk in rank_chunks(shape.num_layers, pp, virtual, stage, split):
            for layer in chunk:  # layers are alike: layer i has the template's local shapes
                placed += [
                    PlacedParam(info, stage, template.shape)
                    for info, template in zip(layer_params(shape, layer), held.layer)
                ]
        placed += [PlacedParam(lp.info, stage, lp.shape) for lp in after]
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
    replicated: bool  # below min_num_params: every rank holds it whole
    shards: tuple[Shard, ...]  # element offsets in the flattened local tensor
    rows: tuple[int, ...] | None  # fsdp2: dim-0 rows each rank holds

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
    element_bytes: int
    params: list[ParamShards]
    buffers: list[FlatBuffer]
    totals: list[RankTotal]


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


def _unit_name(style: str, param: ParamInfo, stage: int, pp: int) -> str:
    suffix = f".stage{stage}" if pp > 1 else ""
    if style == "fsdp1":
        return f"layers.{param.layer}" if param.layer is not None else f"root{suffix}"
    return f"flat{suffix}"


def model_shards(
    placed: list[PlacedParam],
    world: int,
    style: str,
    element_bytes: int = FP32,
    min_numel: int = 0,
) -> ModelShards:
    """Per-parameter shards, flat buffers and per-(stage, rank) totals of a model.

    `placed` gives each parameter's pipeline rank and tensor-parallel piece
    (`placed_params`); `min_numel` keeps smaller parameters whole on every rank under the
    per-parameter styles (FSDP's min_num_params, DeepSpeed's param persistence threshold)."""
    if style not in PER_PARAM_STYLES + FLAT_STYLES:
        raise PlanError(f"unknown style {style!r} (styles: {', '.join(PER_PARAM_STYLES + FLAT_STYLES)})")
    if world < 1:
        raise PlanError(f"world must be a positive integer (got {world})")
    params = [p.info for p in placed]
    stages = [p.stage for p in placed]
    local = [p.local_shape for p in placed]
    num_stages = max(stages, default=0) + 1
    out: list[ParamShards] = []
    buffers: list[FlatBuffer] = []
    held = [[0] * world for _ in range(num_stages)]
    padded = [[0] * world for _ in range(num_stages)]

    if style in PER_PARAM_STYLES:
        for param, stage, shape in zip(params, stages, local):
            numel = prod(shape)
            rows = None
            if numel < min_numel:
                shards = tuple(Shard(rank, 0, numel, 0) for rank in range(world))
            elif style == "fsdp2":
                shards, rows = _rows_shards(shape, world)
            else:
                shards = tuple(shard_ranges(numel, world, "zero3"))
            for shard in shards:
                held[stage][shard.rank] += shard.numel
                padded[stage][shard.rank] += shard.padding
            out.append(ParamShards(
                param.name, param.shape, shape, param.layer, stage, param.name, numel < min_numel, shards, rows,
            ))
    else:
        units: dict[tuple[int, str], list[int]] = {}
        for index, (param, stage) in enumerate(zip(params, stages)):
            units.setdefault((stage, _unit_name(style, param, stage, num_stages)), []).append(index)
        placed: dict[int, ParamShards] = {}
        for (stage, name), members in units.items():
            numels = [prod(local[i]) for i in members]
            unit_shards = shard_ranges(sum(numels), world, style)
            buffers.append(FlatBuffer(name, stage, sum(numels), len(members), tuple(unit_shards)))
            for shard in unit_shards:
                held[stage][shard.rank] += shard.numel
                padded[stage][shard.rank] += shard.padding
            offset = 0
            for index, numel in zip(members, numels):
                param, end = params[index], offset + numel
                shards = []
                for shard in unit_shards:
                    start, stop = max(shard.start, offset), min(shard.end, end)
                    shards.append(
                        Shard(shard.rank, start - offset, stop - offset, 0) if start < stop
                        else Shard(shard.rank, numel, numel, 0)
                    )
                placed[index] = ParamShards(
                    param.name, param.shape, local[index], param.layer, stage, name, False, tuple(shards), None,
                )
                offset = end
        out = [placed[i] for i in range(len(params))]

    totals = [
        RankTotal(stage, rank, held[stage][rank], padded[stage][rank],
                  (held[stage][rank] + padded[stage][rank]) * element_bytes)
        for stage in range(num_stages) for rank in range(world)
    ]
    return ModelShards(style, world, element_bytes, out, buffers, totals)


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
