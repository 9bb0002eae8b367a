"""Names the job file fixes, without the pydantic models: mesh axes, the default rank order,
the pipeline schedules and the `[model]` keys. `core` and the command-line parsing import
them from here, so a command that reads no job file never loads pydantic."""

from __future__ import annotations

from .units import quoted

AXES = ("tp", "cp", "dp", "pp")
DEFAULT_ORDER = "tp-cp-dp-pp"
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "round-robin")

# The `[model]` keys: how a model is given, and the keys of an inline shape.
SHAPE_KEYS = (
    "family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
    "ffn_hidden_size", "vocab_size", "max_seq_len", "tie_embeddings", "norm", "activation",
    "position_embedding", "qkv_bias", "out_bias", "mlp_bias", "shared_layer_norm",
    "num_experts", "experts_per_token",
)
SOURCE_KEYS = ("preset", "hf_config", "params")


def parse_order(order: str) -> tuple[str, ...]:
    """Axis names of an order string, fastest first; unknown or repeated axes raise."""
    names = tuple(part.strip() for part in order.split("-"))
    unknown = [n for n in names if n not in AXES]
    if unknown:
        raise ValueError(
            f"unknown axis {quoted(unknown[0])} in order {quoted(order)} (axes: {', '.join(AXES)}, fastest first)"
        )
    repeated = sorted({n for n in AXES if names.count(n) > 1})  # a count per axis: linear in a long order
    if repeated:
        raise ValueError(f"axis {repeated[0]!r} appears twice in order {quoted(order)}")
    return names
