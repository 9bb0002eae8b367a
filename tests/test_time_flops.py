"""FLOPs from the architecture (core/flops.py) against Megatron-LM's formulas, transcribed here
from their source so that the two are written independently."""

from __future__ import annotations

import pytest

from shardplan.core.flops import (
    hardware_flops_per_token,
    layer_forward_flops_per_token,
    model_flops_per_token,
    recompute_flops_per_token,
)
from shardplan.io.job import load_job


def shape_of(preset: str):
    return load_job(None, [("model.preset", preset)], env={}).shape


def megatron_flops(shape, batch: int, seq: int) -> float:
    """NVIDIA/Megatron-LM megatron/training/training.py, `num_floating_point_operations` ->
    `transformer_flops` (no MLA, MTP, latent MoE or shared experts; BSHD): FLOPs of one
    global batch, causal attention counted half ("/ 2  # causal mask")."""
    L, h, V = shape.num_layers, shape.hidden_size, shape.vocab_size
    query = shape.head_dim * shape.num_heads  # kv_channels * num_attention_heads
    kv = shape.head_dim * shape.num_kv_heads  # kv_channels * num_query_groups
    ffn_expansion = 3 if shape.gated else 2  # "3 if args.swiglu else 2"
    routed = shape.experts_per_token if shape.moe else 0
    dense_layers, moe_layers = (0, L) if shape.moe else (L, 0)
    tokens = batch * seq
    self_attn = 3 * 2 * (h * (query + kv + kv) + query * h)
    core_attn = 3 * 2 * query / 2 * 2
    return (tokens * (3 * 2 * h * (shape.ffn_hidden_size * ffn_expansion * dense_layers
                                   + shape.ffn_hidden_size * routed * ffn_expansion * moe_layers)
                      + self_attn * L + 3 * 2 * h * V)
            + batch * seq * seq * core_attn * L)


@pytest.mark.parametrize("preset", ["gpt2", "llama-3-8b", "llama-2-70b", "mixtral-8x7b", "qwen2.5-7b", "mistral-7b"])
@pytest.mark.parametrize("seq", [1024, 4096])
def test_model_flops_equal_megatron(preset, seq):
    shape = shape_of(preset)
    batch = 3
    assert model_flops_per_token(shape, seq) * batch * seq == pytest.approx(megatron_flops(shape, batch, seq), rel=1e-12)


def test_head_dim_apart_from_hidden_over_heads():
    # Gemma-7B: 16 heads of 256 = 4096 query width on a hidden size of 3072 (GeGLU counts as gated).
    from shardplan.spec.model import resolve_shape

    shape, _ = resolve_shape(dict(family="gemma", num_layers=28, hidden_size=3072, num_heads=16, num_kv_heads=16,
                                  head_dim=256, ffn_hidden_size=24576, vocab_size=256000))
    assert model_flops_per_token(shape, 8192) * 8192 == pytest.approx(megatron_flops(shape, 1, 8192), rel=1e-12)


@pytest.mark.parametrize("hidden,heads,layers", [(2304, 24, 24), (12288, 96, 96), (25600, 160, 128)])
def test_full_attention_matches_narayanan_and_korthikanti(hidden, heads, layers):
    # Korthikanti et al. 2022, section 6.3 (model FLOPs, full attention matrix):
    # 72 B s l h^2 (1 + s/(6h) + V/(12 l h)); with full recomputation Narayanan et al. 2021,
    # section 5.1: 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
    from shardplan.spec.model import resolve_shape

    shape, _ = resolve_shape(dict(family="gpt2", num_layers=layers, hidden_size=hidden, num_heads=heads,
                                  vocab_size=51200, max_seq_len=2048))
    s, h, V, B = 2048, hidden, 51200, 8
    model = 72 * B * s * layers * h * h * (1 + s / (6 * h) + V / (12 * layers * h))
    with_recompute = 96 * B * s * layers * h * h * (1 + s / (6 * h) + V / (16 * layers * h))
    # GPT-2 biases are not matmul FLOPs; neither formula counts them.
    assert model_flops_per_token(shape, s, causal=False) * B * s == pytest.approx(model, rel=1e-12)
    assert hardware_flops_per_token(shape, s, "full", causal=False) * B * s == pytest.approx(with_recompute, rel=1e-12)


def test_recompute_extra_forward():
    shape = shape_of("llama-3-8b")
    # Full: the whole forward of every layer again; selective: only the attention products
    # (Korthikanti et al. 2022, section 5: scores and values, 4 s h per token forward, half causal).
    assert recompute_flops_per_token(shape, 4096, "full") == shape.num_layers * layer_forward_flops_per_token(shape, 4096)
    assert recompute_flops_per_token(shape, 4096, "selective") == shape.num_layers * 2 * 4096 * 32 * 128
    assert recompute_flops_per_token(shape, 4096, "none") == 0


def test_frozen_weights_skip_weight_gradients():
    # A frozen base (LoRA): the backward computes input gradients only, 2x the forward matmuls.
    shape = shape_of("llama-3-8b")
    full, frozen = model_flops_per_token(shape, 2048), model_flops_per_token(shape, 2048, frozen_weights=True)
    attention = shape.num_layers * 3 * 2 * 2048 * 4096
    assert (frozen - attention) / (full - attention) == pytest.approx(2 / 3, rel=1e-12)


def test_operator_policy_recomputes_the_matmuls_it_does_not_keep():
    # torchtitan's operator policy keeps every other matmul's output (q, v, gate, down of a
    # Llama block: the even positions when the count is even); it recomputes k, o and up.
    from shardplan.core.flops import op_recomputed

    shape = shape_of("llama-3-8b")
    assert op_recomputed(shape) == ("k", "o", "up")
    h, kv, f = 4096, 8 * 128, 14336
    assert recompute_flops_per_token(shape, 4096, "op") == shape.num_layers * 2 * (h * kv + h * h + h * f)
