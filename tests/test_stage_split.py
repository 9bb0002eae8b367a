"""Uneven pipeline stages: `parallel.first_stage_layers` / `last_stage_layers` (CONTRACT).

References: Megatron-LM's `--decoder-first-pipeline-num-layers` and
`--decoder-last-pipeline-num-layers` (megatron/core/transformer/transformer_block.py,
`get_num_layers_to_build`: the first and last stage get exactly that many, the middle stages
share the rest); Llama 3 405B (Dubey et al. 2024, "The Llama 3 Herd of Models", section
3.3.2: 126 layers on 16 stages, one layer fewer on the first and on the last stage).
"""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import run_cli
from shardplan.core.pipeline import split_layers, split_problem
from shardplan.core.stages import rank_chunks


def test_llama3_405b_split():
    # Dubey et al. 2024, section 3.3.2: 16 stages, the first and the last with one layer
    # fewer than the 8 of the others (126 = 7 + 14 * 8 + 7).
    assert split_layers(126, 16, first=7, last=7) == [7] + [8] * 14 + [7]


def test_megatron_first_last_example():
    # Megatron-LM's rule: first and last fixed, the middle even: 32 layers, 4 stages,
    # first 6, last 6 -> the two middle stages take 10 each.
    assert split_layers(32, 4, first=6, last=6) == [6, 10, 10, 6]
    assert split_layers(32, 4, first=5) == [5, 9, 9, 9]
    assert split_layers(32, 4, last=2) == [10, 10, 10, 2]


@given(layers=st.integers(2, 200), stages=st.integers(2, 32), first=st.integers(0, 40), last=st.integers(0, 40))
def test_split_covers_every_layer_once(layers, stages, first, last):
    problem = split_problem(layers, stages, first, last)
    if problem:
        with pytest.raises(ValueError):
            split_layers(layers, stages, first, last)
        return
    counts = split_layers(layers, stages, first, last)
    assert sum(counts) == layers and len(counts) == stages and min(counts) >= 1
    if first:
        assert counts[0] == first
    if last:
        assert counts[-1] == last
    middle = [c for i, c in enumerate(counts) if not ((i == 0 and first) or (i == stages - 1 and last))]
    assert max(middle, default=0) - min(middle, default=0) <= 1


def test_loop_placement_uses_the_split():
    # 2 pipeline ranks x 2 virtual stages; stage 0 has 2 layers, the last (stage 3) has 2.
    assert [list(r) for r in rank_chunks(10, 2, 2, 0, (2, 2))] == [[0, 1], [5, 6, 7]]
    assert [list(r) for r in rank_chunks(10, 2, 2, 1, (2, 2))] == [[2, 3, 4], [8, 9]]


def test_estimate_and_shards_follow_the_split():
    args = ["--set", "model.preset=llama-2-7b", "--pp", "4", "--set", "parallel.num_microbatches=4",
            "--set", "parallel.first_stage_layers=5", "--set", "parallel.last_stage_layers=6"]
    estimate = run_cli("estimate", *args, "--json")
    assert estimate.code == 0, estimate.err
    # 32 layers: 5 + 6 fixed, 21 over the two middle stages -> 11, 10
    assert [d["layers"] for d in estimate.json["devices"]] == [5, 11, 10, 6]
    shards = run_cli("shards", *args, "--json")
    assert shards.code == 0, shards.err
    layers_of = {}
    for param in shards.json["params"]:
        if ".layers." in f".{param['name']}" and param["name"].endswith("attn_norm.weight"):
            layers_of[param["stage"]] = layers_of.get(param["stage"], 0) + 1
    assert layers_of == {0: 5, 1: 11, 2: 10, 3: 6}


@pytest.mark.parametrize("sets, message", [
    (["parallel.first_stage_layers=2"], "parallel.first_stage_layers: first_stage_layers / last_stage_layers need "
                                        "more than one pipeline stage"),
    (["parallel.pp=2", "parallel.num_microbatches=2", "parallel.first_stage_layers=20", "parallel.last_stage_layers=20"],
     "parallel.first_stage_layers: first 20 + last 20 = 40 layers on the 2 stages, but the model has 32"),
    (["parallel.pp=4", "parallel.num_microbatches=4", "parallel.last_stage_layers=31"],
     "parallel.last_stage_layers: last 31 leave 1 of 32 layers for the other 3 stages, which need at least one each"),
])
def test_impossible_splits_are_refused(sets, message):
    args = ["validate", "llama-3-8b-h100", "--world", "1", "--set", "parallel.dp=1"]
    for item in sets:
        args += ["--set", item]
    world = 1
    for item in sets:
        if item.startswith("parallel.pp="):
            world = int(item.split("=")[1])
    args[3] = str(world)
    result = run_cli(*args)
    assert result.code == 2
    assert any(message in line for line in result.err_lines), result.err


def test_global_batch_must_be_what_the_plan_makes():
    result = run_cli("validate", "llama-3-8b-h100", "--set", "train.global_batch_size=64")
    assert result.code == 2
    assert ("train.global_batch_size: 64 != dp (8) * micro_batch_size (1) * num_microbatches (1) = 8; "
            "num_microbatches = 8 would make it") in result.err
    ok = run_cli("validate", "llama-3-8b-h100", "--set", "train.global_batch_size=64",
                 "--set", "parallel.num_microbatches=8")
    assert ok.code == 0, ok.err


def test_lora_targets_the_model_has():
    result = run_cli("estimate", "--set", "model.preset=gpt2", "--set", 'lora.targets=["q_proj", "gate_proj"]')
    assert result.code == 2
    assert "lora.targets: 'gate_proj': the gpt2 MLP has no gate projection" in result.err
    bare = run_cli("estimate", "--params", "7B", "--set", "lora.rank=8")
    assert bare.code == 2 and "lora: LoRA needs the model's architecture" in bare.err
    ok = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--set", 'lora.targets=["q_proj", "gate_proj"]')
    assert ok.code == 0, ok.err
