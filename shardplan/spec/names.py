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
    "num_experts", "experts_per_token", "rope_theta", "rope_scaling",
)
SOURCE_KEYS = ("preset", "hf_config", "params")

# The plan keys: what `shardplan plan` searches when the job does not give it (io/plan_job.py
# FIXED_KEYS and the offload table). `--set KEY=auto` leaves one of them unwritten, also when
# the file or a job preset writes it (io/overrides.py).
PLAN_KEYS = (
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.sequence_parallel",
    "parallel.pipeline_schedule", "parallel.virtual_stages", "parallel.first_stage_layers",
    "parallel.last_stage_layers", "parallel.micro_batch_size", "parallel.num_microbatches",
    "zero.stage", "zero.hybrid", "train.activation_checkpointing",
    "offload.params", "offload.grads", "offload.optimizer",
)
AUTO = "auto"


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


# LoRA targets: the layer linears of core/params.py, named as in Hugging Face's Llama, and
# peft's shorthand for all of them (peft LoraConfig, `target_modules="all-linear"`: every
# linear but the output layer, tuners_utils.py `_maybe_include_all_linear_layers`).
LAYER_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ALL_LINEAR = "all-linear"

# Module names peft users write for models whose Hugging Face implementation fuses or renames
# the projections (modeling_phi3.py Phi3Attention.qkv_proj / Phi3MLP.gate_up_proj,
# modeling_gpt2.py GPT2Attention.c_attn / c_proj and GPT2MLP.c_fc / c_proj,
# modeling_falcon.py FalconAttention.query_key_value / dense and FalconMLP.dense_h_to_4h /
# dense_4h_to_h, transformers 4's MixtralBlockSparseTop2MLP w1 / w3 / w2): what each is, and
# the unfused names shardplan counts for it. A close spelling ("did you mean 'v_proj'") would
# mislead here.
RENAMED_LINEARS: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("Phi-3's fused q/k/v", ("q_proj", "k_proj", "v_proj")),
    "gate_up_proj": ("Phi-3's fused gate/up", ("gate_proj", "up_proj")),
    "c_attn": ("GPT-2's fused q/k/v", ("q_proj", "k_proj", "v_proj")),
    "c_fc": ("GPT-2's MLP input", ("up_proj",)),
    "c_proj": ("GPT-2's attention output and MLP output", ("o_proj", "down_proj")),
    "query_key_value": ("Falcon's fused q/k/v", ("q_proj", "k_proj", "v_proj")),
    "dense": ("Falcon's attention output", ("o_proj",)),
    "dense_h_to_4h": ("Falcon's MLP input", ("up_proj",)),
    "dense_4h_to_h": ("Falcon's MLP output", ("down_proj",)),
    "w1": ("Mixtral's expert gate projection", ("gate_proj",)),
    "w3": ("Mixtral's expert up projection", ("up_proj",)),
    "w2": ("Mixtral's expert down projection", ("down_proj",)),
}
# Modules peft can adapt on which shardplan models no adapters (peft's all-linear leaves the
# output head out; it adapts Mixtral's router, which shardplan does not: docs/job-file.md).
UNADAPTED_MODULES = {"lm_head": "the output head", "embed_tokens": "the token embedding",
                     "wte": "GPT-2's token embedding", "gate": "Mixtral's MoE router"}


def target_hint(name: str) -> str | None:
    """Why a LoRA target name peft users write is not one of shardplan's, and what to give
    instead; None for a name that is neither renamed nor a known unadapted module."""
    if name in RENAMED_LINEARS:
        what, names = RENAMED_LINEARS[name]
        return (f"{name!r} is {what}: give {', '.join(names)} (shardplan counts unfused adapters), "
                f"or {ALL_LINEAR!r}")
    if name in UNADAPTED_MODULES:
        return (f"{name!r} is {UNADAPTED_MODULES[name]}: shardplan puts adapters on layer linears only "
                f"({', '.join(LAYER_LINEARS)}, or {ALL_LINEAR!r})")
    return None
