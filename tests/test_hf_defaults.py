"""A config.json that leaves keys out counts what `transformers` counts for it.

Where a key is missing, transformers' configuration class of the model_type supplies it
(`MistralConfig.num_key_value_heads = 8`, `GemmaConfig.head_dim = 256`, ...); shardplan keeps
a copy of those defaults (`shardplan.io.hf_config.HF_DEFAULTS`) so that planning never imports
transformers. The reference is transformers itself: the same config.json read with
`AutoConfig.from_pretrained`, built with `AutoModelForCausalLM.from_config(...)` under
`torch.device("meta")`, counting `sum(p.numel() for p in model.parameters())` (tied weights
once), as tests/test_params.py does for the published configs.
"""

from __future__ import annotations

import json

import pytest

from conftest import DATA, run_cli
from shardplan.io.hf_config import DERIVED, HF_DEFAULTS, SUPPORTED, config_notes
from shardplan.spec.model import FAMILIES

# Each model_type with only the keys shardplan requires (layers, width, heads); the head
# counts are ones the class's default key/value heads divide (Mistral/Mixtral 8, Qwen2 32,
# Gemma 16).
MINIMAL = {
    "gpt2": dict(n_layer=2, n_embd=64, n_head=4),
    "llama": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
    "mistral": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8),
    "mixtral": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=8),
    "qwen2": dict(num_hidden_layers=2, hidden_size=128, num_attention_heads=32),
    "gemma": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=16),
    "falcon": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
    "phi3": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
    "gemma2": dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4),
}

# Keys whose missing value depends on other keys, and other spellings the classes accept.
VARIANTS = {
    "llama-gqa-bias": dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                           num_key_value_heads=2, attention_bias=True, mlp_bias=True, tie_word_embeddings=True),
    "gpt2-common-names": dict(model_type="gpt2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                              max_position_embeddings=128, n_inner=96),
    # Qwen2Config: num_key_value_heads is `int | None = 32`; an explicit null means num_attention_heads.
    "qwen2-null-kv-heads": dict(model_type="qwen2", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                num_key_value_heads=None),
    "gemma-attention-bias": dict(model_type="gemma", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=16, attention_bias=True),
    "mixtral-num-experts": dict(model_type="mixtral", num_hidden_layers=2, hidden_size=64, num_attention_heads=8,
                                num_experts=4, num_experts_per_tok=1),
    "falcon-new-architecture": dict(model_type="falcon", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                    new_decoder_architecture=True),
    "falcon-new-architecture-one-norm": dict(model_type="falcon", num_hidden_layers=2, hidden_size=64,
                                             num_attention_heads=4, new_decoder_architecture=True,
                                             num_kv_heads=2, num_ln_in_parallel_attn=1),
    "falcon-new-architecture-sequential": dict(model_type="falcon", num_hidden_layers=2, hidden_size=64,
                                               num_attention_heads=4, new_decoder_architecture=True,
                                               parallel_attn=False, num_ln_in_parallel_attn=1),
    "falcon-parallel-two-norms": dict(model_type="falcon", num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                      num_ln_in_parallel_attn=2),
    "falcon-multi-head-bias-n-embed": dict(model_type="falcon", num_hidden_layers=2, n_embed=64, hidden_size=32,
                                           num_attention_heads=4, multi_query=False, bias=True, alibi=True),
}

# The configs of the defect report, with the count transformers 5.23.0 (torch 2.13.0) gives
# for each (meta-device model as above); shardplan used to give 8,047,038,464, 6,167,891,968
# and 1,843,424,256 (the head count for the key/value heads, hidden_size / heads for head_dim).
RECORDED = {
    "mistral-7b-no-kv-heads": (dict(model_type="mistral", hidden_size=4096, intermediate_size=14336,
                                    num_attention_heads=32, num_hidden_layers=32, vocab_size=32000),
                               7_241_732_096),
    "mixtral-4-layers-no-kv-heads": (dict(model_type="mixtral", hidden_size=4096, intermediate_size=14336,
                                          num_attention_heads=32, num_hidden_layers=4, vocab_size=32000),
                                     6_067_228_672),
    "gemma-no-head-dim": (dict(model_type="gemma", hidden_size=3072, num_attention_heads=16, num_hidden_layers=4),
                          1_893_755_904),
}

CASES = {
    **{name: dict(model_type=name, **keys) for name, keys in MINIMAL.items()},
    **VARIANTS,
    **{name: config for name, (config, _) in RECORDED.items()},
}


def shardplan_total(config: dict, tmp_path) -> int:
    """params.total of `shardplan estimate config.json --json`, the config given as FILE."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config), encoding="utf-8")
    result = run_cli("estimate", str(path), "--json")
    assert result.code == 0, result.err
    return result.json["params"]["total"]


def transformers_total(tmp_path) -> int:
    """transformers' count of the config.json in tmp_path (built on the meta device)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def test_every_supported_type_is_covered():
    assert set(MINIMAL) == set(HF_DEFAULTS)
    # A model_type is read only once the job file's [model] has its family (spec/model.py).
    assert set(SUPPORTED) == set(HF_DEFAULTS) & set(FAMILIES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_counts_equal_transformers(name, tmp_path):
    ours = shardplan_total(CASES[name], tmp_path)
    assert ours == transformers_total(tmp_path)


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_counts(name, tmp_path):
    config, total = RECORDED[name]
    assert shardplan_total(config, tmp_path) == total


def test_job_file_hf_config_takes_the_same_defaults(tmp_path):
    # 32 layers of MistralConfig's defaults otherwise: 8 key/value heads, as recorded above.
    config, total = RECORDED["mistral-7b-no-kv-heads"]
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    (tmp_path / "job.toml").write_text('[model]\nhf_config = "config.json"\n', encoding="utf-8")
    result = run_cli("estimate", str(tmp_path / "job.toml"), "--json")
    assert result.code == 0, result.err
    assert result.json["params"]["total"] == total


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_table_equals_the_installed_classes(model_type):
    """Each default that is not DERIVED is the installed class's own, so a transformers
    release that changes one fails here."""
    transformers = pytest.importorskip("transformers")
    cls = transformers.AutoConfig.for_model(model_type)
    assert type(cls).__name__ == HF_DEFAULTS[model_type].config_class
    for key, value in HF_DEFAULTS[model_type].values.items():
        if value is not DERIVED:
            assert getattr(cls, key) == value, key


def test_default_kv_heads_that_do_not_divide_the_heads_are_refused(write):
    # Qwen2Config keeps 32 key/value heads for 28 query heads: transformers builds the model
    # (2,125,018,624 parameters at these sizes) but its attention cannot run on it.
    config = write("config.json", json.dumps(dict(
        model_type="qwen2", hidden_size=3584, num_attention_heads=28, num_hidden_layers=4,
        intermediate_size=18944, vocab_size=152064,
    )))
    result = run_cli("estimate", config, "--json")
    assert result.code == 2
    assert ("num_key_value_heads: not given, and Qwen2Config's default (32) does not divide the 28 query heads; "
            "set it") in result.err


def test_falcon_n_head_is_not_read(write):
    # FalconConfig ignores n_head and n_layer (it would build its default 71 heads).
    config = write("config.json", json.dumps(dict(model_type="falcon", hidden_size=64, n_head=4, n_layer=2)))
    result = run_cli("estimate", config, "--json")
    assert result.code == 2
    assert "num_attention_heads: required (FalconConfig does not read n_head)" in result.err
    assert "num_hidden_layers: required (FalconConfig does not read n_layer)" in result.err


def test_gpt2_cross_attention_is_refused(write):
    config = write("config.json", json.dumps(dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4,
                                                  add_cross_attention=True)))
    result = run_cli("estimate", config, "--json")
    assert result.code == 2
    assert "add_cross_attention: cross-attention layers are not supported" in result.err


def test_gemma2_is_estimated_with_its_post_norms_and_refused_by_run(write):
    """Gemma-2 (modeling_gemma2.py Gemma2DecoderLayer) normalizes each branch's output before
    the residual add: RMSNorm keeps its input for backward, one sbh tensor per branch, so its
    layer keeps 2 sbh more than Gemma's at the residual precision. `run` does not build those
    norms and refuses the model (runtime/capabilities.py)."""
    gemma2 = dict(model_type="gemma2", **MINIMAL["gemma2"], num_key_value_heads=2, head_dim=16,
                  intermediate_size=128, vocab_size=1000)
    gemma = dict(gemma2, model_type="gemma")  # the same shape, without the post-norms
    figures = {}
    for name, config in (("gemma2", gemma2), ("gemma", gemma)):
        result = run_cli("estimate", write(f"{name}.json", json.dumps(config)), "--json", "--explain")
        assert result.code == 0, result.err
        figures[name] = result.json["devices"][0]["saved_activations"]
    hidden, seq = gemma2["hidden_size"], 2048  # train.seq_len's default
    # bf16-mixed (the default) under FSDP2's MixedPrecisionPolicy: a bf16 residual stream, 2 bytes
    # (core/activations.py `residual_bytes`, measured by tests/test_run.py).
    assert figures["gemma2"] - figures["gemma"] == gemma2["num_hidden_layers"] * 2 * seq * hidden * 2
    refused = run_cli("run", write("g2.json", json.dumps(gemma2)))
    assert refused.code == 2 and "Gemma-2's post-norms and soft-capping" in refused.err


def test_quantization_config_is_named_in_a_note(write):
    """A "-bnb-4bit" checkpoint's config.json (its quantization_config as bitsandbytes writes
    it: load_in_4bit, bnb_4bit_quant_type nf4, quant_method bitsandbytes) is planned from its
    shape, and a note says so and how to ask for QLoRA."""
    config = dict(model_type="llama", **MINIMAL["llama"], quantization_config=dict(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", quant_method="bitsandbytes"))
    path = write("config.json", json.dumps(config))
    result = run_cli("estimate", path, "--json")
    assert result.code == 0, result.err
    notes = [line for line in result.err.splitlines() if "note: quantization_config" in line]
    assert notes == [f"{path}:1: note: quantization_config: the checkpoint's bitsandbytes 4-bit quantization is "
                     'ignored: the model is planned from its shape at the job\'s precision; for QLoRA write '
                     '[lora] base_dtype = "nf4"']
    plain = run_cli("estimate", write("plain.json", json.dumps(dict(model_type="llama", **MINIMAL["llama"]))),
                    "--json")
    assert result.json["params"] == plain.json["params"]  # the shape alone decides the count
    assert "note: quantization_config" not in plain.err


def test_gemma2_notes_name_what_is_not_modelled():
    config = json.loads((DATA / "gemma2" / "gemma-2-9b.json").read_text(encoding="utf-8"))
    (note,) = config_notes(config)
    assert note.severity == "note"
    assert note.message.startswith("attn_logit_softcapping, final_logit_softcapping, sliding_window: not modelled")
    assert config_notes({**config, "attn_logit_softcapping": None, "final_logit_softcapping": None,
                         "sliding_window": None}) == []


@pytest.mark.parametrize("name, window", [("mistral-7b-v0.1", 4096), ("phi-3-mini-4k", 2047), ("mixtral-8x7b", None),
                                          ("mistral-7b-v0.3", None), ("qwen2-0.5b", None), ("qwen2.5-7b", None)])
def test_a_sliding_window_is_said(name, window):
    """The published config.json files (tests/data/hf_configs, SOURCES.md): Mistral v0.1 and
    Phi-3 mini attend over a window (4,096 and 2,047), Mixtral and Mistral v0.3 have none
    (null), Qwen2 gives one but `use_sliding_window: false` leaves it off (transformers'
    Qwen2Attention). A window gets a note at its key; none, none."""
    config = json.loads((DATA / "hf_configs" / f"{name}.json").read_text(encoding="utf-8"))
    notes = [note for note in config_notes(config) if note.path == "sliding_window"]
    if window is None:
        assert notes == []
        return
    (note,) = notes
    assert note.severity == "note" and note.message.startswith(f"{window:,}: not modelled")


def test_a_sliding_window_follows_transformers_defaults():
    """What transformers' config classes make of a config.json without the keys: MistralConfig's
    sliding_window defaults to 4096; Qwen2Config keeps a window only with use_sliding_window,
    which defaults to False (it then sets sliding_window to None)."""
    from transformers import MistralConfig, Qwen2Config

    def windows(config: dict) -> list[str]:
        return [note.message.split(":")[0] for note in config_notes(config) if note.path == "sliding_window"]

    mistral = json.loads((DATA / "hf_configs" / "mistral-7b-v0.1.json").read_text(encoding="utf-8"))
    del mistral["sliding_window"]
    assert MistralConfig.from_dict(mistral).sliding_window == 4096 and windows(mistral) == ["4,096"]
    qwen = json.loads((DATA / "hf_configs" / "qwen2-0.5b.json").read_text(encoding="utf-8"))
    for given, expected in (({}, []), ({"use_sliding_window": True, "sliding_window": 4096}, ["4,096"])):
        config = {key: value for key, value in qwen.items() if key != "use_sliding_window"} | given
        assert (Qwen2Config.from_dict(config).sliding_window is not None) == bool(expected)
        assert windows(config) == expected
