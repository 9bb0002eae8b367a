"""LoRA adapters: their parameters, and which of the base's parameters are stored how.

LoRA (Hu et al. 2021, section 4.1) adds to a frozen linear W (out x in) the update
(alpha / r) * B A, with A (r x in) and B (out x r), on each target linear of every layer; only
A and B train. The names follow peft's injection into the model `shardplan run` builds
(`<linear>.lora_A.default.weight`, `<linear>.lora_B.default.weight`, the base weight moving to
`<linear>.base_layer.weight`); peft matches targets by the module name's last part, so an
MoE layer's experts get adapters too. Counts equal peft's (tests/test_lora.py).

Tensor parallel cuts the adapters with their linear (Megatron placement, core/params.py): on a
column-parallel linear B is split with W's outputs (dim 0) and A is whole; on a row-parallel
linear A is split with W's inputs (dim 1) and B is whole, so that each rank's B A_i x_i is a
partial sum the row-parallel reduction adds up with W's.

QLoRA (Dettmers et al. 2023) stores the frozen base's linear weights in 4-bit NormalFloat: all
seven linears of every layer, as the QLoRA paper ("we apply LoRA ... and quantize all linear
layers of the base model") and torchtune's recipes (`FrozenNF4Linear` for every layer linear)
do; embeddings, norms and the output head stay in 16 bits.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.model import ModelShape
from .params import COLWISE, ROWWISE, ParamInfo, count_params, layer_params

BASE_BYTES = 2  # the frozen base in bf16 (LoraSpec.base_dtype) outside NF4 weights
LINEAR_SUFFIX = "_proj.weight"  # the layer linears (q/k/v/o, gate/up/down) of core/params.py


@dataclass(frozen=True)
class LoraPlan:
    """The narrow LoRA inputs of an estimate (hashable: it keys cached parameter lists)."""

    rank: int
    targets: tuple[str, ...]
    base_dtype: str = "bf16"  # bf16 | nf4
    dropout: bool = False

    @property
    def nf4(self) -> bool:
        return self.base_dtype == "nf4"


def is_layer_linear(param: ParamInfo) -> bool:
    """A weight of one of a layer's linears (not a norm, bias or MoE router)."""
    return param.part == "layer" and param.name.endswith(LINEAR_SUFFIX) and len(param.shape) == 2


def target_of(param: ParamInfo) -> str | None:
    """The linear name (q_proj, ...) of a layer linear's weight, else None."""
    if not is_layer_linear(param):
        return None
    return param.name[: -len(".weight")].rsplit(".", 1)[-1]


def adapter_params(base: list[ParamInfo], lora: LoraPlan) -> list[ParamInfo]:
    """A and B of every targeted linear among `base` (one layer's parameters)."""
    adapters = []
    for param in base:
        if target_of(param) not in lora.targets:
            continue
        out_features, in_features = param.shape
        prefix = param.name[: -len(".weight")]
        a_tp = ROWWISE if param.tp_dim == ROWWISE else None
        b_tp = COLWISE if param.tp_dim == COLWISE else None
        adapters.append(ParamInfo(f"{prefix}.lora_A.default.weight", (lora.rank, in_features), "layer",
                                  param.layer, a_tp, param.expert))
        adapters.append(ParamInfo(f"{prefix}.lora_B.default.weight", (out_features, lora.rank), "layer",
                                  param.layer, b_tp, param.expert))
    return adapters


@dataclass(frozen=True)
class LoraCounts:
    """Parameter counts under LoRA, as peft's `get_nb_trainable_parameters` gives them."""

    trainable: int  # the adapters
    total: int  # the base and the adapters
    active: int  # used per token (MoE: experts_per_token experts' adapters)


def lora_counts(shape: ModelShape, lora: LoraPlan) -> LoraCounts:
    base = count_params(shape)
    adapters = adapter_params(layer_params(shape, 0), lora)
    per_layer = sum(p.numel for p in adapters)
    expert = sum(p.numel for p in adapters if p.expert)
    inactive = expert // shape.num_experts * (shape.num_experts - shape.experts_per_token) if shape.moe else 0
    trainable = shape.num_layers * per_layer
    return LoraCounts(trainable, base.total + trainable, base.active + trainable - shape.num_layers * inactive)


def ranks_above_full(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> dict[str, int]:
    """Targeted linears whose min(in, out) is below `rank`, with that min: a rank-r update of a
    W of out x in has rank at most min(in, out) (Hu et al. 2021, section 4.1), so such an adapter
    expresses nothing a full-rank one would not, and its r * (in + out) parameters exceed W's
    in * out. A warning, not a refusal: it is legal, and peft accepts it."""
    above = {}
    for param in layer_params(shape, 0):
        name = target_of(param)
        if name in targets and rank > min(param.shape):
            above[name] = min(above.get(name, min(param.shape)), min(param.shape))
    return above


def rank_warning(shape: ModelShape, rank: int, targets: tuple[str, ...]) -> str | None:
    """One line for `lora.rank` when it exceeds a target's min(in, out) (ranks_above_full)."""
    above = ranks_above_full(shape, rank, targets)
    if not above:
        return None
    listed = ", ".join(f"{name} ({size:,})" for name, size in above.items())
    return (f"{rank:,} exceeds min(in, out) of {listed}: such an adapter expresses no more than a full-rank "
            "update and holds more parameters than the weight it adapts (a typo?)")


def stores_nf4(param: ParamInfo, lora: LoraPlan | None) -> bool:
    """Whether this base parameter is an NF4 weight under the plan."""
    return lora is not None and lora.nf4 and is_layer_linear(param)


def nf4_problems(shape: ModelShape, tp: int, shards: int) -> list[tuple[str, int, int]]:
    """Layer linears torchao cannot store as NF4 split into `shards` FSDP2 pieces: (name, rows
    on a tensor-parallel rank, elements), for the ones whose elements are not a multiple of
    64 * 256 * shards or whose rows do not split evenly."""
    from .quantized import nf4_quantizable
    from .stages import tp_local_shape

    bad = []
    for param in layer_params(shape, 0):
        if not is_layer_linear(param):
            continue
        rows, cols = tp_local_shape(param, tp, 0, shape)
        if rows % shards or not nf4_quantizable(rows * cols, shards):
            bad.append((param.name.split(".", 2)[-1], rows, rows * cols))
    return bad
