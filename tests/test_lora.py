"""LoRA parameter counts and names against peft's on the model `shardplan run` builds."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")

from shardplan.core.lora import LoraPlan, adapter_params, lora_counts  # noqa: E402
from shardplan.core.params import layer_params  # noqa: E402
from shardplan.core.stages import rank_params  # noqa: E402
from shardplan.runtime.model import Transformer  # noqa: E402
from shardplan.spec.model import resolve_shape  # noqa: E402

TINY = dict(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2, ffn_hidden_size=40, vocab_size=101,
            max_seq_len=32)
MODELS = {
    "llama": dict(family="llama"),
    "llama-biased-tied": dict(family="llama", tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "gpt2": dict(family="gpt2", num_kv_heads=6, ffn_hidden_size=None),
}
TARGET_SETS = {
    "attention": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "q-v": ["q_proj", "v_proj"],
    "all-linear": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "mlp": ["gate_proj", "up_proj", "down_proj"],
    "down": ["down_proj"],
}


def shape_of(changes: dict):
    table = {**TINY, **{k: v for k, v in changes.items() if v is not None}}
    if changes.get("ffn_hidden_size", 1) is None:
        table.pop("ffn_hidden_size")
    shape, problems = resolve_shape(table)
    assert not problems
    return shape


@pytest.mark.parametrize("targets", sorted(TARGET_SETS))
@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("rank", [1, 8])
def test_counts_and_names_equal_peft(model, targets, rank):
    shape = shape_of(MODELS[model])
    wanted = [t for t in TARGET_SETS[targets] if shape.gated or t != "gate_proj"]
    plan = LoraPlan(rank=rank, targets=tuple(wanted))
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=wanted, bias="none")
    wrapped = peft.get_peft_model(Transformer(shape), config)
    trainable, total = wrapped.get_nb_trainable_parameters()  # peft's own count
    counts = lora_counts(shape, plan)
    assert (counts.trainable, counts.total) == (trainable, total)
    # Names and shapes of one layer's adapters, as peft injects them.
    built = {n.removeprefix("base_model.model."): tuple(p.shape) for n, p in wrapped.named_parameters()
             if p.requires_grad and n.startswith("base_model.model.layers.0.")}
    planned = {p.name: p.shape for p in adapter_params(layer_params(shape, 0), plan)}
    assert built == planned


def test_tensor_parallel_splits_adapters_with_their_linears():
    """Megatron placement: B of a column-parallel linear and A of a row-parallel one are split,
    the other whole; over tp ranks the adapters add up to the whole once per replica."""
    shape = shape_of(MODELS["llama"])
    plan = LoraPlan(rank=4, targets=tuple(TARGET_SETS["all-linear"]))
    whole = {p.name: p.numel for p in adapter_params(layer_params(shape, 0), plan)}
    tp = 2
    pieces = [rank_params(shape, 1, 1, 0, tp, r, lora=plan).adapters for r in range(tp)]
    for name, numel in whole.items():
        local = [next(p for p in rank if p.info.name == name) for rank in pieces]
        split = name.endswith(("q_proj.lora_B.default.weight", "k_proj.lora_B.default.weight",
                               "v_proj.lora_B.default.weight", "gate_proj.lora_B.default.weight",
                               "up_proj.lora_B.default.weight", "o_proj.lora_A.default.weight",
                               "down_proj.lora_A.default.weight"))
        assert sum(p.numel for p in local) == (numel if split else tp * numel), name


# peft's target_modules="all-linear" on Hugging Face's own models (transformers 5.23.0,
# peft 0.21.2), against `lora.targets = "all-linear"`: equal where HF keeps the projections
# apart (Llama); where HF fuses them, peft's fused adapter shares one A, so peft counts fewer by
# r * h per extra input (docs/job-file.md): Phi-3 qkv_proj (2 r h) and gate_up_proj (r h),
# GPT-2 c_attn (2 r h), Falcon query_key_value (2 r h), per layer.
HF_TINY = {
    "llama": ("LlamaConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, vocab_size=128), 0),
    "phi3": ("Phi3Config", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                intermediate_size=96, vocab_size=128, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2), 3),
    "gpt2": ("GPT2Config", dict(n_layer=2, n_embd=64, n_head=4, vocab_size=128, bos_token_id=0, eos_token_id=0), 2),
    "falcon": ("FalconConfig", dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128), 2),
}


@pytest.mark.parametrize("model_type", sorted(HF_TINY))
def test_all_linear_against_peft_on_the_hf_model(model_type, tmp_path):
    import json

    from conftest import run_cli

    transformers = pytest.importorskip("transformers")
    class_name, keys, shared_inputs = HF_TINY[model_type]
    rank = 4
    config = getattr(transformers, class_name)(**keys)
    model = transformers.AutoModelForCausalLM.from_config(config)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules="all-linear"))
    peft_trainable, _ = wrapped.get_nb_trainable_parameters()
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": model_type, **keys}), encoding="utf-8")
    result = run_cli("estimate", str(path), "--set", f"lora.rank={rank}", "--set", 'lora.targets="all-linear"',
                     "--json")
    assert result.code == 0, result.err
    ours = result.json["params"]["trainable"]
    layers, hidden = config.num_hidden_layers, config.hidden_size
    assert ours - peft_trainable == shared_inputs * rank * hidden * layers


def test_all_linear_is_every_layer_linear_the_model_has():
    from shardplan.spec.job import LoraSpec

    llama, gpt2 = shape_of(MODELS["llama"]), shape_of(MODELS["gpt2"])
    for given in ("all-linear", ["all-linear"], ["all-linear", "q_proj"]):
        spec = LoraSpec.model_validate({"targets": given})
        assert spec.for_model(llama).targets == TARGET_SETS["all-linear"]
        assert spec.for_model(gpt2).targets == [t for t in TARGET_SETS["all-linear"] if t != "gate_proj"]
    listed = LoraSpec.model_validate({"targets": ["q_proj", "v_proj"]})
    assert listed.for_model(llama) is listed


@pytest.mark.parametrize("name,hint", [
    ("qkv_proj", "'qkv_proj' is Phi-3's fused q/k/v: give q_proj, k_proj, v_proj"),
    ("gate_up_proj", "'gate_up_proj' is Phi-3's fused gate/up: give gate_proj, up_proj"),
    ("c_attn", "'c_attn' is GPT-2's fused q/k/v: give q_proj, k_proj, v_proj"),
    ("c_proj", "'c_proj' is GPT-2's attention output and MLP output: give o_proj, down_proj"),
    ("query_key_value", "'query_key_value' is Falcon's fused q/k/v: give q_proj, k_proj, v_proj"),
    ("w1", "'w1' is Mixtral's expert gate projection: give gate_proj"),
    ("lm_head", "'lm_head' is the output head: shardplan puts adapters on layer linears only"),
])
def test_peft_names_of_fused_linears_get_the_unfused_names(name, hint):
    from conftest import run_cli

    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--set", f'lora.targets=["q_proj", "{name}"]')
    assert result.code == 2
    (line,) = result.err.strip().splitlines()
    assert line.startswith(f"--set: lora.targets.1: {hint}")
    assert "did you mean" not in line


def test_a_string_other_than_all_linear_is_one_clear_line():
    from conftest import run_cli

    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--set", 'lora.targets="q_proj"')
    assert result.code == 2
    assert result.err.strip() == ("--set: lora.targets: expected a list of linear names or 'all-linear', "
                                  "got a string 'q_proj'")


def test_rank_above_a_targets_min_dimension_warns():
    """Llama-3 8B (presets/models/llama-3-8b.toml: hidden 4096, 8 key/value heads of 128, so
    k_proj and v_proj are 1024 x 4096; MLP 14336): a rank over 1,024 exceeds min(in, out) of k
    and v, one over 4,096 that of every linear."""
    from shardplan.core.lora import rank_warning, ranks_above_full
    from shardplan.io.job import load_job

    shape = load_job(None, [("model.preset", "llama-3-8b")], env={}).shape
    attention = ("q_proj", "k_proj", "v_proj", "o_proj")
    assert ranks_above_full(shape, 1024, attention) == {}
    assert ranks_above_full(shape, 1025, attention) == {"k_proj": 1024, "v_proj": 1024}
    assert ranks_above_full(shape, 100_000, TARGET_SETS["all-linear"]) == {
        "q_proj": 4096, "k_proj": 1024, "v_proj": 1024, "o_proj": 4096, "gate_proj": 4096, "up_proj": 4096,
        "down_proj": 4096}
    assert rank_warning(shape, 16, attention) is None
    assert rank_warning(shape, 2000, attention).startswith("2,000 exceeds min(in, out) of k_proj (1,024), v_proj (1,024)")
