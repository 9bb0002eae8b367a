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
