"""Exported torchtitan job configs read by torchtitan's own ConfigManager (the `interop` extra).

torchtitan 0.2.x: `ConfigManager().parse_args(["--job.config_file", F])` loads a TOML job
file into its `JobConfig` (unknown keys raise); `ParallelDims` checks the degrees against the
world size; torch's `get_schedule_class` resolves the pipeline schedule name;
`generate_llm_fqn_per_model_part` is torchtitan's own stage split.
"""

from __future__ import annotations

import os

import pytest

from conftest import run_cli
from interop_plans import PLANS
from shardplan.io.interop.torchtitan import FLAVORS, SCHEDULES, stage_fqns, torchtitan_split
from shardplan.io.job import load_job

config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
pytestmark = pytest.mark.interop


def parsed(write, plan: str):
    path = write("job.toml", PLANS[plan])
    result = run_cli("export", path, "--to", "torchtitan", "-o", write("tt.toml", ""))
    assert result.code == 0, result.err
    config = config_module.ConfigManager().parse_args(["--job.config_file", str(path).replace("job.toml", "tt.toml")])
    return config, load_job(path).job


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_torchtitan_reads_the_exported_config(write, plan):
    from torchtitan.distributed import ParallelDims

    config, job = parsed(write, plan)
    par, train = job.parallel, job.train
    p, t = config.parallelism, config.training
    dims = ParallelDims(dp_replicate=p.data_parallel_replicate_degree, dp_shard=p.data_parallel_shard_degree,
                        cp=p.context_parallel_degree, tp=p.tensor_parallel_degree, pp=p.pipeline_parallel_degree,
                        ep=1, etp=1, world_size=par.dp * par.tp * par.pp * par.cp)
    assert dims.dp_replicate * dims.dp_shard == par.dp
    assert (dims.tp, dims.pp, dims.cp) == (par.tp, par.pp, par.cp)
    # FSDP applies when the shard degree (or cp) is above 1 (parallel_dims.py, fsdp_enabled);
    # reshard_after_forward: "default" reshards unless pipeline parallel is on.
    if job.zero.stage >= 2:
        assert dims.fsdp_enabled or par.dp == 1
        policy = p.fsdp_reshard_after_forward
        assert (policy == "always" or (policy == "default" and par.pp == 1)) == (job.zero.stage == 3)
    assert dims.dp_replicate > 1 and dims.dp_shard > 1 if job.zero.hybrid else True
    # torchtitan's trainer: accumulation = global / (local * dp); pipeline microbatches =
    # local / pipeline_parallel_microbatch_size (train.py, pipeline_parallel.py)
    accumulation = t.global_batch_size // (t.local_batch_size * par.dp)
    assert t.global_batch_size % (t.local_batch_size * par.dp) == 0
    if par.pp > 1:
        assert t.local_batch_size // p.pipeline_parallel_microbatch_size * accumulation == par.num_microbatches
        assert p.pipeline_parallel_microbatch_size == par.micro_batch_size
        from torch.distributed.pipelining.schedules import get_schedule_class
        from shardplan.runtime.pipeline import TORCH_SCHEDULES

        assert get_schedule_class(p.pipeline_parallel_schedule) is TORCH_SCHEDULES[par.pipeline_schedule]
    else:
        assert (t.local_batch_size, accumulation) == (par.micro_batch_size, par.num_microbatches)
    assert t.seq_len == train.seq_len and t.steps == train.steps
    expected_ac = train.activation_checkpointing
    assert config.activation_checkpoint.mode == expected_ac
    mixed = {"bf16-mixed": ("float32", "bfloat16"), "bf16": ("bfloat16", "bfloat16"), "fp32": ("float32", "float32")}
    if train.precision in mixed:
        assert (t.dtype, t.mixed_precision_param) == mixed[train.precision]
    assert t.enable_cpu_offload == job.offload.params
    assert config.optimizer.lr == train.lr and config.debug.seed == train.seed
    if job.checkpoint.dir:
        c = config.checkpoint
        # torchtitan saves to {job.dump_folder}/{folder} (components/checkpoint.py, CheckpointManager:
        # os.path.join(base_folder, folder) with base_folder = job.dump_folder).
        folder = os.path.normpath(os.path.join(config.job.dump_folder, c.folder))
        assert (c.enable, folder, c.interval, c.keep_latest_k) == (True, os.path.normpath(job.checkpoint.dir),
                                                                   job.checkpoint.every, job.checkpoint.keep)


# Hybrid ZeRO-3 whose context-parallel groups span nodes: tp 4 x cp 4 on nodes of 8 GPUs
# leaves 2 context-parallel ranks of each group in a node, the plan's shard group.
HYBRID_CP_ACROSS_NODES = """
[model]
preset = "llama-3-8b"
[zero]
framework = "zero-paper"
stage = 3
hybrid = true
[parallel]
dp = 2
tp = 4
cp = 4
[train]
seq_len = 8192
[cluster]
preset = "h100-80gb"
nodes = 4
"""


def test_hybrid_sharding_smaller_than_cp_is_said(write):
    """torchtitan's FSDP shards over dp_shard x cp (ParallelDims' "dp_shard_cp" mesh), which no
    dp_shard makes 2 when cp is 4: the export writes the nearest, dp_shard 1, which ParallelDims
    takes for the 32 ranks, and says so (it crashed the accelerate export, and this one wrote it
    without a word)."""
    from torchtitan.distributed import ParallelDims

    path = write("job.toml", HYBRID_CP_ACROSS_NODES)
    out = write("tt.toml", "")
    result = run_cli("export", path, "--to", "torchtitan", "-o", out)
    assert result.code == 0, result.err
    (note,) = [line for line in result.err_lines if line.startswith("export: zero.hybrid:")]
    assert "the 4 context-parallel ranks span nodes" in note and "over the 2 data- and context-parallel" in note
    p = config_module.ConfigManager().parse_args(["--job.config_file", out]).parallelism
    assert (p.data_parallel_replicate_degree, p.data_parallel_shard_degree, p.context_parallel_degree) == (2, 1, 4)
    dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=4, tp=4, pp=1, ep=1, etp=1, world_size=32)
    assert dims.fsdp_enabled  # FSDP over the context-parallel ranks


def test_torchtitan_stage_split_is_shardplans(write):
    """The exported module_fqns_per_model_part put the layers where shardplan's estimate and
    run put them (core/pipeline.py), in torchtitan's module names."""
    from shardplan.core.pipeline import split_layers

    config, job = parsed(write, "pp4_interleaved")
    parts = config.parallelism.module_fqns_per_model_part
    assert [sum(n.startswith("layers.") for n in part) for part in parts] == split_layers(80, 8, 9, 9)


@pytest.mark.parametrize("stages,layers,first,last", [
    (s, n, a, b) for s in (2, 3, 4, 8, 16) for n in (16, 32, 61, 80, 126) for a in (0, 1, 2) for b in (0, 1, 2)
    if n + a + b >= s and (n + a + b) // s >= max(a, b, 1)
])
def test_torchtitan_split_equals_torchtitans(stages, layers, first, last):
    """shardplan reads torchtitan's default split with its own copy of the rule; it must give
    torchtitan's stages exactly (`generate_llm_fqn_per_model_part`)."""
    from torchtitan.distributed.pipeline_parallel import generate_llm_fqn_per_model_part

    theirs = generate_llm_fqn_per_model_part(stages, layers, first, last)
    assert stage_fqns(torchtitan_split(stages, layers, first, last)) == theirs


@pytest.mark.parametrize("name,flavor", sorted(FLAVORS))
def test_flavors_are_the_presets(name, flavor):
    """A torchtitan flavor maps to a preset with the same parameter count: torchtitan's model
    built on the meta device against shardplan's count."""
    import torch
    from torchtitan.models.llama3 import Transformer, llama3_args

    from shardplan.core.params import count_params
    from shardplan.io.job import load_job as load

    with torch.device("meta"):
        model = Transformer(llama3_args[flavor])
    theirs = sum(p.numel() for p in model.parameters())
    resolved = load(None, [("model.preset", FLAVORS[(name, flavor)])])
    assert count_params(resolved.shape).total == theirs


def test_schedule_names_resolve():
    from torch.distributed.pipelining.schedules import get_schedule_class

    for name in SCHEDULES.values():
        get_schedule_class(name)
