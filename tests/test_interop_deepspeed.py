"""Exported DeepSpeed configs read by DeepSpeed's own config class (the `interop` extra).

`deepspeed.runtime.config.DeepSpeedConfig` parses a config without a GPU; it asks
`deepspeed.comm` for the rank and takes the data-parallel size from the model-parallel unit
(`mpu.get_data_parallel_world_size()`, the interface Megatron-style codes hand to
`deepspeed.initialize`). The process group is stood in for (rank 0), nothing else.
"""

from __future__ import annotations

import json

import pytest

from conftest import run_cli
from interop_plans import PLANS
from shardplan.io.job import load_job

deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is in the `interop` extra")
ds_config = pytest.importorskip("deepspeed.runtime.config")

pytestmark = pytest.mark.interop


@pytest.fixture
def ds(deepspeed_parse):
    return deepspeed_parse


def exported(write, plan: str):
    """(DeepSpeed config, the validated job) of one of the shared plans."""
    path = write("job.toml", PLANS[plan])
    result = run_cli("export", path, "--to", "deepspeed", "--json")
    assert result.code == 0, result.err
    return result.json["config"], load_job(path).job


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deepspeed_reads_the_exported_config(write, ds, plan):
    config, job = exported(write, plan)
    par, zero, offload = job.parallel, job.zero, job.offload
    parsed = ds(config, par.dp)
    assert (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) \
        == (par.dp * par.micro_batch_size * par.num_microbatches, par.micro_batch_size, par.num_microbatches)
    assert parsed.zero_optimization_stage == zero.stage
    param, optimizer = parsed.zero_config.offload_param, parsed.zero_config.offload_optimizer
    assert (param is not None and param.device == "cpu") == offload.params
    assert (optimizer is not None and optimizer.device == "cpu") == (offload.optimizer or offload.grads)
    for state in (param, optimizer):
        if state is not None:
            assert state.pin_memory == offload.pin_memory
    assert parsed.zero_config.reduce_bucket_size == zero.reduce_bucket_size
    if zero.stage == 3:
        assert parsed.zero_config.prefetch_bucket_size == zero.prefetch_bucket_size
        assert parsed.zero_config.max_live_parameters == zero.max_live_parameters
        assert parsed.zero_config.param_persistence_threshold == zero.param_persistence_threshold
        assert parsed.zero_config.sub_group_size == zero.sub_group_size
    else:
        assert parsed.zero_config.allgather_bucket_size == zero.allgather_bucket_size
    precision = job.train.precision
    assert parsed.bfloat16_config.enabled == (precision in ("bf16-mixed", "bf16"))
    assert parsed.float16_config.enabled == (precision == "fp16-mixed")
    assert parsed.tensor_parallel_config.autotp_size == (par.tp if par.tp > 1 else 0)
    assert parsed.optimizer_name.lower() == ("sgd" if job.train.optimizer == "sgd" else "adamw")
    assert parsed.optimizer_params["lr"] == job.train.lr


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_deepspeed_infers_the_same_accumulation(write, ds, plan):
    """Given train_batch_size and the micro batch only, DeepSpeed derives the accumulation
    steps itself (config.py, `_set_batch_related_parameters`): the exported three agree."""
    config, job = exported(write, plan)
    two = {k: v for k, v in config.items() if k != "gradient_accumulation_steps"}
    assert ds(two, job.parallel.dp).gradient_accumulation_steps == config["gradient_accumulation_steps"]


def test_deepspeed_rejects_a_wrong_world(write, ds):
    """The check is live: the same config with another data-parallel size fails DeepSpeed's
    batch assertion."""
    config, _ = exported(write, "zero2_offload_fp16")
    with pytest.raises(AssertionError, match="train_batch_size is not equal"):
        ds(config, 3)


def test_deepspeed_tutorial_config_round_trips(write, ds):
    """DeepSpeed's ZeRO-Infinity tutorial config, imported and exported again, reads in
    DeepSpeed as the original does (https://www.deepspeed.ai/tutorials/zero/)."""
    from test_interop import DEEPSPEED_TUTORIAL_ZERO_INFINITY

    original = json.loads(DEEPSPEED_TUTORIAL_ZERO_INFINITY)
    path = write("ds.json", DEEPSPEED_TUTORIAL_ZERO_INFINITY)
    job = write("job.toml", run_cli("import", path, "--dp", "8", "--set", "model.preset=gpt2-xl").out)
    again = run_cli("export", job, "--to", "deepspeed", "--json").json["config"]
    mine = ds(again, 8).zero_config
    theirs = ds({**original, "train_micro_batch_size_per_gpu": 1}, 8).zero_config
    for key in ("stage", "prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold",
                "reduce_bucket_size", "sub_group_size"):
        assert getattr(mine, key) == getattr(theirs, key), key
    assert mine.offload_param.device == theirs.offload_param.device == "cpu"
    assert mine.offload_optimizer.device == theirs.offload_optimizer.device == "cpu"
