"""Which parameters a rank holds: its pipeline stages' layers, the root parameters, and the
tensor-parallel slice of each.

Pipeline placement follows Megatron-LM: the token embedding lives on the first stage, the
final norm and output head on the last; with tied embeddings and more than one stage the last
stage keeps its own copy of the embedding matrix as the head (Megatron-LM keeps both copies
and all-reduces their gradients over the embedding group). With `virtual` chunks per rank
(interleaved / looped schedules) rank r holds stages r, r + pp, r + 2pp, ... (loop placement,
as torch.distributed.pipelining's interleaved and looped-BFS schedules expect).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from functools import lru_cache
from math import prod

from ..spec.model import ModelShape, cached_hash
from .lora import LoraPlan, adapter_params
from .params import ParamInfo, embedding_params, head_params, layer_params
from .pipeline import stage_layers

_KV_SUFFIXES = ("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias",
                "k_proj.lora_B.default.weight", "v_proj.lora_B.default.weight")


@dataclass(frozen=True)
class LocalParam:
    """A parameter as one tensor-parallel rank holds it."""

    info: ParamInfo
    shape: tuple[int, ...]
    numel: int = field(init=False, compare=False)
    rows: int = field(init=False, compare=False)  # dim 0, which ZeRO-3/FSDP2 shard over dp ranks

    def __post_init__(self) -> None:
        object.__setattr__(self, "numel", prod(self.shape))
        object.__setattr__(self, "rows", self.shape[0])

    @property
    def row_numel(self) -> int:
        """Elements of one dim-0 row (0 for a tensor without rows)."""
        return self.numel // self.rows if self.rows else 0

    def padded_shard_numel(self, degree: int) -> int:
        """Elements FSDP2 stores on every rank of a `degree`-rank shard group: ceil(rows /
        degree) rows, the short and empty chunks zero-padded (`FSDPParam._init_sharded_param`)."""
        return -(-self.rows // degree) * self.row_numel


@dataclass(frozen=True)
class RankParams:
    """The parameters of one pipeline rank on one tensor-parallel rank.

    Transformer layers are identical, so they are given once (`layer`) with their count.
    Under LoRA `layer` and `root` are the frozen base and `adapters` one layer's adapters.
    """

    num_layers: int
    chunk_layers: tuple[int, ...]  # layers of each stage (model chunk) this rank holds
    layer: tuple[LocalParam, ...]
    root: tuple[LocalParam, ...]
    has_head: bool
    adapters: tuple[LocalParam, ...] = ()

    __hash__ = cached_hash  # planner caches key on this frozen value

    @cached_property
    def layer_numel(self) -> int:
        return sum(p.numel for p in self.layer)

    @cached_property
    def root_numel(self) -> int:
        return sum(p.numel for p in self.root)

    @property
    def numel(self) -> int:
        return self.num_layers * self.layer_numel + self.root_numel


def chunk_size(size: int, parts: int, index: int) -> int:
    """Elements of part `index` when `size` is cut like `torch.chunk`: ceil-sized pieces,
    the last ones shorter or empty."""
    piece = -(-size // parts)
    return max(0, min(piece, size - index * piece))


def tp_local_shape(param: ParamInfo, tp: int, tp_rank: int, shape: ModelShape) -> tuple[int, ...]:
    """The slice of `param` that tensor-parallel rank `tp_rank` of `tp` holds."""
    if tp == 1 or param.tp_dim is None:
        return param.shape
    dims = list(param.shape)
    if param.name.endswith(_KV_SUFFIXES) and tp > shape.num_kv_heads:
        # More tp ranks than key/value heads: every rank holds one whole, replicated head.
        dims[param.tp_dim] = shape.head_dim
    else:
        dims[param.tp_dim] = chunk_size(dims[param.tp_dim], tp, tp_rank)
    return tuple(dims)


def rank_stages(num_layers: int, pp: int, virtual: int, pp_rank: int,
                split: tuple[int, int] = (0, 0)) -> list[tuple[int, range]]:
    """(global stage index, layer range) of each stage pipeline rank `pp_rank` holds: loop
    placement, stages r, r + pp, r + 2pp, ... of pp * virtual. `split`: the layers of the
    first and the last stage (0: the even split; core/pipeline.py)."""
    stages = stage_layers(num_layers, pp * virtual, *split)
    return [(stage, stages[stage]) for stage in range(pp_rank, pp * virtual, pp)]


def rank_chunks(num_layers: int, pp: int, virtual: int, pp_rank: int,
                split: tuple[int, int] = (0, 0)) -> list[range]:
    """The layer ranges of the stages pipeline rank `pp_rank` holds (loop placement)."""
    return [layers for _, layers in rank_stages(num_layers, pp, virtual, pp_rank, split)]


@lru_cache(maxsize=4096)
def rank_params(shape: ModelShape, pp: int, virtual: int, pp_rank: int, tp: int, tp_rank: int,
                split: tuple[int, int] = (0, 0), lora: LoraPlan | None = None) -> RankParams:
    """The parameters pipeline rank `pp_rank` holds, as tensor-parallel rank `tp_rank` sees them
    (with `lora`, the adapters of one layer too)."""
    chunks = rank_chunks(shape.num_layers, pp, virtual, pp_rank, split)
    last = pp_rank == pp - 1
    layer, adapters = _local_layer(shape, tp, tp_rank, lora)
    return RankParams(
        num_layers=sum(len(c) for c in chunks),
        chunk_layers=tuple(len(c) for c in chunks),
        layer=layer,
        root=_local_root(shape, tp, tp_rank, pp_rank == 0, last, pp > 1),
        has_head=last,
        adapters=adapters,
    )


def _local(params: list[ParamInfo], tp: int, tp_rank: int, shape: ModelShape) -> tuple[LocalParam, ...]:
    return tuple(LocalParam(p, tp_local_shape(p, tp, tp_rank, shape)) for p in params)


@lru_cache(maxsize=256)
def _local_layer(shape: ModelShape, tp: int, tp_rank: int,
                 lora: LoraPlan | None) -> tuple[tuple[LocalParam, ...], tuple[LocalParam, ...]]:
    """One layer's parameters and (with `lora`) adapters on a tensor-parallel rank: the same
    objects for every pipeline rank and layer split, so the caches keyed on them (core/states.py)
    serve every stage."""
    base = layer_params(shape, 0)
    adapters = _local(adapter_params(base, lora), tp, tp_rank, shape) if lora is not None else ()
    return _local(base, tp, tp_rank, shape), adapters


@lru_cache(maxsize=256)
def _local_root(shape: ModelShape, tp: int, tp_rank: int, first: bool, last: bool,
                pipelined: bool) -> tuple[LocalParam, ...]:
    """The root parameters a pipeline rank holds: the embedding on the first stage, the final
    norm and head on the last; with tied embeddings and more than one stage the last stage keeps
    its own copy of the embedding matrix as the head."""
    root: list[ParamInfo] = []
    if first:
        root += embedding_params(shape)
    if last:
        root += head_params(shape)
        if shape.tie_embeddings and pipelined:
            embed = embedding_params(shape)[0]
            root.append(ParamInfo("lm_head.weight", embed.shape, "head", None, embed.tp_dim))
    return _local(root, tp, tp_rank, shape)
