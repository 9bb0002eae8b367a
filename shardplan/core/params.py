"""Every parameter of a decoder-only transformer: name, shape, and how tensor parallel cuts it.

The structure per family follows the Hugging Face reference implementations (see
`spec/model.py`); fused projections there (GPT-2's c_attn, Phi-3's qkv_proj and
gate_up_proj, Falcon's query_key_value) are separate here, with the same element count,
because tensor parallelism must cut q, k and v separately. `shardplan run` builds modules
with exactly these names and shapes (weights are (out, in) as in `torch.nn.Linear`).

Tensor-parallel placement follows Megatron-LM (Shoeybi et al. 2019, section 3): q/k/v and
MLP up/gate are column-parallel (dim 0 of the weight and the bias), attention output and
MLP down are row-parallel (dim 1; their bias is replicated), the token embedding and the
output head are vocabulary-parallel (dim 0), norms, position embeddings and the MoE router
are replicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import prod

from ..spec.model import ModelShape

COLWISE, ROWWISE = 0, 1

# Families whose layers also normalise the attention and MLP outputs before the residual add
# ("sandwich" norms: modeling_gemma2.py Gemma2DecoderLayer's post_attention_layernorm and
# post_feedforward_layernorm, beside input_layernorm and pre_feedforward_layernorm).
POST_NORM_FAMILIES = ("gemma2",)


@dataclass(frozen=True)
class ParamInfo:
    """One parameter tensor."""

    name: str
    shape: tuple[int, ...]
    part: str  # embedding | position | layer | final_norm | head
    layer: int | None = None
    tp_dim: int | None = None  # dimension tensor parallel shards; None: replicated
    expert: bool = False

    @property
    def numel(self) -> int:
        return prod(self.shape)


def _norm(prefix: str, shape: ModelShape, part: str, layer: int | None) -> list[ParamInfo]:
    h = shape.hidden_size
    params = [ParamInfo(f"{prefix}.weight", (h,), part, layer)]
    if shape.norm == "layernorm":
        params.append(ParamInfo(f"{prefix}.bias", (h,), part, layer))
    return params


def _linear(
    prefix: str, out_features: int, in_features: int, bias: bool, tp: int | None,
    layer: int, expert: bool = False,
) -> list[ParamInfo]:
    params = [ParamInfo(f"{prefix}.weight", (out_features, in_features), "layer", layer, tp, expert)]
    if bias:
        # A column-parallel bias is split with its outputs; a row-parallel one is replicated.
        bias_tp = COLWISE if tp == COLWISE else None
        params.append(ParamInfo(f"{prefix}.bias", (out_features,), "layer", layer, bias_tp, expert))
    return params


def _mlp(prefix: str, shape: ModelShape, layer: int, expert: bool) -> list[ParamInfo]:
    h, f, bias = shape.hidden_size, shape.ffn_hidden_size, shape.mlp_bias
    params = []
    if shape.gated:
        params += _linear(f"{prefix}.gate_proj", f, h, bias, COLWISE, layer, expert)
    params += _linear(f"{prefix}.up_proj", f, h, bias, COLWISE, layer, expert)
    params += _linear(f"{prefix}.down_proj", h, f, bias, ROWWISE, layer, expert)
    return params


def layer_params(shape: ModelShape, layer: int) -> list[ParamInfo]:
    """The parameters of decoder layer `layer`."""
    h, d = shape.hidden_size, shape.head_dim
    q_out, kv_out = shape.num_heads * d, shape.num_kv_heads * d
    p = f"layers.{layer}"
    params = _norm(f"{p}.attn_norm", shape, "layer", layer)
    params += _linear(f"{p}.attn.q_proj", q_out, h, shape.qkv_bias, COLWISE, layer)
    params += _linear(f"{p}.attn.k_proj", kv_out, h, shape.qkv_bias, COLWISE, layer)
    params += _linear(f"{p}.attn.v_proj", kv_out, h, shape.qkv_bias, COLWISE, layer)
    params += _linear(f"{p}.attn.o_proj", h, q_out, shape.out_bias, ROWWISE, layer)
    post_norms = shape.family in POST_NORM_FAMILIES
    if post_norms:
        params += _norm(f"{p}.attn_post_norm", shape, "layer", layer)
    if not shape.shared_layer_norm:
        params += _norm(f"{p}.mlp_norm", shape, "layer", layer)
    if shape.moe:
        params.append(ParamInfo(f"{p}.mlp.router.weight", (shape.num_experts, h), "layer", layer))
        for e in range(shape.num_experts):
            params += _mlp(f"{p}.mlp.experts.{e}", shape, layer, expert=True)
    else:
        params += _mlp(f"{p}.mlp", shape, layer, expert=False)
    if post_norms:
        params += _norm(f"{p}.mlp_post_norm", shape, "layer", layer)
    return params


def embedding_params(shape: ModelShape) -> list[ParamInfo]:
    """Token embedding (vocabulary-parallel) and learned positions (replicated)."""
    params = [ParamInfo("embed.weight", (shape.vocab_size, shape.hidden_size), "embedding", None, COLWISE)]
    if shape.position_embedding == "learned":
        assert shape.max_seq_len is not None
        params.append(ParamInfo("pos_embed.weight", (shape.max_seq_len, shape.hidden_size), "position"))
    return params


def head_params(shape: ModelShape) -> list[ParamInfo]:
    """Final norm and, unless tied to the embedding, the output head."""
    params = _norm("final_norm", shape, "final_norm", None)
    if not shape.tie_embeddings:
        params.append(ParamInfo("lm_head.weight", (shape.vocab_size, shape.hidden_size), "head", None, COLWISE))
    return params


def model_params(shape: ModelShape) -> list[ParamInfo]:
    """All parameters in module order (tied weights once)."""
    params = embedding_params(shape)
    for layer in range(shape.num_layers):
        params += layer_params(shape, layer)
    return params + head_params(shape)


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (tied weights counted once, as torch's parameters())."""

    total: int
    embedding: int  # token embedding + learned positions
    active: int  # used per token: MoE layers count experts_per_token experts
    per_layer: int


@lru_cache(maxsize=256)
def count_params(shape: ModelShape) -> ParamCounts:
    """Counts from one layer's template (layers are identical), so 405B costs one layer."""
    layer = layer_params(shape, 0)
    per_layer = sum(p.numel for p in layer)
    expert_numel = sum(p.numel for p in layer if p.expert)
    one_expert = expert_numel // shape.num_experts if shape.moe else 0
    embedding = sum(p.numel for p in embedding_params(shape))
    total = embedding + shape.num_layers * per_layer + sum(p.numel for p in head_params(shape))
    inactive = shape.num_layers * one_expert * (shape.num_experts - shape.experts_per_token)
    return ParamCounts(total, embedding, total - inactive, per_layer)
