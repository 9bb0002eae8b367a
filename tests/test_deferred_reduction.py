"""FSDP2 modules in torch's pipeline stages: the schedules keep every block gathered after its
backward and every gradient unsharded until the step ends (torch/distributed/pipelining/
stage.py: `backward_maybe_with_nosync` sets `set_reshard_after_backward(False)` and
`set_requires_gradient_sync(False)` for every backward; `perform_reduce_grad` reshards and
reduce-scatters when the step ends). The estimate counts both (core/buffers.py
`pipelined_fsdp2_buffers`, `deferred_grads`).

The reference no one here wrote: what torch itself holds, read by a probe in `shardplan run`
just before the first reduction of a step (tests/dist/deferred_reduction.py), against the
estimate of the same rank, to the byte.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from shardplan.core.buffers import DEFERRED_GRADS, KEPT_BLOCKS, UNSHARDED_BLOCKS
from shardplan.core.estimate import rank_coordinates, rank_estimate
from shardplan.core.estimate_inputs import inputs_from_job
from shardplan.core.finetune import ROOT_FROZEN
from shardplan.core.memory import estimate_memory
from shardplan.core.timeline import BACKWARD, BACKWARD_END, FORWARD, STEP
from shardplan.io.job import load_job
from test_run import ACTIVATION_TOLERANCE

ROOT_PARAMS = "unsharded root parameters (embedding/head)"

TINY = """
[model]
{model}
[parallel]
dp = {dp}
pp = 2
virtual_stages = {virtual}
pipeline_schedule = "{schedule}"
micro_batch_size = 1
num_microbatches = 4
[zero]
stage = {stage}
[train]
seq_len = 64
precision = "{precision}"
steps = 2
seed = 7
[cluster]
gpus_per_node = 4
gpu_memory = "4GiB"
cpu_memory_per_node = "16GiB"
{lora}"""


# A Llama whose layer linears torchao can store as NF4 and FSDP2 split in two (64 * 256 * 2
# elements each; tests/test_run.py's fine-tuning model, with four layers).
NF4_LLAMA = """family = "llama"
num_layers = 4
hidden_size = 256
num_heads = 4
num_kv_heads = 2
ffn_hidden_size = 512
vocab_size = 512
max_seq_len = 128"""


def tiny(dp: int, virtual: int, schedule: str, stage: int, precision: str, model: str = "tiny-llama",
         lora: str = "") -> str:
    """`model`: a preset or NF4_LLAMA; `lora`: "", "bf16" or "nf4" (the base's dtype)."""
    return TINY.format(dp=dp, virtual=virtual, schedule=schedule, stage=stage, precision=precision,
                       model=model if "\n" in model else f'preset = "{model}"',
                       lora=f'[lora]\nrank = 8\nbase_dtype = "{lora}"\n' if lora else "")

# Llama 3 8B (meta-llama/Meta-Llama-3-8B config.json: hidden 4,096, intermediate 14,336, 8 KV
# heads of 128, 32 layers): one decoder layer holds q and o (4,096^2 each), k and v (4,096 x
# 1,024 each), gate, up and down (4,096 x 14,336 each) and two RMSNorm weights of 4,096, which
# is transformers' count of the model (8,030,261,248) less its embeddings, head and final norm,
# over 32 layers.
LLAMA3_8B_LAYER = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336 + 2 * 4096
assert LLAMA3_8B_LAYER * 32 == 8_030_261_248 - 2 * 128256 * 4096 - 4096


def _rank(write, text: str, rank: int):
    resolved = load_job(write("job.toml", text), [], env={})
    inputs = estimate_memory(inputs_from_job(resolved.job, resolved.shape, True)).inputs
    return rank_estimate(inputs, rank_coordinates(inputs, rank), [rank])


def _terms(device, moment: str, kind: str) -> dict[str, int]:
    found = next(m for m in device.moments if m.name == moment)
    return {t.label: t.bytes for t in found.terms[kind]}


@pytest.mark.parametrize("stage, dp", [(3, 2), (2, 2), (0, 2), (3, 1)])
def test_gradients_stay_unsharded_until_the_step_ends(write, stage, dp):
    """Every parameter's gradient, unsharded with its all-gather padding, in fp32 (FSDP2's
    reduce dtype under bf16-mixed), from the first backward to the reduction; the sharded
    gradients only at the optimizer step. Stage 0's one-rank shards and a shard group of one
    rank defer alike: `fully_shard` runs at every stage but 1."""
    text = tiny(dp, 1, "1f1b", stage, "bf16-mixed")
    device = _rank(write, text, 0)
    names = {m.name for m in device.moments}
    assert BACKWARD_END in names  # the reduction when the step ends is a moment of its own
    for moment in (FORWARD, BACKWARD, BACKWARD_END):
        assert list(_terms(device, moment, "grads")) == [DEFERRED_GRADS]
    # tiny-llama's first stage: 2 layers of 92,288 x 2 elements (dp 2) and the 32,768 x 2
    # embedding, unsharded: 434,688 elements (presets/models/tiny-llama.toml; the probe below
    # reads the same bytes from torch).
    assert _terms(device, BACKWARD, "grads")[DEFERRED_GRADS] == 434_688 * 4
    assert DEFERRED_GRADS not in _terms(device, STEP, "grads")


def test_stage_one_is_ddp_and_defers_nothing(write):
    device = _rank(write, tiny(2, 1, "1f1b", 1, "bf16-mixed"), 0)
    assert BACKWARD_END not in {m.name for m in device.moments}
    assert DEFERRED_GRADS not in _terms(device, BACKWARD, "grads")


LLAMA3_8B_PP2 = """
[model]
preset = "llama-3-8b"
[parallel]
dp = 4
pp = 2
pipeline_schedule = "1f1b"
micro_batch_size = 1
num_microbatches = 8
[zero]
stage = {stage}
[train]
seq_len = 512
precision = "bf16-mixed"
activation_checkpointing = "full"
[cluster]
preset = "h100-80gb"
"""


def test_the_sweeps_end_holds_every_block_gathered(write):
    """ZeRO-3 under 1F1B: a block's backward leaves it gathered until the next forward, so
    where blocks outweigh activations (full recomputation, 512 tokens) the backward moment is
    the sweep's end: all 16 blocks of the stage gathered in bf16, one layer's activations of
    the microbatch in backward left beside the other microbatch held."""
    text = LLAMA3_8B_PP2.format(stage=3)
    device = _rank(write, text, 0)
    buffers = _terms(device, BACKWARD, "buffers")
    gathered = [bytes_ for label, bytes_ in buffers.items() if label.startswith(UNSHARDED_BLOCKS)]
    assert gathered == [16 * LLAMA3_8B_LAYER * 2]
    layers = {label: b for label, b in _terms(device, BACKWARD, "activations").items()
              if label.startswith("layers of stage")}
    per_layer = _terms(device, FORWARD, "activations")["layers of stage 0"] // (2 * 16)
    assert list(layers.values()) == [(2 * 16 - 15) * per_layer]


def test_lora_keeps_its_frozen_blocks_gathered_and_its_adapters_unsharded(write):
    """LoRA in torch's pipeline stages defers alike: after their backward the blocks stay
    gathered, frozen base and adapters in bf16, until the step ends; only the adapters have
    gradients, kept unsharded in fp32. Llama 3 8B, rank 16 on q, k, v and o (peft's count:
    r * (in + out) per target): q and o 16 * (4,096 + 4,096), k and v 16 * (4,096 + 1,024)."""
    adapters = 2 * 16 * (4096 + 4096) + 2 * 16 * (4096 + 1024)
    text = LLAMA3_8B_PP2.format(stage=3) + "[lora]\nrank = 16\n"
    device = _rank(write, text, 0)
    end = _terms(device, BACKWARD_END, "buffers")
    assert end[KEPT_BLOCKS] == 16 * (LLAMA3_8B_LAYER + adapters) * 2
    assert _terms(device, BACKWARD_END, "grads") == {f"adapters, {DEFERRED_GRADS}": 16 * adapters * 4}
    assert not run_cli("estimate", write("job.toml", text), "--json").json["warnings"]


def _probe(tmp_path, text: str, nproc: int) -> dict[int, dict]:
    job = tmp_path / "job.toml"
    job.write_text(text, encoding="utf-8")
    out = tmp_path / "held"
    out.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        env.pop(name, None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
           str(ROOT / "tests" / "dist" / "deferred_reduction.py"), str(out), str(job), "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = {entry["rank"]: entry for entry in json.loads(proc.stdout)["ranks"]}
    return {rank: {**json.loads((out / f"rank{rank}.json").read_text()), "report": report[rank]}
            for rank in range(nproc)}


@pytest.mark.slow
@pytest.mark.parametrize("dp, virtual, schedule, stage, precision, model, lora", [
    (2, 1, "1f1b", 3, "bf16-mixed", "tiny-llama", ""),  # one chunk per rank; gradients kept in fp32
    (1, 2, "interleaved-1f1b", 2, "fp32", "tiny-llama", ""),  # two chunks; gradients in the parameters' dtype
    # LoRA: only the adapters' gradients; tied embeddings, frozen on both ends of the pipeline.
    (2, 1, "1f1b", 3, "bf16-mixed", "tiny-gpt2", "bf16"),
    # QLoRA: the blocks gathered as NF4 codes, scalers and factors.
    (2, 1, "1f1b", 3, "bf16-mixed", NF4_LLAMA, "nf4"),
], ids=["1f1b-zero3", "interleaved-zero2-fp32", "lora-tied", "qlora"])
def test_torch_holds_what_the_estimate_counts(write, tmp_path, dp, virtual, schedule, stage, precision, model, lora):
    """Before the step's first reduction torch holds every rank's gradients unsharded (the
    estimate's deferred gradients, to the byte), no sharded gradient, and every block and
    root parameter gathered (what the estimate counts when the step ends, with the root that
    the reduction reshards first). Around the forwards: what the estimate's sweep rests on,
    every block gathered when a forward follows a backward, and resharded by that forward at
    ZeRO-3. The same launch's report: parameters, gradients and optimizer states measured
    equal to the estimate, saved activations within tests/test_run.py's 5%."""
    if lora:
        pytest.importorskip("peft")
        pytest.importorskip("torchao")
    text = tiny(dp, virtual, schedule, stage, precision, model, lora)
    held = _probe(tmp_path, text, 2 * dp)
    grads_label = f"adapters, {DEFERRED_GRADS}" if lora else DEFERRED_GRADS
    for rank, measured in held.items():
        device = _rank(write, text, rank)
        at_end = _terms(device, BACKWARD_END, "buffers")
        root = _terms(device, BACKWARD, "buffers").get(ROOT_FROZEN if lora else ROOT_PARAMS, 0)
        assert measured["unsharded_grads"] == _terms(device, BACKWARD_END, "grads")[grads_label], rank
        assert measured["sharded_grads"] == 0, rank
        assert measured["gathered"] == at_end[KEPT_BLOCKS] + root, rank
        # A forward finds every block of the backward before it gathered; at ZeRO-3 it
        # reshards them all (its root stays), at ZeRO-2 it keeps them.
        assert measured["gathered_before_forward"] == at_end[KEPT_BLOCKS] + root, rank
        assert measured["gathered_after_forward"] == (root if stage == 3 else at_end[KEPT_BLOCKS] + root), rank
        report = measured["report"]
        for kind in ("params", "grads", "optimizer"):
            assert report["measured"][kind] == report["estimated"][kind], (rank, kind)
        saved, counted = report["measured"]["activations"], report["estimated"]["activations"]
        assert abs(saved - counted) <= ACTIVATION_TOLERANCE * saved, (rank, saved, counted)


def test_the_time_model_reduces_once_when_the_step_ends(write):
    """No reduce-scatter per microbatch: the rank's whole gradient is reduce-scattered once,
    after its last backward, with no compute left to hide it (ZeRO-2 also gathers once per
    step, so its microbatches carry no data-parallel traffic at all)."""
    from shardplan.core.collectives import REDUCE_SCATTER, collective_seconds
    from shardplan.core.hardware import TimeConstants
    from shardplan.core.step_time import _links, step_time
    from shardplan.core.time_plan import edges_of, layer_of, make_plan, stage_costs, stage_elements, tail
    from time_references import A100_80GB

    for stage in (2, 3):
        resolved = load_job(write("job.toml", LLAMA3_8B_PP2.format(stage=stage)), [], env={})
        inputs = inputs_from_job(resolved.job, resolved.shape, True)
        constants = TimeConstants()
        plan = make_plan(inputs, A100_80GB, constants, None, _links(inputs, A100_80GB, constants))
        if stage == 2:
            for cost in stage_costs(plan, layer_of(plan), edges_of(plan)):
                assert not cost.forward.get("data_parallel") and not cost.backward.get("data_parallel")
        # One chunk per rank: rank r holds stage r; 4 ranks shard it; fp32 gradients.
        reductions = [collective_seconds(REDUCE_SCATTER, e * 4, 4, plan.links["dp"]) for e in stage_elements(plan)]
        for rank, reduction in enumerate(reductions):  # a long last backward hides none of it
            assert tail(plan, rank, stage_elements(plan), 10.0).data_parallel == pytest.approx(reduction, rel=1e-12)
        if stage == 2:  # nothing else is data-parallel traffic
            timed = step_time(inputs, A100_80GB, constants)
            assert any(timed.breakdown["data_parallel"] == pytest.approx(r, rel=1e-12) for r in reductions)
