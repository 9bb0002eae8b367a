"""Floating-point operations of a decoder-only transformer, from its architecture.

Model FLOPs follow Megatron-LM's `num_floating_point_operations`
(megatron/training/training.py, `transformer_flops`): every matmul costs 2mnk, runs once
forward and twice backward (input and weight gradients), and

    per layer and token, forward:  2 * (h*q + 2*h*kv + q*h)          QKV and output projections
                                 + 2 * s * q                        scores and values (causal)
                                 + 2 * k * (2 or 3) * h * f         MLP (gated: 3 matrices), k experts
    per token, forward:            2 * h * V                        the output head (logits)

with q = heads * head_dim and kv = kv_heads * head_dim (GQA), f the MLP (or expert) width and
k the experts each token uses. Attention convention: a causal mask leaves half of the score
matrix to compute, so the scores and values cost 2 * 2 * s * q / 2 per token forward, as
Megatron-LM counts since it split core attention out (its comment: "causal mask (only half
of the mask is non-zero)"). Narayanan et al. 2021 and Korthikanti et al. 2022 counted the full
matrix (4 * s * q); `causal=False` gives their figure. The router, norms, activations and the
embedding lookup are not counted (nor does Megatron-LM count them).

MFU counts these model FLOPs; HFU adds the forward that recomputation runs again (full: the
whole layer; selective: the scores and values, Korthikanti et al. 2022, section 5; op: the
matmuls torchtitan's operator policy does not keep, `op_recomputed`).
"""

from __future__ import annotations

from functools import lru_cache

from ..spec.model import ModelShape


def mlp_matrices(shape: ModelShape) -> int:
    """Weight matrices of one MLP (or expert): 3 gated (gate, up, down), else 2."""
    return 3 if shape.gated else 2


@lru_cache(maxsize=1024)
def layer_weight_elements(shape: ModelShape) -> int:
    """Matmul weight elements one token meets in one layer: projections and its k experts."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    experts = shape.experts_per_token if shape.moe else 1
    return h * q + 2 * h * kv + q * h + experts * mlp_matrices(shape) * h * shape.ffn_hidden_size


def attention_forward_flops(shape: ModelShape, queries: int, keys: int, causal: bool = True) -> float:
    """Scores (Q K^T) and weighted values (P V) of one sequence in one layer, forward:
    2 * 2 * queries * keys * q, halved under a causal mask."""
    full = 4 * queries * keys * shape.num_heads * shape.head_dim
    return full / 2 if causal else float(full)


def layer_forward_flops_per_token(shape: ModelShape, seq_len: int, causal: bool = True) -> float:
    """One layer's forward FLOPs per token at sequence length `seq_len`."""
    return 2 * layer_weight_elements(shape) + attention_forward_flops(shape, 1, seq_len, causal)


def head_forward_flops_per_token(shape: ModelShape) -> float:
    """The output head (logits) per token, forward."""
    return 2 * shape.hidden_size * shape.vocab_size


def model_flops_per_token(shape: ModelShape, seq_len: int, causal: bool = True,
                          frozen_weights: bool = False) -> float:
    """Training FLOPs per token without recomputation: forward + backward (2x forward).

    With `frozen_weights` (a frozen base, as under LoRA) the weights get no gradient: the
    backward computes only input gradients, so the layers' matmuls cost 2x, not 3x, their
    forward (the head's too); attention's products still cost 3x."""
    layer_mm = 2 * layer_weight_elements(shape)
    attention = attention_forward_flops(shape, 1, seq_len, causal)
    head = head_forward_flops_per_token(shape)
    weights = 2 if frozen_weights else 3
    return shape.num_layers * (weights * layer_mm + 3 * attention) + weights * head


def matmul_widths(shape: ModelShape, tp: int = 1) -> list[tuple[str, int, int]]:
    """(name, weight elements per token, output width on a tp rank) of one layer's matmuls in
    the order a Llama-style block runs them (q, k, v, o, router, gate, up, down); the router's
    weights are not model FLOPs (0)."""
    h, d = shape.hidden_size, shape.head_dim
    q, kv = shape.num_heads * d, shape.num_kv_heads * d
    kv_local = (max(1, shape.num_kv_heads // tp) if tp <= shape.num_kv_heads else 1) * d
    k = shape.experts_per_token if shape.moe else 1
    f, f_local = shape.ffn_hidden_size, shape.ffn_hidden_size // tp
    widths = [("q", h * q, q // tp), ("k", h * kv, kv_local), ("v", h * kv, kv_local), ("o", q * h, h)]
    if shape.moe:
        widths.append(("router", 0, shape.num_experts))
    if shape.gated:
        widths.append(("gate", k * h * f, k * f_local))
    return widths + [("up", k * h * f, k * f_local), ("down", k * f * h, k * h)]


def op_recomputed(shape: ModelShape, tp: int = 1) -> tuple[str, ...]:
    """The matmuls torchtitan's operator policy recomputes: it keeps the output of the 1st,
    3rd, 5th, ... matmul of a block, its counter restarting at every checkpointed forward
    (core/activations.op_saved_terms), and recomputes the 2nd, 4th, ..."""
    return tuple(name for name, *_ in matmul_widths(shape, tp)[1::2])


def recompute_flops_per_token(shape: ModelShape, seq_len: int, recompute: str, causal: bool = True,
                              tp: int = 1) -> float:
    """Forward FLOPs per token that recomputation runs again in backward."""
    if recompute == "op":
        again = op_recomputed(shape, tp)
        return shape.num_layers * 2 * sum(weights for name, weights, _ in matmul_widths(shape) if name in again)
    if recompute == "full":
        return shape.num_layers * layer_forward_flops_per_token(shape, seq_len, causal)
    if recompute == "selective":
        return shape.num_layers * attention_forward_flops(shape, 1, seq_len, causal)
    return 0.0


def hardware_flops_per_token(shape: ModelShape, seq_len: int, recompute: str, causal: bool = True,
                             frozen_weights: bool = False, tp: int = 1) -> float:
    """FLOPs executed per token: the model's plus the recomputed forward (HFU's numerator)."""
    return (model_flops_per_token(shape, seq_len, causal, frozen_weights)
            + recompute_flops_per_token(shape, seq_len, recompute, causal, tp))
