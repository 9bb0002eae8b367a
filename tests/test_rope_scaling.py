"""`[model] rope_scaling`, Llama 3.1's RoPE frequency scaling: read from a Hugging Face
config.json as transformers reads it, shipped in the llama-3.1-405b preset as its config.json
publishes it, refused with one line when it is malformed, exported to Megatron-LM, and applied
to the rotary tables `shardplan run` builds."""

from __future__ import annotations

import json
import math

import pytest

from conftest import DATA, run_cli
from shardplan.io.hf_config import shape_from_hf_config
from shardplan.io.job import load_job
from shardplan.io.presets import presets_dir
from shardplan.spec.model import RopeScaling

PRESETS = presets_dir() / "models"

# Llama 3.1's scaling as meta-llama/Llama-3.1-405B's config.json publishes it (copy:
# tests/data/hf_configs/llama-3.1-405b.json, SOURCES.md).
LLAMA31 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
               original_max_position_embeddings=8192)
SMALL_LLAMA = dict(model_type="llama", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
INLINE = ('[model]\nfamily = "llama"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
          'ffn_hidden_size = 128\nvocab_size = 1000\n')


def inline_scaling(**fields) -> str:
    """INLINE and a `rope_scaling = { ... }` line (its line 8): `fields` over Llama 3.1's
    values, each written as raw TOML (`factor='"8"'` writes a string; None leaves it out)."""
    values = {**LLAMA31, **fields}
    body = ", ".join(f"{k} = {json.dumps(v) if k == 'rope_type' else v}" for k, v in values.items() if v is not None)
    return INLINE + f"rope_scaling = {{ {body} }}\n"


# --- the preset ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,repo", [("llama-3.1-8b", "meta-llama/Llama-3.1-8B"),
                                       ("llama-3.1-70b", "meta-llama/Llama-3.1-70B"),
                                       ("llama-3.1-405b", "meta-llama/Llama-3.1-405B")])
def test_the_llama_31_presets_carry_their_published_scaling(name, repo):
    shape = load_job(None, [("model.preset", name)], env={}).shape
    assert shape.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)  # the repository's config.json
    line = next(row for row in (PRESETS / f"{name}.toml").read_text().splitlines() if row.startswith("rope_scaling"))
    assert repo in line
    # The same value as the copy of that config.json reads to.
    copy = json.loads((DATA / "hf_configs" / f"{name}.json").read_text())
    assert shape_from_hf_config(copy, "config.json")["rope_scaling"] == LLAMA31


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "llama-2-7b", "mistral-7b", "qwen2.5-7b"])
def test_presets_of_unscaled_models_have_none(name):
    """Their config.json files give `rope_scaling: null` (tests/data/hf_configs)."""
    assert load_job(None, [("model.preset", name)], env={}).shape.rope_scaling is None


# --- reading a config.json ----------------------------------------------------------------

# config.json forms transformers reads a scaling from (modeling_rope_utils.py:
# convert_rope_params_to_dict takes `rope_scaling` over `rope_parameters`;
# standardize_rope_params takes `type` for a missing `rope_type` and fills a llama3 scaling's
# original_max_position_embeddings from max_position_embeddings).
FORMS = {
    "rope-scaling": (dict(SMALL_LLAMA, rope_theta=500000.0, rope_scaling=LLAMA31), LLAMA31),
    "rope-parameters": (dict(SMALL_LLAMA, rope_parameters=dict(LLAMA31, rope_theta=500000.0)), LLAMA31),
    "type-alias": (dict(SMALL_LLAMA, rope_theta=500000.0, rope_scaling={
        **{k: v for k, v in LLAMA31.items() if k != "rope_type"}, "type": "llama3"}), LLAMA31),
    "scaling-over-parameters": (dict(SMALL_LLAMA, rope_scaling=dict(LLAMA31, factor=32.0),
                                     rope_parameters=dict(rope_type="default", rope_theta=500000.0)),
                                dict(LLAMA31, factor=32.0)),
    "original-from-max-positions": (dict(SMALL_LLAMA, max_position_embeddings=4096, rope_scaling={
        k: v for k, v in LLAMA31.items() if k != "original_max_position_embeddings"}),
        dict(LLAMA31, original_max_position_embeddings=4096)),
    "default": (dict(SMALL_LLAMA, rope_parameters=dict(rope_type="default", rope_theta=500000.0)), None),
    "null": (dict(SMALL_LLAMA, rope_scaling=None), None),
    "empty": (dict(SMALL_LLAMA, rope_scaling={}), None),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_hf_config_scaling_is_read(form):
    config, expected = FORMS[form]
    assert shape_from_hf_config(config, "config.json").get("rope_scaling") == expected


@pytest.mark.parametrize("form", sorted(FORMS))
def test_hf_config_scaling_equals_transformers(form):
    transformers = pytest.importorskip("transformers")
    config, expected = FORMS[form]
    rest = {k: v for k, v in json.loads(json.dumps(config)).items() if k != "model_type"}  # transformers edits it
    theirs = transformers.AutoConfig.for_model(config["model_type"], **rest).rope_parameters
    ours = shape_from_hf_config(config, "config.json").get("rope_scaling")
    if ours is None:
        assert theirs["rope_type"] == "default"
    else:
        assert {k: theirs[k] for k in ours} == ours


def test_hf_config_scaling_reaches_the_shape(write):
    write("config.json", (DATA / "hf_configs" / "llama-3.2-1b.json").read_text())
    shape = load_job(write("job.toml", '[model]\nhf_config = "config.json"\n'), env={}).shape
    assert shape.rope_scaling == RopeScaling(32.0, 1.0, 4.0, 8192)  # meta-llama/Llama-3.2-1B config.json


@pytest.mark.parametrize("table, path", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, "rope_scaling.rope_type"),
    ({"type": "linear", "factor": 2.0}, "rope_scaling.type"),
])
def test_other_scalings_in_a_config_json_are_noted(write, table, path):
    """Qwen2.5's README has users add a yarn rope_scaling for long contexts; Phi-3's 128k configs
    carry 'longrope'. RoPE scaling changes no byte and no FLOP of the plan: the config.json
    is planned as without it, with a note at the key (it was refused, exit 2)."""
    write("config.json", json.dumps(dict(SMALL_LLAMA, rope_scaling=table)))
    job = write("job.toml", '[model]\nhf_config = "config.json"\n')
    result = run_cli("estimate", job, "--json")
    assert result.code == 0, result.err
    (note,) = [line for line in result.err_lines if f"note: {path}:" in line]
    assert "not modelled (only 'llama3' is)" in note and note.startswith("config.json:1: ")
    write("config.json", json.dumps(SMALL_LLAMA))
    plain = run_cli("estimate", job, "--json")
    assert (result.json["peak_gpu_bytes"], result.json["params"]) == (plain.json["peak_gpu_bytes"], plain.json["params"])


@pytest.mark.parametrize("table, message", [
    (dict(LLAMA31, factor=0), "rope_scaling.factor: expected a positive number, got 0"),
    (dict(LLAMA31, low_freq_factor="1"), "rope_scaling.low_freq_factor: expected a positive number, got '1'"),
    ({k: v for k, v in LLAMA31.items() if k != "high_freq_factor"},
     "rope_scaling.high_freq_factor: required for rope_type 'llama3'"),
    (dict(LLAMA31, original_max_position_embeddings=8192.0),
     "rope_scaling.original_max_position_embeddings: expected a positive integer, got 8192.0"),
    (dict(LLAMA31, high_freq_factor=1.0), "rope_scaling.high_freq_factor: must exceed low_freq_factor (1.0) (got 1.0)"),
    ([1, 2], "rope_scaling: expected a table, got [1, 2]"),
])
def test_bad_scaling_in_a_config_json_is_one_line(write, table, message):
    write("config.json", json.dumps(dict(SMALL_LLAMA, rope_scaling=table)))
    result = run_cli("validate", write("job.toml", '[model]\nhf_config = "config.json"\n'))
    assert result.code == 2
    assert result.err_lines == [f"config.json:1: {message}"]


def test_bad_rope_parameters_are_named_as_written(write):
    write("config.json", json.dumps(dict(SMALL_LLAMA, rope_parameters=dict(LLAMA31, factor=-1))))
    result = run_cli("validate", write("job.toml", '[model]\nhf_config = "config.json"\n'))
    assert result.code == 2
    assert result.err_lines == ["config.json:1: rope_parameters.factor: expected a positive number, got -1"]
    write("config.json", json.dumps(dict(SMALL_LLAMA, rope_parameters=dict(LLAMA31, rope_type="dynamic"))))
    result = run_cli("validate", write("job.toml", '[model]\nhf_config = "config.json"\n'))
    assert result.code == 0 and "note: rope_parameters.rope_type: 'dynamic': not modelled" in result.err


# --- the job file ---------------------------------------------------------------------------

def test_inline_scaling_is_kept_and_written_back(write):
    shape = load_job(write("job.toml", inline_scaling(factor=8, original_max_position_embeddings=4096)), env={}).shape
    assert shape.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 4096)
    assert shape.to_table()["rope_scaling"] == dict(LLAMA31, original_max_position_embeddings=4096)
    # "default" is no scaling
    bare = load_job(write("bare.toml", INLINE + 'rope_scaling = { rope_type = "default" }\n'), env={}).shape
    assert bare.rope_scaling is None


BAD_JOB_SCALINGS = {
    "yarn": (dict(rope_type="yarn"), "model.rope_scaling.rope_type: must be one of 'default' or 'llama3' (got 'yarn')"),
    "zero-factor": (dict(factor=0), "model.rope_scaling.factor: must be > 0.0 (got 0)"),
    "negative-low": (dict(low_freq_factor=-1.0), "model.rope_scaling.low_freq_factor: must be > 0.0 (got -1.0)"),
    "inf-high": (dict(high_freq_factor="inf"),
                 "model.rope_scaling.high_freq_factor: must be a finite number > 0 (got inf)"),
    "nan-factor": (dict(factor="nan"), "model.rope_scaling.factor: must be a finite number > 0 (got nan)"),
    "float-original": (dict(original_max_position_embeddings=8192.5),
                       "model.rope_scaling.original_max_position_embeddings: expected an integer, got a float 8192.5"),
    "string-factor": (dict(factor='"8"'), "model.rope_scaling.factor: expected a number, got a string '8'"),
    "missing-factor": (dict(factor=None), "model.rope_scaling.factor: required for rope_type 'llama3'"),
    "high-not-above-low": (dict(high_freq_factor=1.0),
                           "model.rope_scaling.high_freq_factor: must exceed low_freq_factor (1.0) (got 1.0)"),
    "unknown-key": (dict(beta_fast=32), "model.rope_scaling.beta_fast: unknown key (known: rope_type, factor, "
                                        "low_freq_factor, high_freq_factor, original_max_position_embeddings)"),  # yarn's
}


@pytest.mark.parametrize("case", sorted(BAD_JOB_SCALINGS))
def test_bad_scaling_in_a_job_is_one_line(write, case):
    fields, message = BAD_JOB_SCALINGS[case]
    job = write("job.toml", inline_scaling(**fields))
    result = run_cli("validate", job)
    assert result.code == 2, result.err
    assert result.err_lines == [f"{job}:8: {message}"]


def test_default_with_llama3_keys_is_refused(write):
    job = write("job.toml", INLINE + 'rope_scaling = { rope_type = "default", factor = 8.0 }\n')
    result = run_cli("validate", job)
    assert result.code == 2
    assert result.err_lines == [f"{job}:8: model.rope_scaling.factor: rope_type 'default' scales nothing: "
                                "remove it or set rope_type = 'llama3'"]


def test_a_scaling_for_learned_positions_is_refused(write):
    job = write("job.toml", '[model]\nfamily = "gpt2"\nnum_layers = 2\nhidden_size = 64\nnum_heads = 4\n'
                            'max_seq_len = 64\nvocab_size = 1000\n'
                            'rope_scaling = { rope_type = "llama3", factor = 8.0, low_freq_factor = 1.0, '
                            'high_freq_factor = 4.0, original_max_position_embeddings = 8192 }\n')
    result = run_cli("validate", job)
    assert result.code == 2
    assert result.err_lines == [f"{job}:8: model.rope_scaling: only rotary position embeddings are scaled; "
                                "this model's are 'learned'"]


def test_the_scaling_changes_no_figure(write):
    """The scaling moves no byte and no FLOP: the 405B preset's estimate (memory and time) is
    that of its shape written inline without the scaling."""
    tomli_w = pytest.importorskip("tomli_w")
    table = load_job(None, [("model.preset", "llama-3.1-405b")], env={}).shape.to_table()
    table.pop("rope_scaling")
    rest = ('[parallel]\ntp = 8\npp = 2\nnum_microbatches = 16\n[train]\nseq_len = 8192\n'
            '[cluster]\npreset = "h100-80gb"\nnodes = 2\n')
    scaled = run_cli("estimate", write("scaled.toml", '[model]\npreset = "llama-3.1-405b"\n' + rest), "--json")
    plain = run_cli("estimate", write("plain.toml", tomli_w.dumps({"model": table}) + rest), "--json")
    assert "params" in scaled.json, scaled.err  # an estimate (exit 1: it does not fit 2 nodes), not an error
    assert (scaled.code, scaled.json) == (plain.code, plain.json)


# --- Megatron-LM export ---------------------------------------------------------------------

def megatron_export(job: str) -> dict:
    result = run_cli("export", job, "--to", "megatron", "--json")
    assert result.code == 0, result.err
    return result.json


def test_megatron_export_writes_the_scaling():
    """--use-rope-scaling and --rope-scaling-factor (megatron/training/arguments.py, recorded in
    tests/data/interop/megatron_arguments.json); Llama 3.1's other values are Megatron's own, so
    no note."""
    exported = run_cli("export", "llama-3-8b-h100", "--to", "megatron", "--json", "--set",
                       "model.preset=llama-3.1-405b").json
    args = exported["config"]["args"]
    assert "--use-rope-scaling" in args
    assert args[args.index("--rope-scaling-factor") + 1] == "8.0"
    assert not any(n["path"] == "model.rope_scaling" for n in exported["notes"])


def test_megatron_export_without_scaling_writes_none():
    exported = run_cli("export", "llama-3-8b-h100", "--to", "megatron", "--json").json
    assert "--use-rope-scaling" not in exported["config"]["args"]
    assert "--rope-scaling-factor" not in exported["config"]["args"]


def test_values_megatron_fixes_are_said(write):
    """Megatron's RotaryEmbedding._apply_scaling fixes low_freq_factor 1, high_freq_factor 4 and
    original_max_position_embeddings 8192 (megatron/core/models/common/embeddings/
    rotary_pos_embedding.py): a model with others gets a note naming each; the factor is written."""
    exported = megatron_export(write("job.toml", inline_scaling(factor=16.0, high_freq_factor=2.0,
                                                                original_max_position_embeddings=4096)))
    args = exported["config"]["args"]
    assert args[args.index("--rope-scaling-factor") + 1] == "16.0"
    note = next(n["message"] for n in exported["notes"] if n["path"] == "model.rope_scaling")
    assert "high_freq_factor 2.0 (megatron: 4.0)" in note
    assert "original_max_position_embeddings 4096 (megatron: 8192)" in note
    assert "low_freq_factor" not in note


# --- the rotary tables of `shardplan run` ----------------------------------------------------

def megatron_apply_scaling(freqs: list[float], factor=8, low_freq_factor=1, high_freq_factor=4,
                           original_max_position_embeddings=8192) -> list[float]:
    """Megatron-LM's RotaryEmbedding._apply_scaling
    (megatron/core/models/common/embeddings/rotary_pos_embedding.py, at the commit in
    tests/data/interop/megatron_arguments.json), transcribed from its torch.where form to one
    frequency at a time."""
    old_context_len = original_max_position_embeddings
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        inv_freq_llama = freq / factor if wavelen > low_freq_wavelen else freq
        smooth_factor = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
        smoothed = (1 - smooth_factor) * inv_freq_llama / factor + smooth_factor * inv_freq_llama
        is_medium = not wavelen < high_freq_wavelen and not wavelen > low_freq_wavelen
        out.append(smoothed if is_medium else inv_freq_llama)
    return out


# Frequencies by wavelength under Llama 3.1's values (thresholds 8192 / 4 = 2048 and 8192 / 1 =
# 8192 positions), each worked by hand: 1024 < 2048 is kept; 16384 > 8192 is divided by 8;
# 4096 lies between: s = (8192 / 4096 - 1) / (4 - 1) = 1/3, so f * ((1 - 1/3) / 8 + 1/3) = f * 5/12;
# the thresholds themselves blend with s = 1 (f) and s = 0 (f / 8).
BY_HAND = {1024: 1.0, 16384: 1 / 8, 4096: 5 / 12, 2048: 1.0, 8192: 1 / 8}


def test_megatrons_formula_by_hand():
    freqs = [2 * math.pi / wavelen for wavelen in BY_HAND]
    for freq, scaled, ratio in zip(freqs, megatron_apply_scaling(freqs), BY_HAND.values()):
        assert scaled == pytest.approx(freq * ratio, rel=1e-12)


def test_run_scales_as_megatron_and_by_hand():
    torch = pytest.importorskip("torch")
    from shardplan.runtime.model import llama3_inv_freq

    freqs = [2 * math.pi / wavelen for wavelen in BY_HAND]
    ours = llama3_inv_freq(torch.tensor(freqs, dtype=torch.float64), RopeScaling(8.0, 1.0, 4.0, 8192)).tolist()
    for freq, scaled, ratio in zip(freqs, ours, BY_HAND.values()):
        assert scaled == pytest.approx(freq * ratio, rel=1e-12)
    # Llama 3.1 405B's own frequencies (head_dim 128, base 500000): Megatron's formula, in float32.
    base = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32) / 128))
    theirs = megatron_apply_scaling(base.tolist())
    assert llama3_inv_freq(base, RopeScaling(8.0, 1.0, 4.0, 8192)).tolist() == pytest.approx(theirs, rel=1e-6)


def tiny_scaled_model():
    """A llama of head_dim 16 whose 8 wavelengths (2*pi*10000^(2i/16): 6.3 ... 2.0e4 positions)
    fall on both sides of, and between, the thresholds of original_max_position_embeddings 64:
    64 / 4 = 16 and 64 / 1 = 64 positions."""
    from shardplan.runtime.model import Transformer
    from shardplan.spec.model import resolve_shape

    table = dict(family="llama", num_layers=1, hidden_size=64, num_heads=4, ffn_hidden_size=32, vocab_size=50,
                 max_seq_len=32, rope_theta=10000.0, rope_scaling=dict(LLAMA31, original_max_position_embeddings=64))
    shape, problems = resolve_shape(table)
    assert not problems
    return shape, Transformer(shape)


def test_run_tables_are_megatrons_scaled_frequencies():
    torch = pytest.importorskip("torch")
    _, model = tiny_scaled_model()
    rope = next(m for m in model.modules() if m.__class__.__name__ == "RotaryEmbedding")
    plain = [10000.0 ** (-2 * i / 16) for i in range(8)]  # Su et al. 2021: theta^(-2i/d)
    wavelengths = [2 * math.pi / f for f in plain]
    assert min(wavelengths) < 16 and any(16 < w < 64 for w in wavelengths) and max(wavelengths) > 64
    expected = megatron_apply_scaling(plain, original_max_position_embeddings=64)
    assert expected != pytest.approx(plain)  # the scaling changes them
    # position 1's angle on channel pair i is its frequency
    assert torch.allclose(rope.cos[1], torch.tensor(expected).cos(), atol=1e-6)
    assert torch.allclose(rope.sin[1], torch.tensor(expected).sin(), atol=1e-6)


def test_run_tables_equal_transformers():
    """transformers' own llama3 frequencies (modeling_rope_utils.py `_compute_llama3_parameters`)
    for the same config, position by position."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    shape, model = tiny_scaled_model()
    config = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=32,
                                      rope_theta=10000.0,
                                      rope_scaling=dict(LLAMA31, original_max_position_embeddings=64))
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    assert attention_factor == 1.0
    rope = next(m for m in model.modules() if m.__class__.__name__ == "RotaryEmbedding")
    angles = torch.outer(torch.arange(32, dtype=torch.float32), inv_freq.float())
    assert torch.equal(rope.cos, angles.cos()) and torch.equal(rope.sin, angles.sin())


def test_405b_frequencies_equal_transformers():
    """The preset's scaling against transformers' for Llama 3.1 405B's published config.json."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from shardplan.runtime.model import llama3_inv_freq

    shape = load_job(None, [("model.preset", "llama-3.1-405b")], env={}).shape
    copy = json.loads((DATA / "hf_configs" / "llama-3.1-405b.json").read_text())
    config = transformers.LlamaConfig(**{k: v for k, v in copy.items() if k != "model_type"})
    theirs, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    d = shape.head_dim
    base = 1.0 / (shape.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    assert torch.equal(llama3_inv_freq(base, shape.rope_scaling), theirs)


def test_torchtitan_flavors_scale_rope_as_the_export_says():
    """Every llama3 flavor of torchtitan carries Llama 3.1's RoPE scaling (its
    TransformerModelArgs' RoPEScalingArgs), also 8B and 70B: each imports as the Llama 3.1
    preset of its shape, whose scaling is the flavor's, and exports without a note; the
    Llama 3.0 presets of the same shapes export to those flavors with a note that says so."""
    pytest.importorskip("torchtitan")
    from torchtitan.models.llama3 import llama3_args

    from shardplan.io.interop.torchtitan import _FLAVOR_ROPE_SCALING
    from shardplan.io.interop.torchtitan_common import FLAVORS

    for (_, flavor), _preset in FLAVORS.items():
        theirs = llama3_args[flavor].rope_scaling_args
        assert (theirs.scaling_factor, theirs.low_freq_factor, theirs.high_freq_factor,
                theirs.original_max_position_embeddings) == (
            _FLAVOR_ROPE_SCALING.factor, _FLAVOR_ROPE_SCALING.low_freq_factor, _FLAVOR_ROPE_SCALING.high_freq_factor,
            _FLAVOR_ROPE_SCALING.original_max_position_embeddings), flavor
        assert load_job(None, [("model.preset", _preset)], env={}).shape.rope_scaling == _FLAVOR_ROPE_SCALING, flavor
    noted = run_cli("export", "llama-3-8b-h100", "--to", "torchtitan", "--json")
    (note,) = [n for n in noted.json["notes"] if n["path"] == "model.rope_scaling"]
    assert "this model has none" in note["message"] and not note["fails"]
    for preset, flavor in (("llama-3.1-405b", "405B"), ("llama-3.1-70b", "70B"), ("llama-3.1-8b", "8B")):
        quiet = run_cli("export", "llama-3-8b-h100", "--to", "torchtitan", "--set", f"model.preset={preset}", "--json")
        assert quiet.code == 0 and not [n for n in quiet.json["notes"] if n["path"] == "model.rope_scaling"]
        assert quiet.json["config"]["model"] == {"name": "llama3", "flavor": flavor}


def test_a_torchtitan_flavor_imports_and_exports_with_its_scaling(write):
    """torchtitan's own 8B recipe (train_configs/llama3_8b.toml at db6b39acd, copied verbatim
    into tests/data/interop/, `flavor = "8B"` line 20) imports as llama-3.1-8b, whose RoPE
    scaling is the flavor's: the job exports back to the same flavor without a note, and `run`
    of it encodes positions as torchtitan does."""
    path = DATA / "interop" / "torchtitan_llama3_8b_2024-09.toml"
    job = write("job.toml", "")
    imported = run_cli("import", str(path), "--world", "8", "-o", job)
    assert imported.code == 0, imported.err
    assert load_job(job, env={}).job.model.preset == "llama-3.1-8b"
    assert load_job(job, env={}).shape.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    back = run_cli("export", job, "--to", "torchtitan", "--json")
    assert back.code == 0 and back.json["config"]["model"] == {"name": "llama3", "flavor": "8B"}
    assert not [n for n in back.json["notes"] if n["path"] == "model.rope_scaling"]


def test_an_unknown_key_of_the_scaling_table_is_named_with_its_table(write):
    """A key of `[model.rope_scaling]` that is not one of its own gets the table's keys or
    the nearest of them, as every table's unknown key does (io/problems.py)."""
    table = ('[model]\npreset = "llama-3.1-405b"\n[model.rope_scaling]\nrope_type = "llama3"\nfactor = 8.0\n'
             'low_freq_factor = 1.0\nhigh_freq_factor = 4.0\noriginal_max_position_embeddings = 8192\n')
    result = run_cli("validate", write("job.toml", table + "factr = 8.0\n"))
    assert result.code == 2 and result.err_lines[0].endswith(
        "model.rope_scaling.factr: unknown key (did you mean 'factor'?)"), result.err
    result = run_cli("validate", write("job2.toml", table + "beta_fast = 32\n"))
    assert result.err_lines[0].endswith("model.rope_scaling.beta_fast: unknown key (known: rope_type, factor, "
                                        "low_freq_factor, high_freq_factor, original_max_position_embeddings)")
