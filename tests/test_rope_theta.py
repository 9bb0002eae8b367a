"""`[model] rope_theta`, the base of rotary position embeddings: read from a Hugging Face
config.json as transformers reads it, shipped in the presets as each model's config.json
publishes it, and refused with one line when it is no positive finite number."""

from __future__ import annotations

import json

import pytest

from conftest import DATA, run_cli
from shardplan.io.hf_config import DEFAULT_ROPE_THETA, HF_DEFAULTS, SUPPORTED, read_hf_config, shape_from_hf_config
from shardplan.io.job import load_job
from shardplan.io.presets import presets_dir

PRESETS = presets_dir() / "models"

# Each rope preset's base and where it is published: the `rope_theta` of the Hugging Face
# repository's config.json (copies in tests/data/hf_configs, SOURCES.md). Llama 2's
# config.json gives none: transformers takes LlamaConfig's default, 10000.0.
PUBLISHED = {
    "llama-2-7b": (10000.0, "meta-llama/Llama-2-7b-hf", "llama-2-7b"),
    "llama-2-13b": (10000.0, "meta-llama/Llama-2-13b-hf", "llama-2-13b"),
    "llama-2-70b": (10000.0, "meta-llama/Llama-2-70b-hf", "llama-2-70b"),
    "llama-3-8b": (500000.0, "meta-llama/Meta-Llama-3-8B", "llama-3-8b"),
    "llama-3-70b": (500000.0, "meta-llama/Meta-Llama-3-70B", "llama-3-70b"),
    "llama-3.1-8b": (500000.0, "meta-llama/Llama-3.1-8B", "llama-3.1-8b"),
    "llama-3.1-70b": (500000.0, "meta-llama/Llama-3.1-70B", "llama-3.1-70b"),
    "llama-3.1-405b": (500000.0, "meta-llama/Llama-3.1-405B", "llama-3.1-405b"),
    "mistral-7b": (10000.0, "mistralai/Mistral-7B-v0.1", "mistral-7b-v0.1"),
    "mixtral-8x7b": (1000000.0, "mistralai/Mixtral-8x7B-v0.1", "mixtral-8x7b"),
    "qwen2.5-7b": (1000000.0, "Qwen/Qwen2.5-7B", "qwen2.5-7b"),
}
# Learned positions: no base. tiny-llama's is the base `shardplan run` builds (runtime/model.py).
NO_BASE = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "tiny-gpt2")

SMALL_LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
INLINE = ('[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
          'ffn_hidden_size = 128\nvocab_size = 1000\n')


def preset_theta(name: str) -> float | None:
    return load_job(None, [("model.preset", name)], env={}).shape.rope_theta


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_each_preset_carries_its_published_base(name):
    value, repo, copy = PUBLISHED[name]
    assert preset_theta(name) == value, f"{name}: {repo}/config.json rope_theta"
    # The copy is that repository's config.json, and reads to the same base.
    assert f"| {copy}.json | {repo} |" in (DATA / "hf_configs" / "SOURCES.md").read_text()
    path = DATA / "hf_configs" / f"{copy}.json"
    assert read_hf_config(path, path.name)[0]["rope_theta"] == value
    # The preset names its source beside the value.
    line = next(row for row in (PRESETS / f"{name}.toml").read_text().splitlines() if row.startswith("rope_theta"))
    assert repo in line


@pytest.mark.parametrize("name", NO_BASE)
def test_learned_position_presets_have_no_base(name):
    assert preset_theta(name) is None


def test_tiny_llama_has_the_runtime_base():
    from shardplan.runtime.model import ROPE_THETA

    assert preset_theta("tiny-llama") == ROPE_THETA


# config.json forms transformers reads a base from (modeling_rope_utils.py,
# convert_rope_params_to_dict): the top-level key, transformers 5's rope_parameters, a
# rope_scaling that carries it, a rope_scaling without it (the top-level key stays), none.
FORMS = {
    "top-level": (dict(SMALL_LLAMA, rope_theta=500000.0), 500000.0),
    "integer": (dict(SMALL_LLAMA, rope_theta=500000), 500000.0),
    "rope-parameters": (dict(SMALL_LLAMA, rope_parameters=dict(rope_type="default", rope_theta=250000.0)), 250000.0),
    "rope-parameters-win": (dict(SMALL_LLAMA, rope_theta=1.0, rope_parameters=dict(rope_type="default",
                                                                                  rope_theta=250000.0)), 250000.0),
    "scaling-without-base": (dict(SMALL_LLAMA, rope_theta=500000.0, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), 500000.0),
    "missing": (SMALL_LLAMA, 10000.0),
    "mixtral-missing": (dict(SMALL_LLAMA, model_type="mixtral", num_attention_heads=8), 1000000.0),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_hf_config_base_is_read(form):
    config, expected = FORMS[form]
    assert shape_from_hf_config(config, "config.json")["rope_theta"] == expected


@pytest.mark.parametrize("form", sorted(FORMS))
def test_hf_config_base_equals_transformers(form):
    transformers = pytest.importorskip("transformers")
    config, _ = FORMS[form]
    rest = {k: v for k, v in config.items() if k != "model_type"}
    theirs = transformers.AutoConfig.for_model(config["model_type"], **rest).rope_parameters["rope_theta"]
    assert shape_from_hf_config(config, "config.json")["rope_theta"] == theirs


@pytest.mark.parametrize("model_type", [t for t in SUPPORTED if t != "gpt2"])
def test_default_base_is_the_installed_classes(model_type):
    """DEFAULT_ROPE_THETA is each configuration class's `default_theta` (transformers 5.23.0)."""
    transformers = pytest.importorskip("transformers")
    cls = type(transformers.AutoConfig.for_model(model_type))
    assert cls.__name__ == HF_DEFAULTS[model_type].config_class
    assert cls.default_theta == DEFAULT_ROPE_THETA[model_type]


def test_no_base_without_rotary_positions():
    gpt2 = dict(model_type="gpt2", n_layer=2, n_embd=64, n_head=4, rope_theta=10000.0)
    assert "rope_theta" not in shape_from_hf_config(gpt2, "config.json")
    falcon = dict(model_type="falcon", num_hidden_layers=2, hidden_size=64, num_attention_heads=4, alibi=True)
    assert "rope_theta" not in shape_from_hf_config(falcon, "config.json")
    falcon["alibi"] = False
    assert shape_from_hf_config(falcon, "config.json")["rope_theta"] == 10000.0


def test_inline_base_is_kept(write):
    """An integer base and its float are one model; the resolved shape writes it back."""
    shape = load_job(write("job.toml", INLINE + "rope_theta = 500000\n"), env={}).shape
    assert shape.rope_theta == 500000.0 and shape.to_table()["rope_theta"] == 500000.0
    assert load_job(write("bare.toml", INLINE), env={}).shape.rope_theta is None


BAD_JOB_VALUES = {
    "0": "model.rope_theta: must be > 0.0 (got 0)",
    "-1.0": "model.rope_theta: must be > 0.0 (got -1.0)",
    "inf": "model.rope_theta: must be a finite number > 0 (got inf)",
    "nan": "model.rope_theta: must be a finite number > 0 (got nan)",
    "1e400": "model.rope_theta: must be a finite number > 0 (got inf)",
    '"500000"': "model.rope_theta: expected a number, got a string '500000'",
    "true": "model.rope_theta: expected a number, got a boolean true",
}


@pytest.mark.parametrize("value", sorted(BAD_JOB_VALUES))
def test_bad_base_in_a_job_is_one_line(write, value):
    job = write("job.toml", INLINE + f"rope_theta = {value}\n")
    result = run_cli("validate", job)
    assert result.code == 2
    assert result.err_lines == [f"{job}:8: {BAD_JOB_VALUES[value]}"]


def test_bad_base_on_the_command_line_is_one_line(write):
    result = run_cli("validate", write("job.toml", INLINE), "--set", "model.rope_theta=-5")
    assert result.code == 2
    assert result.err_lines == ["--set: model.rope_theta: must be > 0.0 (got -5)"]


def test_a_base_for_learned_positions_is_refused(write):
    job = write("job.toml", '[model]\nfamily = "gpt2"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
                            'max_seq_len = 64\nvocab_size = 1000\nrope_theta = 10000.0\n')
    result = run_cli("validate", job)
    assert result.code == 2
    assert result.err_lines == [f"{job}:8: model.rope_theta: only rotary position embeddings have a base; "
                                "this model's are 'learned'"]


@pytest.mark.parametrize("where, value, message", [
    ("rope_theta", 0, "rope_theta: expected a positive number, got 0"),
    ("rope_theta", "x", "rope_theta: expected a positive number, got 'x'"),
    ("rope_parameters", dict(rope_type="default", rope_theta=-1.0),
     "rope_parameters.rope_theta: expected a positive number, got -1.0"),
])
def test_bad_base_in_a_config_json_is_one_line(write, where, value, message):
    write("config.json", json.dumps(dict(SMALL_LLAMA, **{where: value})))
    job = write("job.toml", '[model]\nhf_config = "config.json"\n')
    result = run_cli("validate", job)
    assert result.code == 2
    assert result.err_lines == [f"config.json:1: {message}"]


def test_torchtitan_flavors_share_the_presets_base():
    """torchtitan names a model by flavor, whose rope_theta its Python model args fix
    (torchtitan/models/llama3/__init__.py `llama3_args`): the preset a flavor imports as
    carries the same base, so neither the import nor the export has a base to write."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3 import llama3_args

    from shardplan.io.interop.torchtitan_common import FLAVORS

    for (name, flavor), preset in FLAVORS.items():
        assert name == "llama3"
        assert llama3_args[flavor].rope_theta == preset_theta(preset), (flavor, preset)
