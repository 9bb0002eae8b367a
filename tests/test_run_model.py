"""The model `shardplan run` builds has exactly the parameters the planner counts."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from shardplan.core.params import count_params, model_params  # noqa: E402
from shardplan.runtime.model import Transformer  # noqa: E402
from shardplan.spec.model import resolve_shape  # noqa: E402

TINY = dict(num_layers=2, hidden_size=48, num_heads=6, num_kv_heads=2, ffn_hidden_size=40, vocab_size=101,
            max_seq_len=32)
FAMILIES = {
    "gpt2": dict(family="gpt2", num_kv_heads=6, ffn_hidden_size=None),
    "llama": dict(family="llama"),
    "llama-tied-biased": dict(family="llama", tie_embeddings=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "mistral": dict(family="mistral"),
    "qwen2": dict(family="qwen2"),
    "gemma": dict(family="gemma", head_dim=16),
    "phi3": dict(family="phi3"),
}


def build(changes: dict):
    table = {**TINY, **{k: v for k, v in changes.items() if v is not None}}
    if changes.get("ffn_hidden_size", 1) is None:
        table.pop("ffn_hidden_size")
    shape, problems = resolve_shape(table)
    assert not problems
    return shape, Transformer(shape)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_names_shapes_and_count_match_the_planner(name):
    shape, model = build(FAMILIES[name])
    built = {n: tuple(p.shape) for n, p in model.named_parameters()}
    planned = {p.name: p.shape for p in model_params(shape)}
    assert built == planned
    assert sum(p.numel() for p in model.parameters()) == count_params(shape).total


@pytest.mark.parametrize("changes, words", [
    (dict(family="mixtral", num_experts=4), "mixture-of-experts"),
    (dict(family="falcon", num_kv_heads=1, ffn_hidden_size=None), "Falcon"),
])
def test_unbuilt_structures_are_refused(changes, words):
    with pytest.raises(ValueError, match=words):
        build(changes)


def test_forward_gives_logits():
    shape, model = build(FAMILIES["llama"])
    tokens = torch.randint(0, shape.vocab_size, (2, 16))
    assert model(tokens).shape == (2, 16, shape.vocab_size)


def test_large_tensors_are_drawn_in_chunks_alike_on_any_thread_count():
    """runtime/model.py draws a tensor above DRAW_CHUNK elements a chunk at a time, each chunk
    from its own generator, on the process's torch threads: the values depend on the seed and
    shape alone (not on the threads that drew them), follow normal(0, INIT_STD), differ from
    chunk to chunk, and a tensor at or below the chunk draws what one generator gives."""
    from shardplan.runtime.model import DRAW_CHUNK, INIT_STD, _drawn_in_chunks, _name_seed, init_parameter

    shape = (3, DRAW_CHUNK // 2 + 5)  # a chunk and a half, the last chunk short
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _drawn_in_chunks(shape, 7)
        torch.set_num_threads(2)
        two = _drawn_in_chunks(shape, 7)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert abs(one.mean().item()) < 1e-4 and one.std().item() == pytest.approx(INIT_STD, rel=1e-3)
    flat = one.view(-1)
    assert not torch.equal(flat[:1000], flat[DRAW_CHUNK:DRAW_CHUNK + 1000])
    assert not torch.equal(one, _drawn_in_chunks(shape, 8))
    small = torch.empty(64, 64)
    init_parameter(small, "layers.0.attn.q_proj.weight", 3)
    generator = torch.Generator().manual_seed(_name_seed(3, "layers.0.attn.q_proj.weight"))
    assert torch.equal(small, torch.randn(64, 64, generator=generator) * INIT_STD)
    large = torch.empty(shape)
    init_parameter(large, "layers.0.mlp.up_proj.weight", 3)
    assert torch.equal(large, _drawn_in_chunks(shape, _name_seed(3, "layers.0.mlp.up_proj.weight")))


def test_rotary_tables_take_the_models_base():
    """The rotary tables are the model's `rope_theta` (Su et al. 2021: inv_freq = theta^(-2i/d)),
    10,000 when it gives none: position 1's angle on channel pair i is theta^(-2i/d)."""
    for theta in (None, 500000.0):
        _, model = build({**FAMILIES["llama"], "rope_theta": theta})
        rope = next(m for m in model.modules() if m.__class__.__name__ == "RotaryEmbedding")
        head_dim = TINY["hidden_size"] // TINY["num_heads"]
        base = theta or 10000.0
        expected = torch.tensor([base ** (-2 * i / head_dim) for i in range(head_dim // 2)])
        assert torch.allclose(rope.cos[1], expected.cos(), atol=1e-6), theta
