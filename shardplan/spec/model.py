"""The `[model]` table and the resolved architecture (`ModelShape`) the planner computes on.

A model is given in exactly one way: a shipped `preset`, a Hugging Face `hf_config`, a bare
parameter count `params` (model states only), or an inline shape (`family` plus sizes).
Presets and config.json files are resolved to an inline shape by `shardplan.io`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from typing import Literal, Optional

from pydantic import BaseModel, Field, field_validator, model_validator

from .common import Count, Dim, Table
from .errors import Problem
from .names import SHAPE_KEYS, SOURCE_KEYS  # noqa: F401 (re-exported)

Family = Literal["gpt2", "llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "falcon", "phi3"]
Norm = Literal["layernorm", "rmsnorm"]
Activation = Literal["gelu", "swiglu", "geglu"]
PositionEmbedding = Literal["learned", "rope", "alibi"]
# RoPE frequency scalings read: Llama 3.1's, and Hugging Face's "default" (none).
RopeType = Literal["default", "llama3"]

FAMILIES: tuple[str, ...] = Family.__args__  # type: ignore[attr-defined]

# Structural defaults of each family, from the reference implementations in Hugging Face
# transformers (modeling_gpt2.py, modeling_llama.py, modeling_qwen2.py, modeling_gemma.py, modeling_gemma2.py,
# modeling_falcon.py, modeling_phi3.py, modeling_mixtral.py).
FAMILY_DEFAULTS: dict[str, dict[str, object]] = {
    "gpt2": dict(norm="layernorm", activation="gelu", position_embedding="learned",
                 qkv_bias=True, out_bias=True, mlp_bias=True, tie_embeddings=True),
    "llama": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                  qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False),
    "mistral": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                    qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False),
    "mixtral": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                    qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False,
                    experts_per_token=2),
    "qwen2": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                  qkv_bias=True, out_bias=False, mlp_bias=False, tie_embeddings=False),
    "gemma": dict(norm="rmsnorm", activation="geglu", position_embedding="rope",
                  qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=True),
    # Gemma's structure, with two more RMSNorms per layer (modeling_gemma2.py; core/params.py
    # POST_NORM_FAMILIES counts them, core/activations.py their inputs).
    "gemma2": dict(norm="rmsnorm", activation="geglu", position_embedding="rope",
                   qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=True),
    "falcon": dict(norm="layernorm", activation="gelu", position_embedding="rope",
                   qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=True,
                   shared_layer_norm=True),
    "phi3": dict(norm="rmsnorm", activation="swiglu", position_embedding="rope",
                 qkv_bias=False, out_bias=False, mlp_bias=False, tie_embeddings=False),
}

# GPT-2 and Falcon fix the MLP width at 4x the hidden size (modeling_gpt2.py: n_inner
# defaults to 4 * n_embd; modeling_falcon.py: dense_h_to_4h).
FFN_MULTIPLIER_DEFAULT = {"gpt2": 4, "falcon": 4}

# Far beyond any published model (the deepest has ~200 layers; the widest MoE 256 experts per
# layer), low enough that planning stays interactive.
MAX_LAYERS = 100_000
MAX_EXPERTS = 4096

# The keys of a llama3 `rope_scaling`: those transformers requires of it besides rope_type
# and rope_theta (modeling_rope_utils.py, `_validate_llama3_rope_parameters`).
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class RopeScalingSpec(Table):
    """`[model] rope_scaling`: RoPE frequency scaling, as Hugging Face's config.json writes it
    (`rope_scaling`, transformers 5's `rope_parameters`). Llama 3.1's llama3 type divides the
    inverse frequencies whose wavelength exceeds original_max_position_embeddings /
    low_freq_factor by `factor`, keeps those below original_max_position_embeddings /
    high_freq_factor, and blends in between (transformers `_compute_llama3_parameters`)."""

    rope_type: RopeType = Field(description="llama3 (Llama 3.1's scaling) or default (no scaling)")
    factor: Optional[float] = Field(
        None, gt=0, description="llama3: the low frequencies are divided by it (Llama 3.1: 8.0)",
    )
    low_freq_factor: Optional[float] = Field(
        None, gt=0, description="llama3: wavelengths above original_max_position_embeddings / this are scaled (1.0)",
    )
    high_freq_factor: Optional[float] = Field(
        None, gt=0, description="llama3: wavelengths below original_max_position_embeddings / this are kept (4.0)",
    )
    original_max_position_embeddings: Optional[Dim] = Field(
        None, description="llama3: the context length (tokens) the model was pretrained at (8192)",
    )

    @field_validator("factor", "low_freq_factor", "high_freq_factor", mode="before")
    @classmethod
    def _finite(cls, value: object) -> object:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number > 0 (got {value})")
        return value


class ModelSpec(Table):
    """The model to plan for: a preset, a Hugging Face config.json, a parameter count, or a shape."""

    preset: Optional[str] = Field(None, description="name of a shipped model preset (`shardplan presets`)")
    hf_config: Optional[str] = Field(
        None, description="path to a Hugging Face config.json (relative to this file)"
    )
    params: Optional[Count] = Field(
        None, description="parameter count only ('7.5B'): estimates model states, no activations"
    )
    name: Optional[str] = Field(None, description="display name of an inline model")
    family: Optional[Family] = Field(None, description="architecture family of an inline shape")
    num_layers: Optional[Dim] = Field(None, le=MAX_LAYERS, description="number of transformer layers")
    hidden_size: Optional[Dim] = Field(None, description="model width h")
    num_heads: Optional[Dim] = Field(None, description="attention (query) heads a")
    num_kv_heads: Optional[Dim] = Field(
        None, description="key/value heads (grouped-query attention); default num_heads"
    )
    head_dim: Optional[Dim] = Field(None, description="width of one head; default hidden_size / num_heads")
    ffn_hidden_size: Optional[Dim] = Field(
        None, description="MLP inner width (per expert for MoE); gpt2/falcon default 4*hidden_size"
    )
    vocab_size: Optional[Dim] = Field(None, description="vocabulary size V")
    max_seq_len: Optional[Dim] = Field(None, description="longest sequence the model supports")
    tie_embeddings: Optional[bool] = Field(
        None, description="output head shares the input embedding matrix (family default)"
    )
    norm: Optional[Norm] = Field(None, description="layernorm (weight and bias) or rmsnorm (weight)")
    activation: Optional[Activation] = Field(
        None, description="gelu (two MLP matrices) or a gated swiglu/geglu (three)"
    )
    position_embedding: Optional[PositionEmbedding] = Field(
        None, description="learned (a max_seq_len x h table), rope or alibi (no parameters)"
    )
    qkv_bias: Optional[bool] = Field(None, description="query/key/value projections have biases")
    out_bias: Optional[bool] = Field(None, description="attention output projection has a bias")
    mlp_bias: Optional[bool] = Field(None, description="MLP projections have biases")
    shared_layer_norm: Optional[bool] = Field(
        None, description="attention and MLP read one shared norm per layer (Falcon-7B)"
    )
    num_experts: Optional[Dim] = Field(None, le=MAX_EXPERTS, description="MoE experts per layer; 1 is a dense MLP")
    experts_per_token: Optional[Dim] = Field(None, description="MoE top-k: experts each token uses")
    rope_theta: Optional[float] = Field(
        None, gt=0,
        description="base of the rotary position embeddings (Hugging Face rope_theta); rope models only",
    )
    rope_scaling: Optional[RopeScalingSpec] = Field(
        None,
        description="RoPE frequency scaling (Hugging Face rope_scaling): rope_type llama3 with factor, "
                    "low_freq_factor, high_freq_factor, original_max_position_embeddings; rope models only",
    )
    dropout: float = Field(
        0.0, ge=0.0, lt=1.0, description="dropout probability; > 0 keeps masks for backward"
    )

    @field_validator("hf_config")
    @classmethod
    def _names_a_file(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("names no file: give the path of a config.json (relative to this file)")
        return value

    @field_validator("rope_theta", mode="before")
    @classmethod
    def _finite_base(cls, value: object) -> object:
        # TOML writes inf and nan (and reads 1e400 as inf); pydantic's own words for them
        # would be the only message here not in the house style.
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(f"must be a finite number > 0 (got {value})")
        return value

    @field_validator("params")
    @classmethod
    def _some_params(cls, value: int | None) -> int | None:
        if value == 0:
            raise ValueError("a model of 0 parameters has nothing to plan (write e.g. '7.5B')")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ModelSpec:
        given = [k for k in SOURCE_KEYS if getattr(self, k) is not None]
        if any(getattr(self, k) is not None for k in SHAPE_KEYS):
            given.append("an inline shape")
        if len(given) > 1:
            raise ValueError(
                "give exactly one of preset, hf_config, params or an inline shape "
                f"(got {' and '.join(given)})"
            )
        return self

    @property
    def source(self) -> str | None:
        """`preset`, `hf_config`, `params`, `shape`, or None when no model is given."""
        for key in SOURCE_KEYS:
            if getattr(self, key) is not None:
                return key
        if any(getattr(self, k) is not None for k in SHAPE_KEYS):
            return "shape"
        return None

    def shape_table(self) -> dict:
        """The inline shape keys that are set, as a plain dict (a nested table as a dict)."""
        table = {k: getattr(self, k) for k in ("name", *SHAPE_KEYS) if getattr(self, k) is not None}
        return {k: v.model_dump(exclude_none=True) if isinstance(v, BaseModel) else v for k, v in table.items()}


def cached_hash(self) -> int:
    """`__hash__` of a frozen dataclass that planner caches key on: its fields hashed once, on
    first use, not at every lookup. Assign it in the class body (`__hash__ = cached_hash`)."""
    values = self.__dict__
    cached = values.get("_hash")
    if cached is None:
        cls = type(self)
        names = cls.__dict__.get("_field_names")
        if names is None:
            names = tuple(f.name for f in fields(cls))
            setattr(cls, "_field_names", names)
        cached = hash(tuple(map(values.__getitem__, names)))
        values["_hash"] = cached
    return cached


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1's RoPE frequency scaling (rope_type "llama3"), resolved: every value given.
    Lengths are in tokens (positions); the factors are dimensionless."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"  # the only scaling kept; written back as the key that selects it


@dataclass(frozen=True)
class ModelShape:
    """A fully resolved decoder-only transformer: every structural choice made explicit."""

    family: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    max_seq_len: int | None
    tie_embeddings: bool
    norm: str
    activation: str
    position_embedding: str
    qkv_bias: bool
    out_bias: bool
    mlp_bias: bool
    shared_layer_norm: bool
    num_experts: int
    experts_per_token: int
    name: str = ""
    # The RoPE base: moves no byte and no FLOP, but exporters write it (Megatron's
    # --rotary-base defaults to 10000, not what every model trains with). None: not given.
    rope_theta: float | None = None
    # Llama 3.1's RoPE frequency scaling: like the base, no byte and no FLOP; exporters and
    # `run` use it. None: the plain frequencies.
    rope_scaling: RopeScaling | None = None

    __hash__ = cached_hash  # planner caches key on this frozen value

    @property
    def gated(self) -> bool:
        return self.activation in ("swiglu", "geglu")

    @property
    def moe(self) -> bool:
        return self.num_experts > 1

    def to_table(self) -> dict:
        """The inline `[model]` table that reproduces this shape (None values left out)."""
        return {k: v for k, v in asdict(self).items() if v is not None and v != ""}


def resolve_shape(table: dict, where: str = "model") -> tuple[ModelShape | None, list[Problem]]:
    """Fill family defaults into an inline shape and check it; problems carry dotted paths."""
    problems: list[Problem] = []

    def at(key: str) -> str:
        return f"{where}.{key}" if where else key

    def need(key: str) -> None:
        if table.get(key) is None:
            problems.append(Problem(at(key), f"required for an inline shape of family {family!r}"))

    family = table.get("family")
    if family is None:
        return None, [Problem(at("family"), f"required for an inline shape (one of {', '.join(FAMILIES)})")]
    values = {**FAMILY_DEFAULTS[family], **{k: v for k, v in table.items() if v is not None}}
    for key in ("num_layers", "hidden_size", "num_heads", "vocab_size"):
        need(key)
    if family not in FFN_MULTIPLIER_DEFAULT:
        need("ffn_hidden_size")
    if family == "mixtral":
        need("num_experts")
    if values.get("position_embedding") == "learned":
        need("max_seq_len")
    if values.get("rope_theta") is not None and values.get("position_embedding") != "rope":
        problems.append(Problem(
            at("rope_theta"),
            f"only rotary position embeddings have a base; this model's are {values.get('position_embedding')!r}",
        ))
    scaling, scaling_problems = _rope_scaling(values.get("rope_scaling"), values.get("position_embedding"), at)
    problems += scaling_problems
    if problems:
        return None, problems

    hidden, heads = values["hidden_size"], values["num_heads"]
    kv_heads = values.get("num_kv_heads") or heads
    head_dim = values.get("head_dim")
    if head_dim is None:
        if hidden % heads:
            problems.append(Problem(
                at("num_heads"),
                f"{heads} heads do not divide hidden_size {hidden}; set head_dim explicitly",
            ))
        head_dim = hidden // heads
    if heads % kv_heads:
        problems.append(Problem(
            at("num_kv_heads"),
            f"{kv_heads} key/value heads must divide the {heads} query heads (grouped-query attention)",
        ))
    num_experts = values.get("num_experts") or 1
    top_k = values.get("experts_per_token") or 1
    if top_k > num_experts:
        problems.append(Problem(
            at("experts_per_token"), f"{top_k} exceeds num_experts ({num_experts})"
        ))
    if problems:
        return None, problems
    ffn = values.get("ffn_hidden_size") or FFN_MULTIPLIER_DEFAULT[family] * hidden
    shape = ModelShape(
        family=family,
        name=values.get("name") or "",
        num_layers=values["num_layers"],
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        ffn_hidden_size=ffn,
        vocab_size=values["vocab_size"],
        max_seq_len=values.get("max_seq_len"),
        tie_embeddings=values["tie_embeddings"],
        norm=values["norm"],
        activation=values["activation"],
        position_embedding=values["position_embedding"],
        qkv_bias=values["qkv_bias"],
        out_bias=values["out_bias"],
        mlp_bias=values["mlp_bias"],
        shared_layer_norm=bool(values.get("shared_layer_norm", False)),
        num_experts=num_experts,
        experts_per_token=top_k if num_experts > 1 else 1,
        rope_theta=_as_float(values.get("rope_theta")),
        rope_scaling=scaling,
    )
    return shape, []


def _rope_scaling(table: dict | None, positions: object, at) -> tuple[RopeScaling | None, list[Problem]]:
    """The resolved scaling of a `rope_scaling` table (its types and bounds already checked
    by RopeScalingSpec): None for rope_type "default"; a llama3 scaling needs all its keys, as
    transformers' `_validate_llama3_rope_parameters` requires them, and a high_freq_factor
    above the low one (else the blend between them divides by zero or turns over)."""
    if table is None:
        return None, []
    if positions != "rope":
        return None, [Problem(at("rope_scaling"), "only rotary position embeddings are scaled; "
                                                  f"this model's are {positions!r}")]
    given = [key for key in LLAMA3_KEYS if table.get(key) is not None]
    if table.get("rope_type") == "default":
        return None, [Problem(at(f"rope_scaling.{key}"), "rope_type 'default' scales nothing: "
                                                         "remove it or set rope_type = 'llama3'") for key in given]
    missing = [key for key in LLAMA3_KEYS if key not in given]
    if missing:
        return None, [Problem(at(f"rope_scaling.{key}"), "required for rope_type 'llama3'") for key in missing]
    low, high = table["low_freq_factor"], table["high_freq_factor"]
    if high <= low:
        return None, [Problem(at("rope_scaling.high_freq_factor"),
                              f"must exceed low_freq_factor ({low}) (got {high})")]
    return RopeScaling(
        factor=float(table["factor"]), low_freq_factor=float(low), high_freq_factor=float(high),
        original_max_position_embeddings=table["original_max_position_embeddings"],
    ), []


def _as_float(value: float | int | None) -> float | None:
    """A TOML integer base (`rope_theta = 500000`) and its float are one model."""
    return None if value is None else float(value)
