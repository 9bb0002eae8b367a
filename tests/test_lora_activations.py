"""Saved activations under LoRA, measured with autograd's saved-tensor hooks on the model `run`
builds (peft adapters, frozen bf16 base, one process), against the estimate's terms."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("peft")

from shardplan.core.activations import ActivationShape, head_terms, stored_layer_terms  # noqa: E402
from shardplan.core.lora import LoraPlan  # noqa: E402
from shardplan.runtime.lora import add_adapters, store_base  # noqa: E402
from shardplan.runtime.measure import SavedTensorTracker  # noqa: E402
from shardplan.runtime.model import Transformer, loss_fn, materialize  # noqa: E402
from shardplan.spec.job import LoraSpec  # noqa: E402
from shardplan.spec.model import resolve_shape  # noqa: E402

BATCH, SEQ = 4, 64
SHAPES = {
    "llama": dict(family="llama", num_layers=3, hidden_size=256, num_heads=4, num_kv_heads=2, ffn_hidden_size=512,
                  vocab_size=512, max_seq_len=128),
    "gpt2": dict(family="gpt2", num_layers=3, hidden_size=256, num_heads=4, vocab_size=512, max_seq_len=128),
}
CASES = [
    ("llama", ["q_proj", "k_proj", "v_proj", "o_proj"], 0.0),
    ("llama", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 0.1),
    ("llama", ["gate_proj", "up_proj", "down_proj"], 0.0),
    ("llama", ["o_proj"], 0.0),  # the first layer's attention keeps nothing
    ("llama", ["q_proj", "v_proj", "down_proj"], 0.1),
    ("gpt2", ["q_proj", "v_proj", "up_proj", "down_proj"], 0.0),
]
TOLERANCE = 0.05  # as the runs: RoPE's cos/sin casts and RMSNorm's fp32 1/rms are not counted


def measured(shape, spec: LoraSpec) -> int:
    with torch.device("meta"):
        model = Transformer(shape)
    add_adapters(model, spec)
    materialize(model, seed=3)
    for block in model.layers.values():
        store_base(block, spec, in_layers=True)
    for name, child in model.named_children():
        if name != "layers":
            store_base(child, spec, in_layers=False)
    model.to(torch.bfloat16)
    tracker = SavedTensorTracker(list(model.parameters()))
    tokens = torch.randint(0, shape.vocab_size, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    with tracker.tracking():
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    return tracker.peak


def estimated(shape, plan: LoraPlan) -> tuple[int, int]:
    """(bytes as on a GPU, bytes as on this CPU): torch's CPU dropout keeps its noise in the
    input's dtype instead of a 1-byte mask (aten/src/ATen/native/Dropout.cpp: the fused
    native_dropout only for accelerators), one more byte per masked element here."""
    act = ActivationShape(shape, BATCH, SEQ, act_bytes=2, lora=plan)
    first = stored_layer_terms(act, grad_in=False)
    other = stored_layer_terms(act)
    terms = first + other * (shape.num_layers - 1) + head_terms(act)
    gpu = sum(t.bytes for t in terms)
    masks = sum(t.bytes for t in terms if "dropout mask" in t.label)
    return gpu, gpu + masks * (act.act_bytes - 1)


@pytest.mark.parametrize("model, targets, dropout", CASES, ids=[f"{m}-{'-'.join(t)}-{d}" for m, t, d in CASES])
def test_saved_activations_match(model, targets, dropout):
    shape, problems = resolve_shape(SHAPES[model])
    assert not problems
    wanted = [t for t in targets if shape.gated or t != "gate_proj"]
    spec = LoraSpec(rank=8, alpha=16, dropout=dropout, targets=wanted)
    plan = LoraPlan(rank=8, targets=tuple(wanted), dropout=dropout > 0)
    got = measured(shape, spec)
    _, on_cpu = estimated(shape, plan)
    assert abs(got - on_cpu) / got <= TOLERANCE, (got, on_cpu)


def test_frozen_base_saves_less_than_full_training():
    """The same model trained fully keeps the frozen linears' inputs, the head input and the
    token ids on top: LoRA's estimate is below the full one's."""
    shape, _ = resolve_shape(SHAPES["llama"])
    full = ActivationShape(shape, BATCH, SEQ, act_bytes=2)
    lora = ActivationShape(shape, BATCH, SEQ, act_bytes=2, lora=LoraPlan(rank=8, targets=("q_proj", "v_proj")))
    assert sum(t.bytes for t in stored_layer_terms(lora)) < sum(t.bytes for t in stored_layer_terms(full))
