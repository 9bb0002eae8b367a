"""`shardplan shards` under LoRA / QLoRA: the frozen base stored as `run` stores it (bf16, or
torchao NF4 for the layer linears), the adapters listed as the parameters peft names, and
per-rank totals equal to the estimate's parameter bytes; checked against torch's own
`fully_shard` of the model `run` builds (runtime/model.py, runtime/lora.py).

Run as a script, this file is the torch side: `python tests/test_shards_lora.py CASE_JSON`
builds the model on a fake process group of each (world, rank) asked and prints what every
parameter's local shard holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli

QLORA_70B = ROOT / "presets" / "jobs" / "llama-3-70b-qlora.toml"
ALL_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _job(write, model: str, lora: dict, name: str = "job.toml") -> str:
    table = "".join(f"{key} = {json.dumps(value)}\n" for key, value in lora.items())
    return write(name, f"{model}[train]\nprecision = \"bf16-mixed\"\n[lora]\n{table}")


def _estimate_params(job: str, *flags: str) -> dict[int, int]:
    """The estimate's parameter bytes of each pipeline stage's rank, GPU and host together."""
    result = run_cli("estimate", job, *flags, "--json")
    assert result.code in (0, 1), result.err
    return {d["stage"]: d["gpu"]["params"] + d["cpu"]["params"] for d in result.json["devices"]}


def _shards(job: str, *flags: str) -> dict:
    result = run_cli("shards", job, *flags, "--json")
    assert result.code == 0, result.err
    return result.json


def test_qlora_preset_matches_the_estimate():
    """The reported case: 4.70 GiB per rank (the estimate), not 32.85 GiB of fp32 shards."""
    doc = _shards(str(QLORA_70B))
    estimate = _estimate_params(str(QLORA_70B))
    # By hand, for Llama-3 70B (80 layers, hidden 8,192, 8 KV heads of 128, MLP 28,672,
    # vocabulary 128,256: Meta's config.json) on 8 ranks of ZeRO-3, rank-16 adapters on the
    # seven linears of each layer:
    h, kv, mlp, vocab, layers, ranks = 8192, 1024, 28672, 128_256, 80, 8
    shapes = [(h, h), (kv, h), (kv, h), (h, h), (mlp, h), (mlp, h), (h, mlp)]  # q k v o gate up down
    frozen = layers * sum(out * inp for out, inp in shapes)
    adapters = layers * sum(16 * (out + inp) for out, inp in shapes)  # peft: A (r x in) and B (out x r)
    # NF4 as torchao's to_nf4 stores it (QLoRA, Dettmers et al. 2023, section 3; the layout in
    # core/quantized.py, held to torchao's storages by tests/test_quantized.py): codes N/2,
    # int8 block scalers N/64, a bf16 factor per 64 * 256 elements, sharded over the ranks;
    # each tensor's bf16 scaler mean and 16-entry code book (34 bytes) on every rank.
    nf4 = (frozen // 2 + frozen // 64 + frozen // (64 * 256) * 2) // ranks + layers * len(shapes) * 34
    # fp32 adapters; the bf16 embedding, head and 2 * 80 + 1 norms, all sharded.
    rest = adapters * 4 // ranks + (2 * vocab * h + (2 * layers + 1) * h) * 2 // ranks
    assert {r["bytes"] for r in doc["ranks"]} == {estimate[0]} == {nf4 + rest}
    assert (doc["dtype"], doc["frozen_dtype"], doc["element_bytes"]) == ("fp32", "nf4", 4)
    text = run_cli("shards", str(QLORA_70B)).out
    header = text.splitlines()[0]
    assert "frozen base NF4" in header and "adapters fp32 (4 bytes" in header and "4.70 GiB" in text


LLAMA_8B = "[model]\npreset = \"llama-3-8b\"\n"
MIXTRAL = "[model]\npreset = \"mixtral-8x7b\"\n"
GPT2 = "[model]\npreset = \"tiny-gpt2\"\n"  # biases: peft moves them under base_layer too


@pytest.mark.parametrize("model, lora", [
    (LLAMA_8B, {"rank": 16, "base_dtype": "bf16"}),
    (LLAMA_8B, {"rank": 8, "targets": ALL_LINEARS, "base_dtype": "nf4"}),
    (MIXTRAL, {"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"], "base_dtype": "nf4"}),
    (GPT2, {"rank": 4, "targets": ["q_proj", "up_proj"], "base_dtype": "bf16"}),
])
@pytest.mark.parametrize("dp", [2, 4, 8])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_per_rank_bytes_equal_the_estimate(write, model, lora, dp, tp, stage):
    """Every shard rank of every stage stores, byte for byte, the parameters the estimate
    counts for its stage (fsdp2: every rank of a shard group stores the same padded shards).
    QLoRA with tp 2 is estimated, not run; the estimate and `shards` still agree on it."""
    job = _job(write, model, lora)
    flags = ("--dp", str(dp), "--tp", str(tp), "--zero", str(stage))
    doc = _shards(job, *flags)
    estimate = _estimate_params(job, *flags)
    for rank in doc["ranks"]:
        assert rank["bytes"] == estimate[rank["stage"]], (rank, estimate)
    # The totals are the parameters' own bytes, each parameter stored as the runtime does.
    for rank in doc["ranks"]:
        assert rank["bytes"] == sum(p["shards"][rank["rank"]]["bytes"] for p in doc["params"]
                                    if p["stage"] == rank["stage"])
    dtypes = {p["dtype"] for p in doc["params"]}
    assert dtypes == ({"fp32", "bf16", "nf4"} if lora["base_dtype"] == "nf4" else {"fp32", "bf16"})
    assert all(p["trainable"] == (".lora_" in p["name"]) for p in doc["params"])


def test_pipeline_stages_each_match(write):
    job = _job(write, LLAMA_8B, {"rank": 16, "targets": ALL_LINEARS, "base_dtype": "nf4"})
    flags = ("--dp", "4", "--pp", "2", "--zero", "3", "--set", "parallel.num_microbatches=4")
    doc = _shards(job, *flags)
    estimate = _estimate_params(job, *flags)
    assert len(estimate) == 2 and {r["stage"] for r in doc["ranks"]} == {0, 1}
    assert all(r["bytes"] == estimate[r["stage"]] for r in doc["ranks"])


def test_adapters_are_parameters_named_as_peft_names_them(write):
    job = _job(write, GPT2, {"rank": 4, "targets": ["q_proj", "up_proj"]})
    names = [p["name"] for p in _shards(job, "--dp", "2", "--zero", "3")["params"]]
    at = names.index("layers.0.attn.q_proj.base_layer.weight")
    # peft's LoraLayer: the wrapped linear (weight, bias) first, then lora_A and lora_B.
    assert names[at:at + 4] == [
        "layers.0.attn.q_proj.base_layer.weight", "layers.0.attn.q_proj.base_layer.bias",
        "layers.0.attn.q_proj.lora_A.default.weight", "layers.0.attn.q_proj.lora_B.default.weight",
    ]
    assert "layers.0.attn.k_proj.weight" in names  # not a target: not wrapped
    doc = _shards(job, "--dp", "2", "--zero", "3")
    a = next(p for p in doc["params"] if p["name"] == "layers.0.attn.q_proj.lora_A.default.weight")
    assert a["shape"] == [4, 128] and [s["rows"] for s in a["shards"]] == [2, 2]  # FSDP2 shards adapters too
    assert [s["bytes"] for s in a["shards"]] == [2 * 128 * 4] * 2  # fp32 under bf16-mixed


def test_stage_1_partitions_the_adapters_and_says_run_refuses_it(write):
    """ZeroRedundancyOptimizer sees only trainable parameters: the adapters; every rank holds
    all parameters whole, as the estimate counts them; `run` refuses LoRA at stage 1."""
    job = _job(write, LLAMA_8B, {"rank": 16, "targets": ALL_LINEARS, "base_dtype": "nf4"})
    flags = ("--dp", "4", "--zero", "1")
    doc = _shards(job, *flags)
    assert doc["assign"] == "zero-optimizer" and "refuses LoRA" in doc["note"]
    assert all(".lora_" in b["name"] for b in doc["blocks"]) and len(doc["blocks"]) == 32 * 7 * 2
    assert doc["param_bytes"] == [{"stage": 0, "bytes": _estimate_params(job, *flags)[0]}]
    # The estimate's optimizer states are the fullest rank's adapters: 8 B of moments per
    # element and a 4-byte step per tensor (torch/optim/adamw.py).
    held: dict[int, int] = {}
    for block in doc["blocks"]:
        held[block["owner"]] = held.get(block["owner"], 0) + 8 * block["numel"] + 4
    trainable = run_cli("estimate", job, *flags, "--json").json["params"]["trainable"]
    assert sum(held.values()) == 8 * trainable + 4 * len(doc["blocks"])  # every adapter once
    text = run_cli("shards", job, *flags).out
    assert "adapters (4 bytes per element" in text and "every rank holds all parameters whole" in text


def test_stage_1_optimizer_bytes_equal_the_estimate(write):
    """ZeroRedundancyOptimizer's partition of the adapters (each tensor's two fp32 moments and
    its 4-byte step on one rank): the fullest rank holds what the estimate counts, to the byte,
    including the steps of the layers' remainder that the root (no adapter of its own) takes."""
    job = _job(write, LLAMA_8B, {"rank": 16, "targets": ALL_LINEARS, "base_dtype": "nf4"})
    flags = ("--dp", "4", "--zero", "1")
    held: dict[int, int] = {}
    for block in _shards(job, *flags)["blocks"]:
        held[block["owner"]] = held.get(block["owner"], 0) + 8 * block["numel"] + 4
    estimate = run_cli("estimate", job, *flags, "--json").json
    assert estimate["devices"][0]["gpu"]["optimizer"] == max(held.values())


def test_deepspeed_flat_buffers_hold_only_the_adapters(write):
    job = _job(write, GPT2, {"rank": 4, "targets": ["q_proj", "up_proj"]})
    doc = _shards(job, "--dp", "4", "--framework", "deepspeed", "--zero", "2")
    assert doc["style"] == "zero12" and doc["element_bytes"] == 2
    adapters = [p for p in doc["params"] if p["trainable"]]
    frozen = [p for p in doc["params"] if not p["trainable"]]
    assert sum(b["numel"] for b in doc["flat_buffers"]) == sum(_numel(p) for p in adapters)
    assert all(p["replicated"] and p["unit"] == "frozen" and p["dtype"] == "bf16" for p in frozen)
    assert all(s["bytes"] == 2 * _numel(p) for p in frozen for s in p["shards"])
    # Stage 3: every parameter partitioned, frozen ones in bf16 as the estimate's `frozen_bytes`.
    # tiny-gpt2's embedding (512 x 128) is under stage3_param_persistence_threshold (1e5):
    # DeepSpeed keeps it whole besides its partition (partition_parameters.py line 1292).
    doc3 = _shards(job, "--dp", "4", "--framework", "deepspeed", "--zero", "3")
    lm = next(p for p in doc3["params"] if p["name"] == "embed.weight")
    assert doc3["style"] == "zero3" and lm["persistent_bytes"] == 2 * 512 * 128
    assert lm["shards"][0]["bytes"] == 2 * -(-_numel(lm) // 4) + 2 * 512 * 128


@pytest.mark.parametrize("model, lora", [
    (LLAMA_8B, None),
    (LLAMA_8B, {"rank": 16, "base_dtype": "bf16"}),
    (LLAMA_8B, {"rank": 8, "targets": ALL_LINEARS, "base_dtype": "nf4"}),
    (GPT2, {"rank": 4, "targets": ["q_proj", "up_proj"], "base_dtype": "bf16"}),
])
@pytest.mark.parametrize("extra", [(), ("--set", "offload.params=true", "--set", "offload.optimizer=true"),
                                   ("--set", "zero.param_persistence_threshold=0")])
def test_deepspeed_stage3_bytes_equal_the_estimate(write, model, lora, extra):
    """DeepSpeed ZeRO-3: every parameter partitioned to ceil(numel / dp) elements, and those of at
    most stage3_param_persistence_threshold elements (1e5 by default: the norms of 4,096, and
    LoRA adapters such as a rank-16 lora_A of a 4,096-wide projection, 16 x 4,096 = 65,536) also
    kept whole (partition_parameters.py line 1292). Per rank, `shards` stores what the estimate
    counts, GPU and host together, with parameter offload too."""
    if lora is None:
        job = write("job.toml", f"{model}[train]\nprecision = \"bf16-mixed\"\n")
    else:
        job = _job(write, model, lora)
    flags = ("--dp", "4", "--framework", "deepspeed", "--zero", "3", *extra)
    doc = _shards(job, *flags)
    estimate = _estimate_params(job, *flags)
    assert doc["style"] == "zero3"
    assert [rank["bytes"] for rank in doc["ranks"]] == [estimate[0]] * 4
    kept = [p for p in doc["params"] if p["persistent_bytes"]]
    if "zero.param_persistence_threshold=0" in extra:
        assert kept == [] and doc["persistent_at_most"] == 0
    else:
        assert kept and all(_numel(p) <= 100_000 for p in kept)
        assert all(_numel(p) > 100_000 for p in doc["params"] if not p["persistent_bytes"])


def _numel(param: dict) -> int:
    numel = 1
    for size in param["local_shape"]:
        numel *= size
    return numel


def test_full_training_unchanged(write):
    doc = _shards("tiny-gpt2-cpu", "--world", "3")
    assert doc["frozen_dtype"] is None and all(p["trainable"] and p["dtype"] == "fp32" for p in doc["params"])
    assert all(r["bytes"] == 4 * (r["numel"] + r["padding"]) for r in doc["ranks"])


# -- against torch: the model `run` builds, sharded by FSDP2 -------------------------------
# hidden 256, 4 heads of 64, 4 kv heads, ffn 512: every layer linear is a multiple of
# 64 * 256 * 4 elements, so torchao can store it as NF4 split over 2 or 4 ranks.
TORCH_SHAPE = {"family": "llama", "num_layers": 2, "hidden_size": 256, "num_heads": 4, "num_kv_heads": 4,
               "ffn_hidden_size": 512, "vocab_size": 512}
TORCH_CASES = [(2, 0, 3), (2, 1, 3), (4, 3, 2), (2, 1, 0)]  # (world, rank, zero stage)


def _torchao_importable() -> bool:
    try:
        import torchao  # noqa: F401
    except Exception:  # a broken build fails in many ways
        return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("base_dtype", ["bf16", "nf4"])
def test_fully_shard_of_the_lora_model_stores_what_shards_says(write, base_dtype):
    """Each rank's local shard of every parameter (`DTensor.to_local()`, the inner tensors of
    an NF4 shard; unique storages, runtime/measure.py) of the model `run` builds (peft's
    adapters, the base stored by runtime/lora.py `store_base`, FSDP2 `fully_shard` by
    runtime/parallel.py `apply_fsdp`), on a fake process group of each world, equals
    `shards --json`'s bytes of that parameter and rank; the per-rank totals too."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    if base_dtype == "nf4" and not _torchao_importable():
        pytest.skip("torchao is not importable")
    lora = {"rank": 4, "targets": ["q_proj", "v_proj", "down_proj"], "base_dtype": base_dtype}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    case = json.dumps([TORCH_SHAPE, lora, TORCH_CASES, "bf16-mixed"])
    proc = subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    model = "[model]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in TORCH_SHAPE.items())
    job = _job(write, model, lora)
    for (world, rank, stage), theirs in zip(TORCH_CASES, measured):
        doc = _shards(job, "--dp", str(world), "--zero", str(stage))
        planned = {p["name"]: p["shards"][rank if doc["world"] > 1 else 0]["bytes"] for p in doc["params"]}
        assert planned == theirs, (world, rank, stage)
        total = doc["ranks"][rank if doc["world"] > 1 else 0]["bytes"]
        assert total == sum(theirs.values()) == _estimate_params(job, "--dp", str(world), "--zero", str(stage))[0]


def _measure(shape_table: dict, lora_table: dict, cases: list, precision: str) -> list[dict[str, int]]:
    """Build, store and shard the model as `shardplan run` does, on a fake process group of
    `world` ranks as rank `rank` (FSDP2 cuts each rank's shards locally; no collective runs),
    and measure every parameter's local bytes. Stage 0: FSDP2 over a (world, 1) replicate mesh,
    as runtime/dist.py `start` builds it."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from shardplan.core.degrees import Degrees
    from shardplan.core.layout import Layout
    from shardplan.runtime.dist import Runtime
    from shardplan.runtime.measure import unique_storage_bytes
    from shardplan.runtime.model import Transformer
    from shardplan.runtime.lora import add_adapters
    from shardplan.runtime.parallel import ParallelPlan, parallelize
    from shardplan.spec.job import LoraSpec
    from shardplan.spec.model import resolve_shape

    shape, problems = resolve_shape(shape_table)
    assert shape is not None, problems
    lora = LoraSpec(**lora_table)
    found = []
    for world, rank, stage in cases:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        split = "replicate" if stage == 0 else None
        if split:
            mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
            mesh._flatten("dp")
        else:
            mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
        runtime = Runtime(rank, world, torch.device("cpu"), mesh, Layout(Degrees(dp=world), "tp-cp-dp-pp", 8), split)
        with torch.device("meta"):
            model = Transformer(shape)
        add_adapters(model, lora)
        plan = ParallelPlan(zero_stage=stage, precision=precision, optimizer="adamw", lr=1e-3, recompute="none",
                            resident_layers=shape.num_layers, offload_params=False, prefetch_layers=1,
                            pin_memory=False, lora=lora)
        model = parallelize(model, runtime, plan)
        found.append({name: sum(unique_storage_bytes([p]).values()) for name, p in model.named_parameters()})
        dist.destroy_process_group()
    return found


if __name__ == "__main__":
    print(json.dumps(_measure(*json.loads(sys.argv[1]))))


def test_assign_outside_the_stage_1_view_claims_nothing_whole(write):
    """At ZeRO-3 FSDP2 shards every parameter: an --assign view must not say they are whole."""
    job = _job(write, GPT2, {"rank": 4, "targets": ["q_proj", "up_proj"]})
    doc = _shards(job, "--dp", "2", "--zero", "3", "--assign", "round-robin")
    assert doc["param_bytes"] == []
    assert "whole" not in run_cli("shards", job, "--dp", "2", "--zero", "3", "--assign", "round-robin").out
    assert doc["blocks"] and all(".lora_" in b["name"] for b in doc["blocks"])


def test_fsdp1_refuses_the_frozen_base_beside_the_adapters(write):
    """torch's FSDP1 flattens a block into one FlatParameter of one dtype (and one requires_grad
    with use_orig_params=False): bf16/NF4 base and fp32 adapters cannot share it."""
    job = _job(write, GPT2, {"rank": 4, "targets": ["q_proj"]})
    result = run_cli("shards", job, "--dp", "2", "--style", "fsdp1")
    assert result.code == 2 and "uniform dtype" in result.err and "Traceback" not in result.err
