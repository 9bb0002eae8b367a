"""Keys a job writes that its framework's accounting does not read get a warning (exit 0):
DeepSpeed's own knobs (spec/job.py ZeroSpec, read by core/deepspeed.py only) under fsdp2 or
zero-paper, and FSDP's `min_num_params` under deepspeed, which has no such knob (DeepSpeed
0.19.8 zero/config.py lists none; its stage 3 keeps small parameters whole by
stage3_param_persistence_threshold instead), nor a GPU parameter budget for its offload."""

from __future__ import annotations

import pytest

from conftest import run_cli
from shardplan.core.checks import DEEPSPEED_KEYS

BASE = """
[model]
preset = "tiny-gpt2"
[parallel]
dp = 4
[zero]
stage = 3
"""


def _warnings(write, text: str, *flags: str) -> list[dict]:
    result = run_cli("validate", write("job.toml", text), "--json", *flags)
    assert result.code == 0, result.err
    return [p for f in result.json["files"] for p in f["problems"] if p["severity"] == "warning"]


@pytest.mark.parametrize("key, value", [("reduce_bucket_size", "1000"), ("allgather_bucket_size", "1000"),
                                        ("prefetch_bucket_size", "0"), ("max_live_parameters", "1000"),
                                        ("param_persistence_threshold", "10"), ("sub_group_size", "1e8"),
                                        ("overlap_comm", "false")])
@pytest.mark.parametrize("framework", ["fsdp2", "zero-paper"])
def test_deepspeed_knobs_under_another_framework_warn(write, key, value, framework):
    found = _warnings(write, BASE + f'framework = "{framework}"\n{key} = {value}\n')
    assert [w["path"] for w in found] == [f"zero.{key}"]
    assert framework in found[0]["message"] and "export --to deepspeed" in found[0]["message"]
    # Under deepspeed the same key is read: no warning.
    assert _warnings(write, BASE + f'framework = "deepspeed"\n{key} = {value}\n') == []


def test_every_deepspeed_knob_is_checked():
    from shardplan.spec.job import ZeroSpec

    fsdp_or_common = {"stage", "hybrid", "min_num_params", "framework"}
    assert set(ZeroSpec.model_fields) - fsdp_or_common == set(DEEPSPEED_KEYS)


def test_min_num_params_under_deepspeed_warns(write):
    found = _warnings(write, BASE + 'framework = "deepspeed"\nmin_num_params = 1000\n')
    assert [w["path"] for w in found] == ["zero.min_num_params"]
    assert "param_persistence_threshold" in found[0]["message"]
    # fsdp2's accounting reads it; only `run`, which shards every parameter, refuses it.
    (refusal,) = _warnings(write, BASE + "min_num_params = 1000\n")
    assert refusal["path"] == "zero.min_num_params" and "`shardplan run` would refuse it" in refusal["message"]


@pytest.mark.parametrize("budget, warned", [('"4GiB"', True), ("0", False)])
def test_gpu_param_budget_under_deepspeed_warns(write, budget, warned):
    """DeepSpeed's offload_param moves every parameter (DeepSpeedZeroOffloadParamConfig, DeepSpeed
    0.19.8 zero/offload_config.py: device, nvme_path, buffer_count, buffer_size, max_in_cpu,
    pin_memory; no budget kept on the GPU): a budget written under deepspeed has no effect, and
    0, which `import` writes for a DeepSpeed config, says just that."""
    text = BASE + f'framework = "deepspeed"\n[offload]\nparams = true\ngpu_param_budget = {budget}\n'
    found = _warnings(write, text)
    assert [w["path"] for w in found] == (["offload.gpu_param_budget"] if warned else [])
    if warned:
        assert "offload_param moves every parameter" in found[0]["message"]
    assert _warnings(write, BASE + f"[offload]\nparams = true\ngpu_param_budget = {budget}\n") == []  # fsdp2 reads it


def test_a_set_flag_counts_as_written(write):
    found = _warnings(write, BASE, "--set", "zero.reduce_bucket_size=1000")
    assert [w["path"] for w in found] == ["zero.reduce_bucket_size"]
    assert _warnings(write, BASE, "--set", "zero.reduce_bucket_size=1000", "--framework", "deepspeed") == []


def test_defaults_do_not_warn(write):
    assert _warnings(write, BASE) == []


@pytest.mark.parametrize("value, message", [
    ("-5", "zero.sub_group_size: a count cannot be negative (got -5)"),
    ('"lots"', "zero.sub_group_size: not a count: 'lots'"),
])
def test_a_bad_sub_group_size_is_one_line_exit_2(write, value, message):
    """sub_group_size is a count of elements, 0 or more, as DeepSpeed's field is (zero/config.py
    line 182, `ge=0`); anything else is bad input: one line naming the file, line and key."""
    path = write("job.toml", BASE + f'framework = "deepspeed"\nsub_group_size = {value}\n')
    result = run_cli("estimate", path)
    assert result.code == 2
    assert len(result.err_lines) == 1 and result.err_lines[0].startswith(f"{path}:9: {message}")  # BASE opens with a blank line


# -- zero.sub_group_size, read by the deepspeed accounting ---------------------------------------
# llama-3-8b (transformers LlamaConfig: 32 layers, hidden 4,096, 8 KV heads of 128, MLP 14,336,
# vocabulary 128,256, untied head; 8,030,261,248 parameters) over dp 8: every tensor divides by
# 8, so a rank's partitions total 1,003,782,656 elements, of which the 65 RMSNorm weights (the
# vectors' group) hold 65 x 512 = 33,280 and the matrices 1,003,749,376.
MATRICES_8B = 1_003_782_656 - 33_280
EMBEDDING_8B = 128_256 * 4_096 // 8  # the largest tensor's partition (the head's too)


def _stage3_explain(*flags: str) -> dict:
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "3", "--framework",
                     "deepspeed", "--set", "train.seq_len=1024", "--set", "train.activation_checkpointing=full",
                     "--json", "--explain", *flags)
    assert result.code in (0, 1), result.err
    return result.json


def test_sub_group_size_sets_the_step_cast():
    """The step casts one sub-group's 16-bit gradients to fp32 at a time (stage3.py
    `_prepare_fp32_grad_for_sub_group`, lines 2683-2694): 2 + 4 bytes an element of the largest
    sub-group (DeepSpeed 0.19.8, deepspeed/runtime/zero/). A group no larger than
    sub_group_size stays whole (`_create_fp16_sub_groups`, line 1215), and at the default 1e9
    (zero/config.py line 182) the matrices reach it only at their last tensor, the head (line
    1226): one sub-group of 1,003,749,376. At 0 every tensor is its own (line 1226): the
    embedding's 65,667,072 is the largest. The step moment moves by the difference, with the
    moment's fragmentation allowance (docs/estimate.md)."""
    default = _stage3_explain()
    zero = _stage3_explain("--set", "zero.sub_group_size=0")
    allowance = default["assumptions"]["fragmentation_allowance"]
    step_default = default["devices"][0]["moments"]["step"]
    step_zero = zero["devices"][0]["moments"]["step"]
    assert step_default - step_zero == pytest.approx(6 * (MATRICES_8B - EMBEDDING_8B) * (1 + allowance), abs=1)
    # Written as DeepSpeed's default, it changes nothing.
    assert _stage3_explain("--set", "zero.sub_group_size=1e9") == default


def test_a_large_sub_group_size_moves_the_peak_to_the_step():
    """sub_group_size 1e12 (set so that a model's groups are never cut) keeps llama-3-70b's
    matrices whole: 70,553,706,496 parameters (transformers' count) over dp 8, less the 161
    RMSNorm weights of 8,192 (80 layers x 2 and the final one), 8,819,048,448 elements a rank,
    cast at 2 + 4 bytes each (stage3.py lines 1215 and 2683-2694). With recomputation that step
    is the rank's peak; at the default 1e9 it is not."""
    flags = ("--set", "model.preset=llama-3-70b", "--set", "offload.strategy=conservative")
    big = _stage3_explain(*flags, "--set", "zero.sub_group_size=1e12")
    device = big["devices"][0]
    assert device["peak_moment"] == "step"
    terms = {t["label"]: t["bytes"] for t in device["terms"]["gpu.buffers"]}
    assert terms["fp32 gradients of one sub-group"] == 6 * (70_553_706_496 // 8 - 161 * 8_192 // 8)
    default = _stage3_explain(*flags)
    assert default["devices"][0]["peak_moment"] != "step"
    assert big["peak_gpu_bytes"] > default["peak_gpu_bytes"]


def test_checkpoint_staging_is_the_largest_sub_group():
    """Writing a checkpoint copies one state tensor at a time to the host (core/host.py
    `checkpoint_staging`); at stage 3 DeepSpeed keeps one fp32 master tensor per sub-group
    (stage3.py lines 1110-1176), so the largest sub-group bounds it: 8 ranks x 4 bytes x the
    matrices' 1,003,749,376 at the default 1e9, x 65,667,072 (the embedding) at 0."""
    label = "checkpoint staging (the largest state tensor while written)"
    for value, largest in (("1e9", MATRICES_8B), ("0", EMBEDDING_8B)):
        doc = _stage3_explain("--set", "checkpoint.dir=ckpt", "--set", f"zero.sub_group_size={value}")
        assert doc["host"]["breakdown"][label] == 8 * 4 * largest


@pytest.mark.interop
@pytest.mark.parametrize("preset", ["llama-3-8b", "llama-3-70b", "mixtral-8x7b"])
@pytest.mark.parametrize("sub_group_size", [0, 1, 50_000_000, 123_456_789, 1_000_000_000, 10**12])
def test_sub_groups_are_deepspeeds(preset, sub_group_size):
    """core/deepspeed.py `stage3_sub_groups` against DeepSpeed 0.19.8's own
    `DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups` (stage3.py lines 1210-1233), run on
    stand-ins for the rank's parameters in each weight-decay group that answer
    `partition_numel()` (ceil(numel / dp), partition_parameters.py 1690-1696; measured in
    tests/test_deepspeed_real.py)."""
    from types import SimpleNamespace

    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3", reason="DeepSpeed is in the `interop` extra")
    from shardplan.core.deepspeed import ordered_params, stage3_sub_groups, weight_decay_groups
    from shardplan.core.stages import rank_params
    from shardplan.io.job import load_job

    dp = 8
    rp = rank_params(load_job(None, [("model.preset", preset)], env={}).shape, 1, 1, 0, 1, 0)
    optimizer = SimpleNamespace(sub_group_size=sub_group_size)
    theirs = []
    for group in weight_decay_groups(ordered_params(rp)):
        stand_ins = [SimpleNamespace(partition_numel=lambda n=-(-p.numel // dp): n) for p in group]
        for sub_group in stage3.DeepSpeedZeroOptimizer_Stage3._create_fp16_sub_groups(optimizer, stand_ins):
            theirs.append(sum(p.partition_numel() for p in sub_group))
    assert stage3_sub_groups(rp, dp, sub_group_size) == theirs


def test_what_deepspeed_does_not_run_warns(write):
    """Context parallel and hybrid sharding are counted by the estimate under any framework, but
    DeepSpeed's engine runs neither: it has no ring-attention context parallel (its sequence
    parallel is Ulysses, deepspeed/sequence/layer.py, an all-to-all over heads) and 0.19.8's
    zero/config.py (`extra="forbid"`) rejects MiCS's `mics_shard_size`, its only hybrid
    sharding. Each gets a warning under deepspeed, none under fsdp2."""
    cp = BASE.replace("dp = 4", "dp = 2\ncp = 2") + "[train]\nseq_len = 256\n"
    found = _warnings(write, cp.replace("stage = 3", 'stage = 3\nframework = "deepspeed"'))
    assert [w["path"] for w in found] == ["parallel.cp"]
    assert "Ulysses" in found[0]["message"] and "cp = 2" in found[0]["message"]
    assert not any("DeepSpeed" in w["message"] for w in _warnings(write, cp))
    hybrid = BASE.replace("dp = 4", "dp = 16").replace("stage = 3", "stage = 3\nhybrid = true") + \
        '[cluster]\nnodes = 2\ngpus_per_node = 8\n'
    found = _warnings(write, hybrid.replace("hybrid = true", 'hybrid = true\nframework = "deepspeed"'))
    assert [w["path"] for w in found] == ["zero.hybrid"]
    assert "every data-parallel rank" in found[0]["message"]
    assert not any("DeepSpeed" in w["message"] for w in _warnings(write, hybrid))
