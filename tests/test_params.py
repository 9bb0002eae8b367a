"""Parameter counts against `transformers`, the reference nobody here wrote.

Reference numbers: transformers 5.23.0 with torch 2.13.0 (cross-checked with transformers
4.57.6, identical), each config.json in tests/data/hf_configs built with
`AutoModelForCausalLM.from_config(...)` under `torch.device("meta")`, counting
`sum(p.numel() for p in model.parameters())` (tied weights once). `embedding` is the token
embedding plus GPT-2's learned position table. Mixtral's active count is total minus the
6 unused experts of every layer (transformers has no such count; computed from its shapes).
The config files are the published Hugging Face config.json files (tests/data/hf_configs/SOURCES.md).
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import DATA
from shardplan.core.params import count_params, model_params
from shardplan.io.hf_config import read_hf_config
from shardplan.spec.model import resolve_shape

# name: (total, embedding incl. positions, active)
TRANSFORMERS_COUNTS = {
    "gpt2": (124_439_808, 38_597_376 + 786_432, None),
    "gpt2-medium": (354_823_168, 51_463_168 + 1_048_576, None),
    "gpt2-large": (774_030_080, 64_328_960 + 1_310_720, None),
    "gpt2-xl": (1_557_611_200, 80_411_200 + 1_638_400, None),
    "llama-2-7b": (6_738_415_616, 131_072_000, None),
    "llama-2-13b": (13_015_864_320, 163_840_000, None),
    "llama-2-70b": (68_976_648_192, 262_144_000, None),
    "llama-3-8b": (8_030_261_248, 525_336_576, None),
    "llama-3-70b": (70_553_706_496, 1_050_673_152, None),
    "llama-3.1-8b": (8_030_261_248, 525_336_576, None),
    "llama-3.1-70b": (70_553_706_496, 1_050_673_152, None),
    "llama-3.1-405b": (405_853_388_800, 2_101_346_304, None),
    "llama-3.2-1b": (1_235_814_400, 262_668_288, None),
    "mistral-7b-v0.1": (7_241_732_096, 131_072_000, None),
    "mistral-7b-v0.3": (7_248_023_552, 134_217_728, None),
    "mixtral-8x7b": (46_702_792_704, 131_072_000, 12_879_925_248),
    "qwen2.5-7b": (7_615_616_512, 544_997_376, None),
    "qwen2-0.5b": (494_032_768, 136_134_656, None),
    "gemma-7b": (8_537_680_896, 786_432_000, None),
    "gemma-2b": (2_506_172_416, 524_288_000, None),
    "falcon-7b": (6_921_720_704, 295_469_056, None),
    "falcon-40b": (41_303_293_952, 532_676_608, None),
    "phi-3-mini-4k": (3_821_079_552, 98_500_608, None),
}


def shape_of(name: str):
    path = DATA / "hf_configs" / f"{name}.json"
    shape, problems = resolve_shape(read_hf_config(path, str(path))[0], where="")
    assert not problems
    return shape


@pytest.mark.parametrize("name", sorted(TRANSFORMERS_COUNTS))
def test_counts_equal_transformers(name):
    total, embedding, active = TRANSFORMERS_COUNTS[name]
    counts = count_params(shape_of(name))
    assert counts.total == total
    assert counts.embedding == embedding
    assert counts.active == (active or total)


@pytest.mark.parametrize("name", ["gpt2", "llama-3-8b", "mixtral-8x7b", "falcon-40b", "gemma-2b", "qwen2-0.5b"])
def test_enumeration_matches_count(name):
    shape = shape_of(name)
    params = model_params(shape)
    assert sum(p.numel for p in params) == count_params(shape).total
    assert len({p.name for p in params}) == len(params)


def test_structure_details():
    # Qwen2 has q/k/v biases, no o_proj bias; Falcon-7B is multi-query with one shared norm.
    qwen = {p.name: p for p in model_params(shape_of("qwen2-0.5b"))}
    assert "layers.0.attn.k_proj.bias" in qwen and "layers.0.attn.o_proj.bias" not in qwen
    assert "lm_head.weight" not in qwen  # tied
    falcon = {p.name: p for p in model_params(shape_of("falcon-7b"))}
    assert falcon["layers.0.attn.k_proj.weight"].shape == (64, 4544)
    assert "layers.0.mlp_norm.weight" not in falcon and "layers.0.attn_norm.bias" in falcon
    gemma = {p.name: p for p in model_params(shape_of("gemma-7b"))}
    assert gemma["layers.0.attn.q_proj.weight"].shape == (16 * 256, 3072)


@given(
    layers=st.integers(1, 8), heads=st.integers(1, 8), group=st.integers(1, 4), head_dim=st.integers(1, 16),
    ffn=st.integers(1, 64), vocab=st.integers(1, 1000), tied=st.booleans(),
    family=st.sampled_from(["llama", "qwen2", "gpt2", "gemma", "falcon"]),
)
def test_count_is_sum_of_layers(layers, heads, group, head_dim, ffn, vocab, tied, family):
    table = dict(family=family, num_layers=layers, hidden_size=heads * group * head_dim,
                 num_heads=heads * group, num_kv_heads=heads, ffn_hidden_size=ffn, vocab_size=vocab,
                 max_seq_len=64, tie_embeddings=tied)
    shape, problems = resolve_shape(table)
    assert not problems
    params = model_params(shape)
    counts = count_params(shape)
    assert counts.total == sum(p.numel for p in params)
    assert counts.per_layer * layers == sum(p.numel for p in params if p.layer is not None)


# Gemma-2 (Gemma Team 2024, "Gemma 2", Table 1; the sizes of google/gemma-2-2b / -9b / -27b's
# config.json, tests/data/gemma2/gemma-2-9b.json for the 9B) against the published totals:
# KerasNLP keras_nlp/src/models/gemma/gemma_presets.py `params` of gemma2_2b_en, gemma2_9b_en,
# gemma2_27b_en (tests/data/gemma2/SOURCES.md). Built as a ModelShape directly: the job file's
# [model] takes the gemma2 family once spec/model.py's Family lists it.
GEMMA2 = {  # layers, hidden, heads, kv heads, head_dim, intermediate, published total
    "gemma-2-2b": (26, 2304, 8, 4, 256, 9216, 2_614_341_888),
    "gemma-2-9b": (42, 3584, 16, 8, 256, 14336, 9_241_705_984),
    "gemma-2-27b": (46, 4608, 32, 16, 128, 36864, 27_227_128_320),
}


def gemma2_shape(layers, hidden, heads, kv_heads, head_dim, ffn):
    from shardplan.spec.model import ModelShape

    return ModelShape(family="gemma2", num_layers=layers, hidden_size=hidden, num_heads=heads,
                      num_kv_heads=kv_heads, head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=256000,
                      max_seq_len=8192, tie_embeddings=True, norm="rmsnorm", activation="geglu",
                      position_embedding="rope", qkv_bias=False, out_bias=False, mlp_bias=False,
                      shared_layer_norm=False, num_experts=1, experts_per_token=1)


@pytest.mark.parametrize("name", sorted(GEMMA2))
def test_gemma2_counts_equal_the_published_totals(name):
    *sizes, total = GEMMA2[name]
    shape = gemma2_shape(*sizes)
    counts = count_params(shape)
    assert counts.total == total
    # Two RMSNorms per layer more than Gemma's layout (modeling_gemma2.py Gemma2DecoderLayer:
    # post_attention_layernorm, post_feedforward_layernorm): 9B 42 * 2 * 3584 = 301,056, what
    # the review's config edited to model_type "gemma" missed (9,241,404,928).
    from dataclasses import replace

    assert total - count_params(replace(shape, family="gemma")).total == 2 * shape.num_layers * shape.hidden_size
    names = [p.name for p in model_params(shape) if p.layer == 0]
    assert names[:1] + names[5:7] + names[-1:] == [
        "layers.0.attn_norm.weight", "layers.0.attn_post_norm.weight", "layers.0.mlp_norm.weight",
        "layers.0.mlp_post_norm.weight"]


def test_gemma2_config_reads_into_the_published_shape():
    """The 9B's config.json read by io/hf_config.py is the shape counted above (head_dim from
    the config, tied embeddings by Gemma2Config's default)."""
    import json

    from shardplan.io.hf_config import SUPPORTED, shape_from_hf_config

    assert "gemma2" in SUPPORTED
    config = json.loads((DATA / "gemma2" / "gemma-2-9b.json").read_text(encoding="utf-8"))
    table = shape_from_hf_config(config, "gemma-2-9b.json")
    layers, hidden, heads, kv_heads, head_dim, ffn, _ = GEMMA2["gemma-2-9b"]
    assert {k: table[k] for k in ("family", "num_layers", "hidden_size", "num_heads", "num_kv_heads", "head_dim",
                                  "ffn_hidden_size", "vocab_size", "tie_embeddings")} == dict(
        family="gemma2", num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
        head_dim=head_dim, ffn_hidden_size=ffn, vocab_size=256000, tie_embeddings=True)
