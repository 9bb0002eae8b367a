"""Exported accelerate configs read by accelerate's own launcher and plugins (the `interop` extra).

The path a config takes in `accelerate launch --config_file F`: the launch parser, the
config-file loader merging F into the arguments (`_validate_launch_command`), the
environment handed to the workers (`prepare_multi_gpu_env`), and in the worker
`FullyShardedDataParallelPlugin()` and `ParallelismConfig()` built from that environment.
"""

from __future__ import annotations

import pytest

from conftest import run_cli
from interop_plans import PLANS
from shardplan.io.job import load_job

accelerate = pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
pytestmark = pytest.mark.interop


def launched(write, plan: str, monkeypatch):
    """(the worker's environment, the validated job) for one of the shared plans."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = write("job.toml", PLANS[plan])
    out = path.replace("job.toml", "accelerate.yaml")
    result = run_cli("export", path, "--to", "accelerate", "-o", out)
    assert result.code == 0, result.err
    args = launch_command_parser().parse_args(["--config_file", out, "train.py"])
    args, _, _ = _validate_launch_command(args)
    env = prepare_multi_gpu_env(args)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env, args, load_job(path).job


def accepted_by_accelerator(num_processes: int) -> None:
    """`ParallelismConfig()` from the worker's environment passes the validation `Accelerator`
    runs on it (accelerate/parallelism_config.py, `_validate_accelerator`: total_size must equal
    num_processes) for an FSDP2 accelerator of that many processes."""
    from types import SimpleNamespace

    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import DistributedType

    config = ParallelismConfig()
    accelerator = SimpleNamespace(multi_device=True, num_processes=num_processes, is_fsdp2=True,
                                  distributed_type=DistributedType.FSDP)
    config._validate_accelerator(accelerator)  # raises ValueError on a mismatch
    assert config.total_size == num_processes


def test_accelerate_takes_a_pipeline_plan(write, monkeypatch):
    """llama-2-70b-3d (dp 2 x tp 8 x pp 4): accelerate has no pipeline parallel, so the 64
    processes' ParallelismConfig must still multiply to 64 (it wrote dp_shard 2 x tp 8 = 16)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    out = write("x", "").replace("x", "accelerate.yaml")
    result = run_cli("export", "llama-2-70b-3d", "--to", "accelerate", "-o", out)
    assert result.code == 0, result.err
    assert "export: parallel.pp: accelerate has no pipeline parallel: the 4 stages' ranks are written as data " \
           "parallel (8 data-parallel ranks of 64 processes)" in result.err_lines
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", out, "train.py"]))
    for key, value in prepare_multi_gpu_env(args).items():
        monkeypatch.setenv(key, value)
    assert args.num_processes == 64
    accepted_by_accelerator(64)


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_accelerate_reads_the_exported_config(write, plan, monkeypatch):
    env, args, job = launched(write, plan, monkeypatch)
    par, zero, off, train = job.parallel, job.zero, job.offload, job.train
    world = par.dp * par.tp * par.pp * par.cp
    assert args.num_processes == world
    mixed = {"bf16-mixed": "bf16", "bf16": "bf16", "fp16-mixed": "fp16", "fp32": "no"}[train.precision]
    assert env["ACCELERATE_MIXED_PRECISION"] == mixed
    if "PARALLELISM_CONFIG_DP_SHARD_SIZE" in env:  # accelerate's own check of the sizes at Accelerator()
        accepted_by_accelerator(args.num_processes)
    if par.pp > 1:  # accelerate has no pipeline parallel: the export names it on stderr
        return
    if zero.stage == 0 and par.tp == 1 and par.cp == 1:
        assert "ACCELERATE_USE_FSDP" not in env
        return
    from accelerate import FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2
    assert plugin.reshard_after_forward == (zero.stage == 3)
    assert (plugin.cpu_offload is not None and type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy") \
        == off.params
    assert plugin.activation_checkpointing == (train.activation_checkpointing != "none")
    if zero.min_num_params:
        assert plugin.min_num_params == zero.min_num_params
    if zero.hybrid or par.tp > 1 or par.cp > 1:
        sizes = {k: int(env[f"PARALLELISM_CONFIG_{k.upper()}_SIZE"]) for k in ("dp_replicate", "dp_shard", "tp", "cp")}
        assert sizes["dp_replicate"] * sizes["dp_shard"] == par.dp
        assert (sizes["tp"], sizes["cp"]) == (par.tp, par.cp)
        if zero.hybrid:
            assert sizes["dp_shard"] * par.tp * par.cp == job.cluster.gpus_per_node  # one node's ranks
        if par.tp == 1:  # accelerate's tensor parallel handler needs transformers
            from accelerate.parallelism_config import ParallelismConfig

            config = ParallelismConfig()
            assert (config.dp_replicate_size, config.dp_shard_size, config.cp_size) == (
                sizes["dp_replicate"], sizes["dp_shard"], par.cp)
            assert config.total_size == world


def test_hybrid_sharding_smaller_than_cp_is_said(write, monkeypatch):
    """accelerate's FSDP2 shards over dp_shard x cp, so a plan whose hybrid shard group (2 ranks
    of a node) is smaller than its cp (4, spanning nodes) is written as dp_shard 1 with a note;
    it ended in an internal error (a division by zero). The launcher's ParallelismConfig of
    the written file multiplies to the 32 processes."""
    from test_interop_torchtitan import HYBRID_CP_ACROSS_NODES
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_multi_gpu_env

    path = write("job.toml", HYBRID_CP_ACROSS_NODES)
    out = path.replace("job.toml", "accelerate.yaml")
    result = run_cli("export", path, "--to", "accelerate", "-o", out)
    assert result.code == 0, result.err
    (note,) = [line for line in result.err_lines if line.startswith("export: zero.hybrid:")]
    assert "accelerate shards with FSDP over dp_shard x cp" in note
    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", out, "train.py"]))
    env = prepare_multi_gpu_env(args)
    sizes = {k: int(env[f"PARALLELISM_CONFIG_{k.upper()}_SIZE"]) for k in ("dp_replicate", "dp_shard", "tp", "cp")}
    assert sizes == {"dp_replicate": 2, "dp_shard": 1, "tp": 4, "cp": 4}
    assert args.num_processes == 32


def test_accelerate_config_loader_reads_every_key(write):
    """accelerate's own loader accepts the file (its ClusterConfig rejects unknown keys)."""
    from accelerate.commands.config.config_args import load_config_from_file

    path = write("job.toml", PLANS["zero3_hybrid_offload"])
    out = path.replace("job.toml", "accelerate.yaml")
    assert run_cli("export", path, "--to", "accelerate", "-o", out).code == 0
    config = load_config_from_file(out)
    assert config.distributed_type == "FSDP" and config.num_machines == 2 and config.num_processes == 16
    assert config.fsdp_config["fsdp_version"] == 2


def test_a_deepspeed_job_exported_to_accelerate_says_it_becomes_fsdp2():
    """accelerate runs DeepSpeed from a config file (`distributed_type: DEEPSPEED` with
    `deepspeed_config_file`, accelerate/utils/dataclasses.py DeepSpeedPlugin); this export writes
    the FSDP2 plugin, so a job planned for DeepSpeed's engine (as an imported accelerate
    DeepSpeed config is) says so instead of changing engine without a word."""
    from conftest import run_cli

    result = run_cli("export", "llama-3-8b-h100", "--zero", "2", "--framework", "deepspeed", "--to", "accelerate",
                     "--json")
    assert result.code == 0, result.err
    assert result.json["config"]["distributed_type"] == "FSDP"
    notes = {note["path"]: note["message"] for note in result.json["notes"]}
    assert notes["zero.framework"].startswith("the job plans DeepSpeed's engine; written for FSDP2")
    fsdp = run_cli("export", "llama-3-8b-h100", "--zero", "2", "--to", "accelerate", "--json")
    assert "zero.framework" not in {note["path"] for note in fsdp.json["notes"]}
