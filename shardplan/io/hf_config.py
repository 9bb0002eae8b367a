"""Hugging Face `config.json` -> an inline model shape.

Key names and defaults follow the configuration classes of `transformers`
(configuration_gpt2.py, configuration_llama.py, configuration_mistral.py,
configuration_mixtral.py, configuration_qwen2.py, configuration_gemma.py,
configuration_falcon.py, configuration_phi3.py).
"""

from __future__ import annotations

from pathlib import Path

from ..spec.errors import InputError, Problem
from .files import read_json

SUPPORTED = ("gpt2", "llama", "mistral", "mixtral", "qwen2", "gemma", "falcon", "phi3")

# The config.json key each shape key comes from, so messages name the user's key.
_CONFIG_KEYS = {
    "num_layers": "num_hidden_layers", "hidden_size": "hidden_size", "num_heads": "num_attention_heads",
    "num_kv_heads": "num_key_value_heads", "head_dim": "head_dim", "ffn_hidden_size": "intermediate_size",
    "vocab_size": "vocab_size", "max_seq_len": "max_position_embeddings", "num_experts": "num_local_experts",
    "experts_per_token": "num_experts_per_tok", "tie_embeddings": "tie_word_embeddings",
}
_GPT2_KEYS = {"num_layers": "n_layer", "hidden_size": "n_embd", "num_heads": "n_head",
              "ffn_hidden_size": "n_inner", "max_seq_len": "n_positions"}


def looks_like_hf_config(data: dict) -> bool:
    """A Hugging Face config.json rather than a job: `model_type` (every `PretrainedConfig`
    writes it) or `architectures`, and none of the job file's tables."""
    from ..spec.job import TABLES

    marked = isinstance(data.get("model_type"), str) or isinstance(data.get("architectures"), list)
    return marked and not any(isinstance(data.get(table), dict) for table in TABLES)


def architectures_problem(data: dict, file: str) -> Problem | None:
    """`architectures` is what `PretrainedConfig` writes: a list of model class names
    (`["LlamaForCausalLM"]`), or null; anything else is no config.json we can trust."""
    value = data.get("architectures")
    if value is None or (isinstance(value, list) and all(isinstance(a, str) and a for a in value)):
        return None
    from .problems import shown_value

    return Problem("architectures", f"expected a list of model class names (strings), got {shown_value(value)}",
                   file=file)


def model_kind(data: dict) -> str | None:
    """What model a config.json describes, for messages: its model_type, else its first
    architecture, else None."""
    if isinstance(data.get("model_type"), str) and data["model_type"]:
        return data["model_type"]
    names = data.get("architectures")
    if isinstance(names, list) and names and isinstance(names[0], str) and names[0]:
        return names[0]
    return None


def config_key(family: str, key: str) -> str:
    """The config.json key of a shape key (for messages about a config.json)."""
    if family == "gpt2" and key in _GPT2_KEYS:
        return _GPT2_KEYS[key]
    if family == "falcon" and key == "num_kv_heads":
        return "num_kv_heads"
    return _CONFIG_KEYS.get(key, key)


class _Reader:
    """Typed access to a config dict that collects problems instead of stopping."""

    def __init__(self, config: dict, file: str):
        self.config, self.file, self.problems = config, file, []

    def get(self, *keys: str, default: object = None, kind: type = int, required: bool = True):
        for key in keys:
            if key in self.config and self.config[key] is not None:
                value = self.config[key]
                if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                    self.problems.append(Problem(key, f"expected a positive integer, got {value!r}", file=self.file))
                    return default
                if kind is bool and not isinstance(value, bool):
                    self.problems.append(Problem(key, f"expected true or false, got {value!r}", file=self.file))
                    return default
                return value
        if required and default is None:
            self.problems.append(Problem(keys[0], "required", file=self.file))
        return default


def shape_from_hf_config(config: dict, file: str) -> dict:
    """The inline `[model]` table (family and sizes) equivalent to a config.json."""
    model_type = config.get("model_type")
    bad_names = architectures_problem(config, file)
    if model_type not in SUPPORTED:
        said = "required" if model_type is None else f"{model_type!r} is not supported"
        problem = Problem("model_type", f"{said} (supported: {', '.join(SUPPORTED)})", file=file)
        raise InputError([p for p in (bad_names, problem) if p])
    if bad_names:
        raise InputError(bad_names)
    r = _Reader(config, file)
    if model_type == "gpt2":
        hidden = r.get("n_embd", "hidden_size")
        shape = dict(
            family="gpt2",
            num_layers=r.get("n_layer", "num_hidden_layers"),
            hidden_size=hidden,
            num_heads=r.get("n_head", "num_attention_heads"),
            ffn_hidden_size=r.get("n_inner", default=4 * hidden if hidden else None),
            vocab_size=r.get("vocab_size"),
            max_seq_len=r.get("n_positions", "max_position_embeddings"),
            tie_embeddings=r.get("tie_word_embeddings", default=True, kind=bool),
        )
    elif model_type == "falcon":
        shape = _falcon(r)
    else:
        heads = r.get("num_attention_heads")
        shape = dict(
            family=model_type,
            num_layers=r.get("num_hidden_layers"),
            hidden_size=r.get("hidden_size"),
            num_heads=heads,
            num_kv_heads=r.get("num_key_value_heads", default=heads),
            head_dim=r.get("head_dim", required=False),
            ffn_hidden_size=r.get("intermediate_size"),
            vocab_size=r.get("vocab_size"),
            max_seq_len=r.get("max_position_embeddings", required=False),
            tie_embeddings=r.get(
                "tie_word_embeddings", default=model_type == "gemma", kind=bool
            ),
        )
        if model_type == "llama":
            # LlamaConfig.attention_bias puts biases on q, k, v and o.
            bias = r.get("attention_bias", default=False, kind=bool)
            shape.update(qkv_bias=bias, out_bias=bias, mlp_bias=r.get("mlp_bias", default=False, kind=bool))
        if model_type == "mixtral":
            shape.update(
                num_experts=r.get("num_local_experts", default=8),
                experts_per_token=r.get("num_experts_per_tok", default=2),
            )
    if r.problems:
        raise InputError(r.problems)
    name = config.get("_name_or_path")
    if isinstance(name, str) and name:
        shape["name"] = name
    return {k: v for k, v in shape.items() if v is not None}


def _falcon(r: _Reader) -> dict:
    hidden = r.get("hidden_size")
    heads = r.get("num_attention_heads", "n_head")
    new_arch = r.get("new_decoder_architecture", default=False, kind=bool)
    if new_arch:
        kv_heads = r.get("num_kv_heads", default=heads)
    elif r.get("multi_query", default=True, kind=bool):
        kv_heads = 1
    else:
        kv_heads = heads
    bias = r.get("bias", default=False, kind=bool)
    parallel = r.get("parallel_attn", default=True, kind=bool)
    # FalconDecoderLayer: the new architecture has ln_attn and ln_mlp (two norms, unless
    # num_ln_in_parallel_attn is 1); the old one a single input_layernorm when attention
    # and MLP run in parallel, else input + post-attention norms.
    if new_arch:
        shared = r.get("num_ln_in_parallel_attn", default=2) == 1
    else:
        shared = parallel
    return dict(
        family="falcon",
        num_layers=r.get("num_hidden_layers", "n_layer"),
        hidden_size=hidden,
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=r.get("ffn_hidden_size", default=4 * hidden if hidden else None),
        vocab_size=r.get("vocab_size"),
        max_seq_len=r.get("max_position_embeddings", required=False),
        tie_embeddings=r.get("tie_word_embeddings", default=True, kind=bool),
        position_embedding="alibi" if r.get("alibi", default=False, kind=bool) else "rope",
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        shared_layer_norm=shared,
    )


def read_hf_config(path: Path, shown: str) -> dict:
    """Read a config.json file and convert it; every failure names the file."""
    return shape_from_hf_config(read_json(path, shown).data, shown)
