"""A model's shards per style: every element held once, padding where the framework puts it,
totals that add up; tensor-parallel pieces and pipeline placement as `estimate` sees them."""

from __future__ import annotations

from math import prod

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardplan.core.params import model_params
from shardplan.core.pipeline import stage_layers
from shardplan.core.shards import ceil_div, chunk_rows
from shardplan.core.shards_model import (
    FLAT_STYLES, PER_PARAM_STYLES, assign_params, model_shards, param_element_bytes, placed_params,
)
from shardplan.core.stages import rank_params
from shardplan.spec.errors import PlanError
from shardplan.spec.model import resolve_shape

STYLES = PER_PARAM_STYLES + FLAT_STYLES


def shape_of(**table):
    shape, problems = resolve_shape(table)
    assert not problems, problems
    return shape


TINY_GPT2 = shape_of(family="gpt2", num_layers=4, hidden_size=128, num_heads=4, vocab_size=512, max_seq_len=256)
TINY_MOE = shape_of(family="mixtral", num_layers=3, hidden_size=20, num_heads=4, num_kv_heads=1,
                    ffn_hidden_size=44, vocab_size=50, num_experts=2)


def check_plan(shape, world, style, tp=1, tp_rank=0, pp=1, element_bytes=4):
    placed = placed_params(shape, pp, 1, tp, tp_rank)
    plan = model_shards(placed, world, style, element_bytes)
    assert [p.name for p in plan.params] == [p.info.name for p in placed]
    for p in plan.params:
        # every element of the (tp-local) parameter is held by exactly one rank, in rank order
        covered = sorted((s.start, s.end) for s in p.shards if s.end > s.start)
        position = 0
        for start, end in covered:
            assert start == position
            position = end
        assert position == p.numel
        if style == "fsdp2":
            chunk = ceil_div(p.local_shape[0], world)
            assert sum(p.rows) == p.local_shape[0]
            row = prod(p.local_shape[1:])
            assert all(s.stored == chunk * row for s in p.shards)  # FSDP2 pads every rank to chunk rows
        if style == "zero3":
            assert all(s.stored == ceil_div(p.numel, world) for s in p.shards)
        if style in FLAT_STYLES:
            assert all(s.padding == 0 for s in p.shards)  # padding belongs to the flat buffer
    for buffer in plan.buffers:
        stored = {s.stored for s in buffer.shards}
        total = buffer.numel + sum(s.padding for s in buffer.shards)
        if style == "fsdp1":
            assert stored == {ceil_div(buffer.numel, world)} and total % world == 0
        if style == "zero12":
            assert total % (2 * world) == 0 and total - buffer.numel < 2 * world
        if style == "even":
            assert total == buffer.numel and max(stored) - min(stored) <= 1
    for stage in range(pp):
        stage_numel = sum(p.numel for p in plan.params if p.stage == stage)
        totals = [t for t in plan.totals if t.stage == stage]
        assert [t.rank for t in totals] == list(range(world))
        assert sum(t.numel for t in totals) == stage_numel
        assert all(t.stored_bytes == (t.numel + t.padding) * element_bytes for t in totals)
    return plan


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("world", [1, 2, 3, 7, 64])
def test_every_style_holds_everything_once(style, world):
    check_plan(TINY_GPT2, world, style)
    check_plan(TINY_MOE, world, style, tp=2, tp_rank=1, pp=3)


@settings(max_examples=40, deadline=None)
@given(
    layers=st.integers(1, 6), heads=st.sampled_from([1, 2, 4]), head_dim=st.integers(1, 9),
    vocab=st.integers(1, 300), world=st.integers(1, 40), style=st.sampled_from(STYLES),
    tp=st.sampled_from([1, 2, 3]), pp=st.integers(1, 3),
)
def test_random_models(layers, heads, head_dim, vocab, world, style, tp, pp):
    shape = shape_of(family="llama", num_layers=max(layers, pp), hidden_size=heads * head_dim, num_heads=heads,
                     ffn_hidden_size=3 * head_dim + 1, vocab_size=vocab)
    check_plan(shape, world, style, tp=tp, tp_rank=tp - 1, pp=pp)


def test_fsdp2_known_answer():
    """torch.chunk of 512 rows over 3 ranks: 171, 171, 170; every rank stores 171 rows."""
    plan = check_plan(TINY_GPT2, 3, "fsdp2")
    embed = plan.params[0]
    assert (embed.name, embed.rows) == ("embed.weight", (171, 171, 170))
    assert [(s.start, s.end, s.padding) for s in embed.shards] == [
        (0, 171 * 128, 0), (171 * 128, 342 * 128, 0), (342 * 128, 512 * 128, 128),
    ]
    router = next(p for p in check_plan(TINY_MOE, 3, "fsdp2").params if p.name.endswith("router.weight"))
    assert router.rows == (1, 1, 0)  # 2 experts over 3 ranks: the last rank holds only padding
    assert router.shards[2].start == router.shards[2].end == router.numel and router.shards[2].padding == 20


def test_fsdp1_units_are_blocks_and_root():
    plan = check_plan(TINY_GPT2, 4, "fsdp1")
    assert [b.name for b in plan.buffers] == ["root", "layers.0", "layers.1", "layers.2", "layers.3"]
    root = plan.buffers[0]
    assert root.num_params == 4  # embed, pos_embed, final_norm weight and bias (head tied)
    assert root.numel == 512 * 128 + 256 * 128 + 2 * 128


def test_zero12_one_buffer_per_optimizer_group_even_one_per_stage():
    """DeepSpeed ZeRO-1/2 flattens each optimizer parameter group of a stage on its own
    (deepspeed/runtime/zero/stage_1_and_2.py line 423, `for i, param_group in
    enumerate(self.optimizer.param_groups)`, lines 440-446 pad each to 2*dp): matrices, then
    vectors, as core/deepspeed.py `weight_decay_groups`. `even` keeps one buffer per stage."""
    plan = check_plan(TINY_GPT2, 4, "zero12", pp=2)
    assert [(b.name, b.stage, b.group) for b in plan.buffers] == [
        ("flat.stage0.group0", 0, 0), ("flat.stage0.group1", 0, 1),
        ("flat.stage1.group0", 1, 0), ("flat.stage1.group1", 1, 1),
    ]
    for buffer in plan.buffers:
        members = [p for p in plan.params if p.unit == buffer.name]
        assert all(p.group == buffer.group and p.stage == buffer.stage for p in members)
        assert all((len(p.local_shape) >= 2) == (buffer.group == 0) for p in members)
        assert sum(p.numel for p in members) == buffer.numel and len(members) == buffer.num_params
    assert [b.name for b in check_plan(TINY_GPT2, 4, "zero12").buffers] == ["flat.group0", "flat.group1"]
    assert [b.name for b in check_plan(TINY_GPT2, 4, "even").buffers] == ["flat"]
    single = model_shards(placed_params(TINY_GPT2), 4, "zero12", optimizer_groups=False)
    assert [(b.name, b.group) for b in single.buffers] == [("flat", None)]


def test_placed_params_agree_with_the_estimate():
    """Every stage's parameters and pieces are `stages.rank_params`' (what `estimate` counts)."""
    for shape, pp, virtual, tp in [(TINY_GPT2, 2, 1, 1), (TINY_GPT2, 2, 2, 2), (TINY_MOE, 3, 1, 2)]:
        placed = placed_params(shape, pp, virtual, tp)
        for stage in range(pp):
            held = rank_params(shape, pp, virtual, stage, tp, 0)
            mine = [p for p in placed if p.stage == stage]
            assert sum(prod(p.local_shape) for p in mine) == held.numel
            assert len([p for p in mine if p.info.layer is None]) == len(held.root)


def test_placement_known_answers():
    names = [(p.info.name, p.stage) for p in placed_params(TINY_GPT2, pp=2)]
    assert names[0] == ("embed.weight", 0) and names[-1] == ("lm_head.weight", 1)  # tied: the last stage's copy
    layer_stage = {p.info.layer: p.stage for p in placed_params(TINY_GPT2, pp=2) if p.info.layer is not None}
    expected = {layer: stage for stage, layers in enumerate(stage_layers(4, 2)) for layer in layers}
    assert layer_stage == expected
    # interleaved: 4 layers in 4 chunks on 2 ranks -> chunk c on rank c % 2
    layer_stage = {p.info.layer: p.stage for p in placed_params(TINY_GPT2, pp=2, virtual=2) if p.info.layer is not None}
    assert layer_stage == {0: 0, 1: 1, 2: 0, 3: 1}


def test_key_value_heads_replicated_when_tp_exceeds_them():
    """tp 4 over 2 key/value heads: every tp rank holds one whole head (validate warns)."""
    shape = shape_of(family="llama", num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2,
                     ffn_hidden_size=96, vocab_size=100)
    k = next(p for p in placed_params(shape, tp=4, tp_rank=3) if p.info.name == "layers.0.attn.k_proj.weight")
    assert k.local_shape == (16, 64)  # head_dim 16, not a torch.chunk piece of the 32 rows


def test_tensor_parallel_pieces_are_torch_chunk():
    for tp in (2, 3):
        for tp_rank in range(tp):
            for p in placed_params(TINY_GPT2, tp=tp, tp_rank=tp_rank):
                info = p.info
                if info.tp_dim is None:
                    assert p.local_shape == info.shape
                else:
                    expected = list(info.shape)
                    expected[info.tp_dim] = chunk_rows(info.shape[info.tp_dim], tp)[tp_rank]
                    assert p.local_shape == tuple(expected), info.name


def test_bad_placement():
    with pytest.raises(PlanError, match="cannot split 4 layers into 5 x 1"):
        placed_params(TINY_GPT2, pp=5)
    with pytest.raises(PlanError, match="tp rank 2 is out of range"):
        placed_params(TINY_GPT2, tp=2, tp_rank=2)


def test_min_numel_keeps_small_parameters_whole():
    plan = model_shards(placed_params(TINY_GPT2), 4, "fsdp2", min_numel=1000)
    bias = next(p for p in plan.params if p.name == "layers.0.attn.q_proj.bias")
    assert bias.replicated and all((s.start, s.end, s.padding) == (0, 128, 0) for s in bias.shards)
    assert not plan.params[0].replicated


def test_element_bytes():
    assert param_element_bytes("fp32", "fsdp2", "fsdp2") == 4
    assert param_element_bytes("bf16", "fsdp2", "fsdp2") == 2
    assert param_element_bytes("bf16-mixed", "fsdp2", "deepspeed") == 4  # FSDP keeps fp32 shards
    assert param_element_bytes("bf16-mixed", "zero3", "fsdp2") == 2  # DeepSpeed: 16-bit params
    assert param_element_bytes("fp16-mixed", "even", "deepspeed") == 2
    assert param_element_bytes("fp16-mixed", "even", "fsdp2") == 4


def test_totals_bytes():
    plan = check_plan(TINY_GPT2, 3, "fsdp2", element_bytes=2)  # pp = 1: the tied head is the embedding
    total = sum(prod(p.shape) for p in model_params(TINY_GPT2))
    assert sum(t.numel for t in plan.totals) == total
    assert all(t.stored_bytes == 2 * (t.numel + t.padding) for t in plan.totals)


def test_assign_params_per_stage_and_bytes_weighted():
    placed = placed_params(TINY_GPT2, pp=2)
    owned, shares = assign_params(placed, 3, "round-robin", element_bytes=2)
    for stage in (0, 1):
        mine = [o for o in owned if o.stage == stage]
        assert [o.owner for o in mine] == [i % 3 for i in range(len(mine))]  # restarts per stage
        stage_bytes = sum(o.stored_bytes for o in mine)
        for s_stage, share in shares:
            if s_stage == stage:
                assert share.weight == sum(o.stored_bytes for o in mine if o.owner == share.rank)
                assert share.fraction == share.weight / stage_bytes
    assert [o.name for o in owned] == [p.info.name for p in placed]  # stage 0 first, module order inside
