"""The estimate of each offload mode under fsdp2 (core/offload.py, core/states.py, core/host.py):
where each kind of state lives, the exact host bytes of compressed states, the transients of
the step timeline, pinned rounding, validation and the offload strategy. The runtime checks
the same figures against real runs (tests/test_offload_run.py)."""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.deepspeed import pinned_bytes
from shardplan.core.estimate import rank_coordinates, rank_estimate
from shardplan.core.estimate_inputs import inputs_from_job
from shardplan.core.timeline import BACKWARD, STEP
from shardplan.io.job import load_job

PARAMS = 1000  # one flat tensor of 1,000 elements (a bare parameter count, dp 1)


def estimate(*flags: str) -> dict:
    result = run_cli("estimate", "--json", "--explain", *flags)
    assert result.code == 0, result.err
    return result.json


def cpu_optimizer(*flags: str) -> int:
    return estimate("--params", str(PARAMS), "--zero", "2", *flags)["devices"][0]["cpu"]["optimizer"]


def test_optimizer_offload_holds_master_moments_and_steps():
    """AdamW on the host: an fp32 master (4 B), exp_avg and exp_avg_sq (4 B each) per element
    and a 4-byte step per tensor (torch/optim/adamw.py keeps `step` as an fp32 scalar)."""
    assert cpu_optimizer("--set", "offload.optimizer=true") == PARAMS * (4 + 8) + 4


@pytest.mark.parametrize("compression, moments", [
    # 1,000 elements are 4 blocks of 256 (torchao AdamW8bit's block_size): per moment 4 * 256
    # one-byte codes and 4 fp32 scales.
    ("int8", 2 * 4 * (256 * 1 + 4)),
    # fp16 keeps the same blocks, 2-byte codes and a scale per block.
    ("fp16", 2 * 4 * (256 * 2 + 4)),
    # bf16: 2 bytes per element, no scale.
    ("bf16", 2 * PARAMS * 2),
])
def test_compressed_moments_count_codes_and_scales(compression, moments):
    got = cpu_optimizer("--set", "offload.optimizer=true", "--set", f"offload.cpu_compression={compression}")
    assert got == moments + PARAMS * 4 + 4  # the fp32 master and the step are never compressed


def test_sgd_keeps_only_the_master():
    assert cpu_optimizer("--set", "offload.optimizer=true", "--set", "train.optimizer=sgd") == PARAMS * 4


def _device(*sets: tuple[str, object]):
    """Rank 0's estimate of tiny-gpt2 on dp 2, seq 64, with the given job keys."""
    resolved = load_job(None, [("model.preset", "tiny-gpt2"), ("parallel.dp", 2), ("train.seq_len", 64), *sets], env={})
    inputs = inputs_from_job(resolved.job, resolved.shape, limits_known=False)
    return rank_estimate(inputs, rank_coordinates(inputs, 0), [0])


def _at(device, moment: str, kind: str) -> int:
    return next(m for m in device.moments if m.name == moment).bytes(kind)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_modes_place_each_kind(stage):
    zero = ("zero.stage", stage)
    plain = _device(zero)
    optimizer = _device(zero, ("offload.optimizer", True))
    both = _device(zero, ("offload.optimizer", True), ("offload.grads", True))
    # optimizer states leave the device, parameters stay
    assert optimizer.states["optimizer"] == 0 and optimizer.cpu["optimizer"] > plain.states["optimizer"]
    assert optimizer.states["params"] == plain.states["params"] and optimizer.cpu["params"] == 0
    # one host copy of the gradients in both modes; the device keeps its own without `grads`,
    # and under DDP's buckets (stage 1) always
    assert optimizer.cpu["grads"] == both.cpu["grads"] > 0
    assert optimizer.states["grads"] == plain.states["grads"]
    assert (both.states["grads"] == 0) == (stage != 1)
    # no optimizer step on the device: its temporaries are gone too
    assert _at(optimizer, STEP, "buffers") < _at(plain, STEP, "buffers")


def test_freed_gradients_are_transient_in_backward():
    """With `grads`, a block's sharded gradients live on the device only between their
    reduce-scatter and their copy: in backward, one block at a time (core/buffers.py)."""
    keep = _device(("zero.stage", 3), ("offload.optimizer", True))
    free = _device(("zero.stage", 3), ("offload.optimizer", True), ("offload.grads", True))
    terms = {t.label: t.bytes for m in free.moments if m.name == BACKWARD for t in m.terms["buffers"]}
    layer_shard = next(t.bytes for t in free.terms["gpu.params"] if t.label == "layers params") // 4  # 4 layers
    assert terms["one block's sharded gradients awaiting their copy to the host"] == layer_shard
    assert _at(free, STEP, "grads") == 0 < _at(keep, STEP, "grads")


def test_pinned_buffers_round_to_a_power_of_two():
    """On a GPU the master and gradient copies are one pinned allocation per group, each
    rounded up by torch's CachingHostAllocator; the moments are not pinned."""
    flags = ("--params", str(PARAMS), "--zero", "2", "--set", "offload.optimizer=true", "--set", "cluster.gpu_memory=80GiB")
    pinned = estimate(*flags)["host"]["breakdown"]
    assert pinned["all fp32 master weights (pinned, rounded up to a power of two)"] == pinned_bytes(PARAMS * 4)
    unpinned = estimate(*flags, "--set", "offload.pin_memory=false")["host"]["breakdown"]
    assert unpinned["all fp32 master weights"] == PARAMS * 4


def test_grads_alone_is_an_error_under_fsdp2(write):
    job = write("job.toml", '[model]\npreset = "tiny-gpt2"\n[offload]\ngrads = true\n')
    result = run_cli("validate", job)
    assert result.code == 2 and "offload.grads: gradients on the CPU serve only an optimizer" in result.err


def test_compression_without_host_states_warns(write):
    job = write("job.toml", '[model]\npreset = "tiny-gpt2"\n[offload]\ncpu_compression = "int8"\n')
    result = run_cli("validate", job)
    assert result.code == 0 and "has no effect unless offload.optimizer or offload.params" in result.err


def test_strategy_offloads_optimizer_states_first():
    """Over the GPU, fsdp2 moves optimizer states (and master weights) before gradients and
    before any layer's parameters, at any stage."""
    base = estimate("--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "2", "--set", "train.seq_len=1024",
                    "--set", "cluster.gpu_memory=80GiB")
    tight = int(base["peak_gpu_bytes"] * 0.8)
    decided = estimate("--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "2", "--set", "train.seq_len=1024",
                       "--set", f"cluster.gpu_memory={tight}")
    assert decided["decisions"][1].startswith("offload optimizer states")
    assert decided["assumptions"]["offload"]["optimizer"] is True
    assert decided["peak_gpu_bytes"] < base["peak_gpu_bytes"]


def _offload_seconds(*sets: str) -> float:
    flags = ["--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "3", "--set", "cluster.gpu=h100-sxm"]
    for expression in sets:
        flags += ["--set", expression]
    return estimate(*flags)["time"]["breakdown"]["offload"]


def test_time_model_covers_every_mode():
    """The CPU step and the copies of each mode (core/time_plan.py): no offload costs nothing;
    compressed states add host memory traffic to the CPU step (bf16 < int8 < fp16, from the
    passes runtime/offload_codec.py makes, tests/test_offload_codec.py); the offloaded layers of params + optimizer step in
    place, so fewer parameters return than with the optimizer alone."""
    assert _offload_seconds() == 0
    plain = _offload_seconds("offload.optimizer=true")
    assert plain > 0
    compressed = [_offload_seconds("offload.optimizer=true", f"offload.cpu_compression={c}")
                  for c in ("bf16", "int8", "fp16")]
    assert plain < compressed[0] < compressed[1] < compressed[2]
    both = _offload_seconds("offload.optimizer=true", "offload.params=true", "offload.gpu_param_budget=1GiB")
    assert both < plain


# Llama-3 8B full training on two RTX 4090s (23.99 GiB): only offload fits, and offloading the
# optimizer states alone pins more host memory (135.83 GiB) than the plan the balanced strategy
# ends with, the optimizer, the gradients and 26 of 32 layers' parameters (134.96 GiB).
ON_4090S = ["--set", "model.preset=llama-3-8b", "--set", "train.seq_len=4096", "--set", "cluster.gpu=rtx-4090",
            "--set", "cluster.gpus_per_node=2", "--dp", "2", "--zero", "3", "--set", "parallel.micro_batch_size=2",
            "--set", "parallel.num_microbatches=4", "--set", "train.activation_checkpointing=full"]


def _on_4090s(ram_gib: int) -> tuple[int, dict]:
    result = run_cli("estimate", "--json", *ON_4090S, "--set", f"cluster.cpu_memory_per_node={ram_gib}GiB")
    return result.code, result.json


def test_strategy_goes_past_a_step_over_the_host_limit():
    """Only the plan the strategy ends with runs: a step on its way that needs more host memory
    than the node's limit does not stop it when a later step needs less. With 150 GiB of RAM
    (a 135 GiB budget) the optimizer step asks 135.83 GiB, and the strategy ends at the plan a
    host without limit gives, which fits."""
    code, roomy = _on_4090s(2048)
    assert code == 0
    code, doc = _on_4090s(150)
    assert code == 0 and doc["fits"] is True, doc["decisions"]
    assert doc["assumptions"]["offload"] == roomy["assumptions"]["offload"]
    assert doc["cpu_bytes_per_node"] == roomy["cpu_bytes_per_node"] <= doc["host"]["limit"]
    assert "over its 135.00 GiB: offloading more may need less" in doc["decisions"][1]


def test_a_host_limit_under_the_plans_need_offloads_more_layers():
    """With the optimizer on the host, a resident layer's states take more host memory than an
    offloaded layer's (the engine's pinned master and gradient buffers against FSDP's shards),
    so a limit below the plan's 134.96 GiB is met by offloading more layers than the GPU needs;
    none fits under the host of every layer offloaded."""
    _, roomy = _on_4090s(2048)
    code, doc = _on_4090s(149)  # a 134.10 GiB budget
    assert code == 0 and doc["cpu_bytes_per_node"] <= doc["host"]["limit"] < roomy["cpu_bytes_per_node"]
    resident, roomy_resident = (d["assumptions"]["offload"]["resident_layers"] for d in (doc, roomy))
    assert max(resident) < max(roomy_resident)
    assert doc["peak_gpu_bytes"] < roomy["peak_gpu_bytes"]
    assert any(line.startswith("more layers than the GPU needs") for line in doc["decisions"])
    code, doc = _on_4090s(145)
    assert code == 1 and doc["fits"] is False
    assert "no further offload needs less" in doc["decisions"][-1]
