"""Hugging Face `config.json` -> an inline model shape.

Key names and the defaults of keys a config.json leaves out follow the configuration classes
of `transformers` (configuration_gpt2.py, configuration_llama.py, configuration_mistral.py,
configuration_mixtral.py, configuration_qwen2.py, configuration_gemma.py,
configuration_gemma2.py, configuration_falcon.py, configuration_phi3.py), copied into
`HF_DEFAULTS`: planning never imports transformers. Keys that change how a model is run but
not its shape (a checkpoint's `quantization_config`, Gemma-2's logit soft-capping) are named
in notes (`config_notes`), not silently dropped.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from ..spec.errors import InputError, Problem
from ..spec.model import FAMILIES
from .files import Document, read_json
from .problems import shown_value

# Where config.json leaves a key out, the value transformers' configuration class of that
# model_type gives it (transformers 5.23.0; each is the class attribute of the same name in
# the file named beside the class, a path inside the transformers package), so that a config
# counts as many parameters here as there (tests/test_hf_defaults.py checks both).
# DERIVED: the class leaves it None and derives it from the sizes as an inline shape does:
# num_key_value_heads (falcon: num_kv_heads) = num_attention_heads (the class's
# __post_init__), head_dim = hidden_size // num_attention_heads (__post_init__, or the
# modeling file's `getattr(config, "head_dim", ...)` where the class has no such attribute),
# n_inner / ffn_hidden_size = 4 * hidden_size. num_hidden_layers, hidden_size and
# num_attention_heads have class defaults too, but stay required: a config.json without them
# describes no particular model.
DERIVED = None


class ConfigDefaults(NamedTuple):
    """The configuration class of a model_type (named in messages) and its defaults."""

    config_class: str
    values: dict[str, object]


HF_DEFAULTS: dict[str, ConfigDefaults] = {
    # models/gpt2/configuration_gpt2.py; n_inner: modeling_gpt2.py GPT2Block (4 * hidden_size)
    "gpt2": ConfigDefaults("GPT2Config", dict(
        vocab_size=50257, n_positions=1024, n_inner=DERIVED, tie_word_embeddings=True,
        add_cross_attention=False,
    )),
    # models/llama/configuration_llama.py
    "llama": ConfigDefaults("LlamaConfig", dict(
        vocab_size=32000, intermediate_size=11008, num_key_value_heads=DERIVED, head_dim=DERIVED,
        max_position_embeddings=2048, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
    )),
    # models/mistral/configuration_mistral.py (modeling_mistral.py has no biases)
    "mistral": ConfigDefaults("MistralConfig", dict(
        vocab_size=32000, intermediate_size=14336, num_key_value_heads=8, head_dim=DERIVED,
        max_position_embeddings=4096 * 32, tie_word_embeddings=False,
    )),
    # models/mixtral/configuration_mixtral.py (attribute_map: num_experts -> num_local_experts)
    "mixtral": ConfigDefaults("MixtralConfig", dict(
        vocab_size=32000, intermediate_size=14336, num_key_value_heads=8, head_dim=DERIVED,
        max_position_embeddings=4096 * 32, tie_word_embeddings=False,
        num_local_experts=8, num_experts_per_tok=2,
    )),
    # models/qwen2/configuration_qwen2.py (num_key_value_heads is 32 whatever the head count);
    # head_dim: modeling_qwen2.py Qwen2Attention
    "qwen2": ConfigDefaults("Qwen2Config", dict(
        vocab_size=151936, intermediate_size=22016, num_key_value_heads=32, head_dim=DERIVED,
        max_position_embeddings=32768, tie_word_embeddings=False,
    )),
    # models/gemma/configuration_gemma.py (head_dim 256 and 16 key/value heads whatever the sizes)
    "gemma": ConfigDefaults("GemmaConfig", dict(
        vocab_size=256000, intermediate_size=24576, num_key_value_heads=16, head_dim=256,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    )),
    # models/gemma2/configuration_gemma2.py (head_dim 256 whatever the sizes); its layers hold
    # two more RMSNorms than Gemma's (modeling_gemma2.py Gemma2DecoderLayer:
    # post_attention_layernorm on the attention output, pre_/post_feedforward_layernorm around
    # the MLP), which core/params.py counts for the gemma2 family
    "gemma2": ConfigDefaults("Gemma2Config", dict(
        vocab_size=256000, intermediate_size=9216, num_key_value_heads=4, head_dim=256,
        max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False,
    )),
    # models/falcon/configuration_falcon.py; num_ln_in_parallel_attn: modeling_falcon.py
    # FalconDecoderLayer makes it 2 under new_decoder_architecture
    "falcon": ConfigDefaults("FalconConfig", dict(
        vocab_size=65024, num_kv_heads=DERIVED, ffn_hidden_size=DERIVED, max_position_embeddings=2048,
        tie_word_embeddings=True, alibi=False, new_decoder_architecture=False, multi_query=True,
        parallel_attn=True, bias=False, num_ln_in_parallel_attn=DERIVED,
    )),
    # models/phi3/configuration_phi3.py; head_dim: modeling_phi3.py Phi3Attention
    "phi3": ConfigDefaults("Phi3Config", dict(
        vocab_size=32064, intermediate_size=8192, num_key_value_heads=DERIVED, head_dim=DERIVED,
        max_position_embeddings=4096, tie_word_embeddings=False,
    )),
}

# The RoPE base where config.json gives none: the class attribute `default_theta` of the same
# configuration classes (transformers 5.23.0), which PreTrainedConfig.convert_rope_params_to_dict
# (modeling_rope_utils.py) falls back to. GPT-2 has learned positions and no base.
DEFAULT_ROPE_THETA: dict[str, float] = {
    "llama": 10000.0, "mistral": 10000.0, "mixtral": 1000000.0, "qwen2": 10000.0, "gemma": 10000.0,
    "gemma2": 10000.0, "falcon": 10000.0, "phi3": 10000.0,
}

# The model_types read: those whose family the job file's `[model]` knows (spec/model.py
# Family), so that a config is never read into a shape the spec then refuses.
SUPPORTED = tuple(model_type for model_type in HF_DEFAULTS if model_type in FAMILIES)

# An explicit null differs from a missing key where the class types the key `int | None` with
# a default that is not None: Qwen2Config's __post_init__ turns None into num_attention_heads.
# Every other null reads as a missing key (transformers refuses null where the type is `int`).
_NULL_VALUES = {"qwen2": {"num_key_value_heads": DERIVED}}

# Keys other configs use that this class does not read: FalconConfig maps n_embed to
# hidden_size, but n_head and n_layer (the remote-code RWConfig's names) are ignored.
_UNREAD = {"falcon": {"num_attention_heads": "n_head", "num_hidden_layers": "n_layer"}}

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

    # Any `model_type` marks one (a job file has no such key), so an odd value is said as the
    # config's, not as an unknown key of a job.
    marked = "model_type" in data or isinstance(data.get("architectures"), list)
    return marked and not any(isinstance(data.get(table), dict) for table in TABLES)


def architectures_problem(data: dict, file: str) -> Problem | None:
    """`architectures` is what `PretrainedConfig` writes: a list of model class names
    (`["LlamaForCausalLM"]`), or null; anything else is no config.json we can trust."""
    value = data.get("architectures")
    if value is None or (isinstance(value, list) and all(isinstance(a, str) and a for a in value)):
        return None
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
    """Typed access to a config dict that collects problems instead of stopping; a key the
    config leaves out takes its `HF_DEFAULTS` value, else it is required."""

    def __init__(self, config: dict, file: str, model_type: str):
        self.config, self.file, self.problems = config, file, []
        self.model_type = model_type
        self.defaults = HF_DEFAULTS[model_type].values
        self.nulls = _NULL_VALUES.get(model_type, {})
        self.defaulted: set[str] = set()  # keys that took the class default

    def get(self, *keys: str, kind: type = int):
        """The first of `keys` the config gives, else the class default of `keys[0]`."""
        for key in keys:
            value = self.config.get(key)
            if value is None and key in self.nulls and key in self.config:
                return self.nulls[key]
            if value is None:
                continue
            if kind is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                self.problems.append(Problem(key, f"expected a positive integer, got {shown_value(value)}", file=self.file))
                return None
            if kind is bool and not isinstance(value, bool):
                self.problems.append(Problem(key, f"expected true or false, got {shown_value(value)}", file=self.file))
                return None
            return value
        if keys[0] in self.defaults:
            self.defaulted.add(keys[0])
            return self.defaults[keys[0]]
        unread = _UNREAD.get(self.model_type, {}).get(keys[0])
        note = ""
        if unread in self.config:
            note = f" ({HF_DEFAULTS[self.model_type].config_class} does not read {unread})"
        self.problems.append(Problem(keys[0], "required" + note, file=self.file))
        return None

    def flag(self, key: str) -> bool | None:
        return self.get(key, kind=bool)

    def rope_theta(self) -> float | None:
        """The RoPE base as transformers takes it (convert_rope_params_to_dict): the
        `rope_theta` of `rope_scaling` (which replaces `rope_parameters` when given) or of
        `rope_parameters`, else the top-level `rope_theta` (the key before transformers 5),
        else the class's `default_theta`."""
        for table in ("rope_scaling", "rope_parameters"):
            inner = self.config.get(table)
            if isinstance(inner, dict) and inner:
                if inner.get("rope_theta") is not None:
                    return self._theta(inner["rope_theta"], f"{table}.rope_theta")
                break  # rope_scaling, when given, stands for rope_parameters
        if self.config.get("rope_theta") is not None:
            return self._theta(self.config["rope_theta"], "rope_theta")
        return DEFAULT_ROPE_THETA[self.model_type]

    def rope_scaling(self) -> dict | None:
        """The RoPE scaling as transformers takes it: `rope_scaling` when given, else
        `rope_parameters` (convert_rope_params_to_dict); its `rope_type`, else the older
        `type`, else "default" (no scaling), and a llama3 scaling's
        original_max_position_embeddings, else max_position_embeddings
        (standardize_rope_params). The `[model] rope_scaling` table, or None."""
        found = _rope_table(self.config)
        if found is None:
            return None
        table, inner = found
        if not isinstance(inner, dict):
            self.problems.append(Problem(table, f"expected a table, got {shown_value(inner)}", file=self.file))
            return None
        type_key, rope_type = _rope_type(inner)
        if rope_type == "default":
            return None
        if rope_type != "llama3":
            return None  # read past, with a note (`config_notes`): it changes no byte and no FLOP
        values: dict[str, object] = {"rope_type": "llama3"}
        for key in ("factor", "low_freq_factor", "high_freq_factor"):
            if inner.get(key) is None:
                self.problems.append(Problem(f"{table}.{key}", "required for rope_type 'llama3'", file=self.file))
            else:
                values[key] = self._theta(inner[key], f"{table}.{key}")
        if inner.get("original_max_position_embeddings") is not None:
            key = f"{table}.original_max_position_embeddings"
            value = inner["original_max_position_embeddings"]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                self.problems.append(Problem(key, f"expected a positive integer, got {shown_value(value)}",
                                             file=self.file))
            values["original_max_position_embeddings"] = value
        else:
            values["original_max_position_embeddings"] = self.get("max_position_embeddings")
        low, high = values.get("low_freq_factor"), values.get("high_freq_factor")
        if low is not None and high is not None and high <= low:
            self.problems.append(Problem(f"{table}.high_freq_factor", f"must exceed low_freq_factor ({low}) "
                                                                      f"(got {high})", file=self.file))
        return values

    def _theta(self, value: object, key: str) -> float | None:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            self.problems.append(Problem(key, f"expected a positive number, got {shown_value(value)}", file=self.file))
            return None
        return float(value)


def shape_from_hf_config(config: dict, file: str) -> dict:
    """The inline `[model]` table (family and sizes) equivalent to a config.json; keys it
    leaves out take the defaults of transformers' configuration class (`HF_DEFAULTS`)."""
    model_type = config.get("model_type")
    bad_names = architectures_problem(config, file)
    if model_type not in SUPPORTED:
        said = "required" if model_type is None else f"{shown_value(model_type)} is not supported"
        problem = Problem("model_type", f"{said} (supported: {', '.join(SUPPORTED)})", file=file)
        raise InputError([p for p in (bad_names, problem) if p])
    if bad_names:
        raise InputError(bad_names)
    r = _Reader(config, file, model_type)
    if model_type == "gpt2":
        shape = _gpt2(r)
    elif model_type == "falcon":
        shape = _falcon(r)
    else:
        shape = dict(
            family=model_type,
            num_layers=r.get("num_hidden_layers"),
            hidden_size=r.get("hidden_size"),
            num_heads=r.get("num_attention_heads"),
            num_kv_heads=r.get("num_key_value_heads"),
            head_dim=r.get("head_dim"),
            ffn_hidden_size=r.get("intermediate_size"),
            vocab_size=r.get("vocab_size"),
            max_seq_len=r.get("max_position_embeddings"),
            tie_embeddings=r.flag("tie_word_embeddings"),
            rope_theta=r.rope_theta(),
            rope_scaling=r.rope_scaling(),
        )
        if model_type in ("llama", "gemma", "gemma2"):
            # attention_bias puts biases on q, k, v and o (LlamaAttention, GemmaAttention,
            # Gemma2Attention).
            bias = r.flag("attention_bias")
            shape.update(qkv_bias=bias, out_bias=bias)
        if model_type == "llama":
            shape.update(mlp_bias=r.flag("mlp_bias"))
        if model_type == "mixtral":
            shape.update(
                num_experts=r.get("num_local_experts", "num_experts"),
                experts_per_token=r.get("num_experts_per_tok"),
            )
    _check_default_kv_heads(r, shape)
    if r.problems:
        raise InputError(r.problems)
    name = config.get("_name_or_path")
    if isinstance(name, str) and name:
        shape["name"] = name
    return {k: v for k, v in shape.items() if v is not None}


def _check_default_kv_heads(r: _Reader, shape: dict) -> None:
    """Qwen2Config's 32 and GemmaConfig's 16 key/value heads hold whatever the head count:
    transformers then builds projections its attention cannot use. Say so, rather than
    report a number nobody wrote."""
    heads, kv_heads = shape.get("num_heads"), shape.get("num_kv_heads")
    if "num_key_value_heads" in r.defaulted and heads and kv_heads and heads % kv_heads:
        cls = HF_DEFAULTS[r.model_type].config_class
        r.problems.append(Problem(
            "num_key_value_heads",
            f"not given, and {cls}'s default ({kv_heads}) does not divide the {heads} query heads; set it",
            file=r.file,
        ))


def _gpt2(r: _Reader) -> dict:
    # GPT2Config.attribute_map lets the common names stand for n_embd, n_layer, n_head, n_positions.
    if r.flag("add_cross_attention"):
        r.problems.append(Problem(
            "add_cross_attention", "cross-attention layers are not supported (decoder-only models)", file=r.file
        ))
    return dict(
        family="gpt2",
        num_layers=r.get("n_layer", "num_hidden_layers"),
        hidden_size=r.get("n_embd", "hidden_size"),
        num_heads=r.get("n_head", "num_attention_heads"),
        ffn_hidden_size=r.get("n_inner"),
        vocab_size=r.get("vocab_size"),
        max_seq_len=r.get("n_positions", "max_position_embeddings"),
        tie_embeddings=r.flag("tie_word_embeddings"),
    )


def _falcon(r: _Reader) -> dict:
    # FalconAttention: the new architecture has num_kv_heads key/value heads, the old one a
    # single one (multi_query) or one per query head.
    heads = r.get("num_attention_heads")
    new_arch = r.flag("new_decoder_architecture")
    if new_arch:
        kv_heads = r.get("num_kv_heads")
    elif r.flag("multi_query"):
        kv_heads = 1
    else:
        kv_heads = heads
    alibi = r.flag("alibi")
    bias = r.flag("bias")
    parallel = r.flag("parallel_attn")
    # FalconDecoderLayer: input and post-attention norms when attention and MLP run in
    # sequence; in parallel, ln_attn and ln_mlp when num_ln_in_parallel_attn is 2 (its
    # default under the new architecture), else one input_layernorm.
    num_ln = r.get("num_ln_in_parallel_attn")
    if num_ln is None and new_arch:
        num_ln = 2
    return dict(
        family="falcon",
        num_layers=r.get("num_hidden_layers"),
        hidden_size=r.get("n_embed", "hidden_size"),  # FalconConfig.__post_init__: n_embed wins
        num_heads=heads,
        num_kv_heads=kv_heads,
        ffn_hidden_size=r.get("ffn_hidden_size"),
        vocab_size=r.get("vocab_size"),
        max_seq_len=r.get("max_position_embeddings"),
        tie_embeddings=r.flag("tie_word_embeddings"),
        position_embedding="alibi" if alibi else "rope",
        rope_theta=None if alibi else r.rope_theta(),
        rope_scaling=None if alibi else r.rope_scaling(),
        qkv_bias=bias,
        out_bias=bias,
        mlp_bias=bias,
        shared_layer_norm=bool(parallel) and num_ln != 2,
    )


def read_hf_config(path: Path, shown: str) -> tuple[dict, list[Problem], Document]:
    """Read a config.json file and convert it: the inline `[model]` table, notes on the keys
    it holds that the plan does not follow (`config_notes`), and the document, which knows the
    line of each key (for problems the caller finds in the table); every failure names the
    file and the line of its key."""
    doc = read_json(path, shown, key_lines=True)
    try:
        shape = shape_from_hf_config(doc.data, shown)
    except InputError as exc:  # at the line of the key (or of the table that lacks it)
        raise InputError([replace(p, line=doc.line_of(p.path)) if p.path and p.file == shown and p.line is None
                          else p for p in exc.problems]) from None
    return shape, config_notes(doc.data), doc


# Gemma-2's keys that change activations or time but not parameters (modeling_gemma2.py:
# eager_attention_forward's `softcap`, Gemma2ForCausalLM's final_logit_softcapping,
# Gemma2Config.layer_types / sliding_window); docs/job-file.md says what each would add.
UNMODELLED_GEMMA2 = ("attn_logit_softcapping", "final_logit_softcapping", "sliding_window")


def _rope_table(config: dict) -> tuple[str, object] | None:
    """(its key, its value) of the RoPE scaling transformers reads: `rope_scaling` when given
    (neither null nor empty), else `rope_parameters` (convert_rope_params_to_dict), or None."""
    for table in ("rope_scaling", "rope_parameters"):
        inner = config.get(table)
        if inner is not None and inner != {}:
            return table, inner
    return None


def _rope_type(inner: dict) -> tuple[str, object]:
    """(its key, its value) of a scaling table's type: `rope_type`, else the older `type`,
    else "default" (standardize_rope_params)."""
    type_key = "rope_type" if "rope_type" in inner else "type"
    return type_key, inner.get(type_key, "default")


def _unmodelled_rope(config: dict) -> tuple[str, object] | None:
    """(the key, the rope_type) of a RoPE scaling other than 'default' and 'llama3' (Phi-3's
    'longrope', Qwen2.5's 'yarn'), or None."""
    found = _rope_table(config)
    if found is None or not isinstance(found[1], dict):
        return None
    type_key, rope_type = _rope_type(found[1])
    return None if rope_type in ("default", "llama3") else (f"{found[0]}.{type_key}", rope_type)


# The sliding window a config.json without the key gets (transformers 5.24: MistralConfig's
# sliding_window defaults to 4096; Phi3Config's and MixtralConfig's to None).
WINDOW_DEFAULTS = {"mistral": 4096}


def config_notes(config: dict) -> list[Problem]:
    """Notes on keys of a (supported) config.json that the plan reads past: a checkpoint's
    quantization (the plan is that of the model's shape; QLoRA is `[lora] base_dtype = "nf4"`),
    a sliding attention window (Mistral v0.1, Phi-3), Gemma-2's soft-capping and sliding window."""
    notes = []
    quantization = config.get("quantization_config")
    if isinstance(quantization, dict) and quantization:
        method = quantization.get("quant_method")
        words = [method] if isinstance(method, str) and method else []
        words += ["4-bit"] if quantization.get("load_in_4bit") else ["8-bit"] if quantization.get("load_in_8bit") else []
        notes.append(Problem(
            "quantization_config", f"the checkpoint's {' '.join(words + ['quantization'])} is ignored: the model "
            "is planned from its shape at the job's precision; for QLoRA write [lora] base_dtype = \"nf4\"",
            severity="note"))
    model_type = config.get("model_type")
    rope = _unmodelled_rope(config)
    if rope:
        path, rope_type = rope
        notes.append(Problem(
            path, f"{shown_value(rope_type)}: not modelled (only 'llama3' is): RoPE scaling changes no byte and no "
            "FLOP the plan counts; `shardplan run` builds the model with unscaled rotary frequencies, and "
            "`export` writes no scaling", severity="note"))
    window = config.get("sliding_window", WINDOW_DEFAULTS.get(model_type))
    if model_type == "qwen2" and config.get("use_sliding_window") is not True:
        window = None  # Qwen2Config: use_sliding_window defaults to False, and then no window
    if (model_type != "gemma2" and isinstance(window, int) and not isinstance(window, bool) and window > 0):
        # transformers' Mistral, Phi-3 (and Qwen2 with use_sliding_window) mask the scores
        # outside the window: eager and SDPA attention still compute them; flash-attention's
        # window_size skips those blocks.
        notes.append(Problem(
            "sliding_window", f"{window:,}: not modelled: attention is counted causal over the whole sequence, as "
            "eager and SDPA attention compute it (masking what is outside the window); a flash kernel that "
            f"skips the blocks outside it runs sequences longer than {window:,} tokens faster than estimated",
            severity="note"))
    given = [key for key in UNMODELLED_GEMMA2 if config.get(key) is not None]
    if model_type == "gemma2" and given:
        notes.append(Problem(
            "", f"{', '.join(given)}: not modelled (soft-capping's tanh outputs kept for backward, the "
            "window's shorter attention; docs/job-file.md)", severity="note"))
    return notes
