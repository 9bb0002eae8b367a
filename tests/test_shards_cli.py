"""`shardplan shards`: CONTRACT JSON for --numel, --blocks and a model; tables; bad input."""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.params import count_params, model_params
from shardplan.spec.model import resolve_shape


def test_numel_contract():
    result = run_cli("shards", "--numel", "10", "--world", "4", "--style", "even", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert list(doc)[:5] == ["schema_version", "numel", "world", "style", "chunk"]
    assert (doc["numel"], doc["world"], doc["style"]) == (10, 4, "even")
    assert doc["shards"] == [
        {"rank": 0, "start": 0, "end": 3, "padding": 0}, {"rank": 1, "start": 3, "end": 6, "padding": 0},
        {"rank": 2, "start": 6, "end": 8, "padding": 0}, {"rank": 3, "start": 8, "end": 10, "padding": 0},
    ]


@pytest.mark.parametrize("style, expected, padded", [
    ("fsdp1", [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 5, 2)], 8),
    ("fsdp2", [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 5, 2)], 8),
    ("zero3", [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 5, 2)], 8),
    ("zero12", [(0, 2, 0), (2, 4, 0), (4, 5, 1), (5, 5, 2)], 8),
])
def test_numel_styles(style, expected, padded):
    doc = run_cli("shards", "--numel", "5", "--world", "4", "--style", style, "--json").json
    assert [(s["start"], s["end"], s["padding"]) for s in doc["shards"]] == expected
    assert doc["padded_numel"] == padded


def test_zero12_pads_to_twice_the_world():
    doc = run_cli("shards", "--numel", "9", "--world", "2", "--style", "zero12", "--json").json
    assert doc["padded_numel"] == 12 and doc["chunk"] == 6  # 9 -> multiple of 2 * 2


def test_default_world_and_style_come_from_the_job(write):
    doc = run_cli("shards", "--numel", "100", "--dp", "4", "--cp", "2", "--tp", "2", "--json").json
    assert (doc["world"], doc["style"]) == (8, "fsdp2")  # dp * cp; tp does not shard ZeRO state
    job = write("job.toml", "[parallel]\ndp = 4\n[zero]\nstage = 1\nframework = \"deepspeed\"\n")
    assert run_cli("shards", job, "--numel", "7", "--json").json["style"] == "zero12"
    job3 = write("job3.toml", "[parallel]\ndp = 4\n[zero]\nstage = 3\nframework = \"deepspeed\"\n")
    assert run_cli("shards", job3, "--numel", "7", "--json").json["style"] == "zero3"


def test_stage_1_under_fsdp2_shows_what_estimate_counts():
    """FSDP2's stage 1 is DDP with ZeroRedundancyOptimizer: `shards` shows the whole parameters
    each rank's optimizer holds (torch's partition, tests/test_shards_torch.py), and the
    estimate's optimizer bytes are the fullest rank's (docs/estimate.md): AdamW's two fp32
    moments per element and a 4-byte `step` tensor per parameter (torch/optim/adamw.py
    `_init_group`). Here rank 1 holds two tensors more than rank 0."""
    doc = run_cli("shards", "tiny-gpt2-cpu", "--set", "zero.stage=1", "--json").json
    assert doc["assign"] == "zero-optimizer" and "ZeroRedundancyOptimizer" in doc["note"]
    per_rank = {}
    for block in doc["blocks"]:
        elements, tensors = per_rank.get(block["owner"], (0, 0))
        per_rank[block["owner"]] = (elements + block["numel"], tensors + 1)
    assert len(per_rank) == doc["world"] == 2
    estimate = run_cli("estimate", "tiny-gpt2-cpu", "--set", "zero.stage=1", "--json").json
    held = {rank: 8 * elements + 4 * tensors for rank, (elements, tensors) in per_rank.items()}
    assert held[1] > held[0] and estimate["devices"][0]["gpu"]["optimizer"] == held[1]
    text = run_cli("shards", "tiny-gpt2-cpu", "--set", "zero.stage=1").out
    assert "owned zero-optimizer over 2 ranks" in text and text.rstrip().splitlines()[-1].startswith("note: ")
    # An explicit style still cuts the tensors as asked.
    assert run_cli("shards", "tiny-gpt2-cpu", "--set", "zero.stage=1", "--style", "fsdp2", "--json").json.get("note") is None


def test_deepspeed_stage_1_and_2_say_what_the_flat_partition_holds(write):
    job = write("job.toml", "[model]\npreset = \"tiny-gpt2\"\n[parallel]\ndp = 4\n[zero]\nstage = 1\nframework = \"deepspeed\"\n")
    doc = run_cli("shards", job, "--json").json
    assert doc["style"] == "zero12" and "16-bit parameters whole" in doc["note"]
    assert "gradients" in run_cli("shards", job, "--set", "zero.stage=2", "--json").json["note"]
    assert "note" not in run_cli("shards", job, "--set", "zero.stage=3", "--json").json


def test_stage_0_shards_nothing():
    doc = run_cli("shards", "tiny-gpt2-cpu", "--set", "zero.stage=0", "--json").json
    assert doc["world"] == 1 and "shards nothing" in doc["note"]
    whole = {p["name"]: p["shards"] for p in doc["params"]}
    assert all(s[0]["start"] == 0 and s[0]["padding"] == 0 for s in whole.values())
    asked = run_cli("shards", "tiny-gpt2-cpu", "--set", "zero.stage=0", "--world", "2", "--json").json
    assert asked["world"] == 2 and "note" not in asked


def test_hybrid_sharding_world_is_the_node_local_group(write):
    job = write("job.toml", "[parallel]\ndp = 16\n[zero]\nstage = 3\nhybrid = true\n[cluster]\nnodes = 2\n")
    assert run_cli("shards", job, "--numel", "100", "--json").json["world"] == 8


def test_blocks_document():
    doc = run_cli("shards", "--blocks", "5", "--assign", "round-robin", "--world", "2", "--json").json
    assert doc["blocks"] == [{"block": i, "owner": i % 2} for i in range(5)]
    assert doc["ranks"] == [
        {"rank": 0, "num_blocks": 3, "fraction": 0.6}, {"rank": 1, "num_blocks": 2, "fraction": 0.4},
    ]
    doc = run_cli("shards", "--blocks", "5", "--assign", "contiguous", "--world", "2", "--json").json
    assert [b["owner"] for b in doc["blocks"]] == [0, 0, 0, 1, 1]


def test_model_document_tiny_gpt2():
    result = run_cli("shards", "tiny-gpt2-cpu", "--world", "3", "--json")
    assert result.code == 0, result.err
    doc = result.json
    assert (doc["model"], doc["style"], doc["world"], doc["element_bytes"]) == ("tiny-gpt2", "fsdp2", 3, 4)
    embed = doc["params"][0]
    assert embed["name"] == "embed.weight" and embed["shape"] == [512, 128]
    assert [s["rows"] for s in embed["shards"]] == [171, 171, 170]  # torch.chunk of 512 rows
    assert embed["shards"][2] == {"rank": 2, "start": 342 * 128, "end": 512 * 128, "padding": 128, "rows": 170,
                                  "bytes": 171 * 128 * 4}  # padding stored too, in fp32
    total = count_params(resolve_shape({"family": "gpt2", "num_layers": 4, "hidden_size": 128, "num_heads": 4,
                                        "vocab_size": 512, "max_seq_len": 256})[0]).total
    assert sum(r["numel"] for r in doc["ranks"]) == total
    assert all(r["bytes"] == 4 * (r["numel"] + r["padding"]) for r in doc["ranks"])
    assert doc["flat_buffers"] == []


def test_model_default_world_is_dp_and_tp_pieces(write):
    job = write("job.toml", "[model]\npreset = \"tiny-llama\"\n[parallel]\ndp = 2\ntp = 2\n[zero]\nstage = 3\n")
    doc = run_cli("shards", job, "--json").json
    assert (doc["world"], doc["tp"]) == (2, 2)
    q = next(p for p in doc["params"] if p["name"] == "layers.0.attn.q_proj.weight")
    assert (q["shape"], q["local_shape"]) == ([128, 128], [64, 128])  # column-parallel: dim 0 / tp
    o = next(p for p in doc["params"] if p["name"] == "layers.0.attn.o_proj.weight")
    assert o["local_shape"] == [128, 64]  # row-parallel: dim 1 / tp, FSDP still cuts dim 0


def test_model_pipeline_stages(write):
    job = write("job.toml", "[model]\npreset = \"tiny-llama\"\n[parallel]\ndp = 2\npp = 2\nnum_microbatches = 2\n")
    doc = run_cli("shards", job, "--style", "zero12", "--json").json
    # One flat buffer per optimizer group of each stage: matrices, then vectors (DeepSpeed
    # flattens each param group on its own, deepspeed/runtime/zero/stage_1_and_2.py 423-446).
    assert [(b["name"], b["stage"], b["group"]) for b in doc["flat_buffers"]] == [
        ("flat.stage0.group0", 0, 0), ("flat.stage0.group1", 0, 1),
        ("flat.stage1.group0", 1, 0), ("flat.stage1.group1", 1, 1),
    ]
    assert {(r["stage"], r["rank"]) for r in doc["ranks"]} == {(0, 0), (0, 1), (1, 0), (1, 1)}


def test_model_round_robin_params():
    doc = run_cli("shards", "tiny-gpt2-cpu", "--assign", "round-robin", "--world", "3", "--json").json
    names = [p.name for p in model_params(resolve_shape({"family": "gpt2", "num_layers": 4, "hidden_size": 128,
                                                         "num_heads": 4, "vocab_size": 512, "max_seq_len": 256})[0])]
    assert [b["name"] for b in doc["blocks"]] == names
    assert [b["owner"] for b in doc["blocks"]] == [i % 3 for i in range(len(names))]
    weights = [sum(b["bytes"] for b in doc["blocks"] if b["owner"] == r) for r in range(3)]
    assert [r["bytes"] for r in doc["ranks"]] == weights
    assert [r["fraction"] for r in doc["ranks"]] == [w / sum(weights) for w in weights]


def test_tables():
    out = run_cli("shards", "--numel", "10", "--world", "4", "--style", "fsdp2").out
    assert "fsdp2: 10 elements over 4 ranks; each stores 3 (stored 12, padding 2 = 16.7%)" in out
    assert out.splitlines()[-1].split() == ["3", "9", "10", "1", "2"]
    out = run_cli("shards", "tiny-gpt2-cpu", "--world", "3").out
    assert "embed.weight                   512x128  r0-1: 171, r2: 170   r0-1: 0, r2: 1" in out
    assert "layers 1..3 the same as layer 0" in out
    assert "layers.1.attn" not in out
    out = run_cli("shards", "tiny-gpt2-cpu", "--world", "4", "--style", "fsdp1").out
    assert "flat parameters (padding sits at the end of each)" in out
    out = run_cli("shards", "--blocks", "10", "--assign", "round-robin", "--world", "4").out
    assert "0, 4, 8" in out and "30.0%" in out


def test_big_world_table_is_elided():
    out = run_cli("shards", "--numel", "1000000", "--world", "512").out
    assert len(out.splitlines()) < 20 and "..." in out


@pytest.mark.parametrize("args, needle", [
    (["--numel", "10", "--world", "0"], "--world"),
    (["--numel", "-1", "--world", "2"], "--numel"),
    (["--numel", "10", "--world", "4", "--style", "fsdp3"], "--style: unknown style 'fsdp3'"),
    (["--blocks", "4", "--world", "2"], "--blocks: needs --assign"),
    (["--blocks", "4", "--assign", "random", "--world", "2"], "--assign: unknown assignment 'random'"),
    (["--blocks", "0", "--assign", "contiguous"], "--blocks"),
    (["--numel", "4", "--blocks", "2", "--assign", "contiguous"], "--numel: cannot be combined"),
    (["--world", "4"], "nothing to shard: no model"),
    (["--params", "7B", "--world", "4"], "nothing to shard: a bare parameter count"),
    (["tiny-gpt2-cpu", "--assign", "round-robin", "--style", "fsdp2"], "--assign: assigns whole blocks"),
    (["--numel", "10", "--world", "99999999999"], "--world"),
    (["no-such-job", "--numel", "3"], "no such file or job preset"),
    (["--numel", "10", "--dp", "0"], "parallel.dp: must be >= 1"),
])
def test_bad_input(args, needle):
    result = run_cli("shards", *args)
    assert result.code == 2, (result.out, result.err)
    assert "Traceback" not in result.err
    assert any(needle in line for line in result.err_lines), result.err
    assert result.out == ""


def test_numel_takes_the_count_conventions():
    """`--numel` reads counts as every count flag does (README: 7.5B, 124M, 1T, 7.5e9)."""
    written = run_cli("shards", "--numel", "7.5B", "--world", "4", "--json")
    digits = run_cli("shards", "--numel", "7500000000", "--world", "4", "--json")
    assert written.code == digits.code == 0 and written.json == digits.json
    bad = run_cli("shards", "--numel", "7.5X", "--world", "4")
    assert bad.code == 2 and bad.err_lines == ["--numel: unknown suffix 'X' in '7.5X' (known: K, M, B, T)"]
