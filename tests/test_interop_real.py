"""`shardplan import` / `export` on the configurations users have.

Each config below stands for a configuration file of a public repository, named beside it
with its path and commit; it is written here in miniature (a dict dumped to JSON, YAML or
TOML, or a short literal), holding only the keys the behaviour under test turns on, with
their values as that file gives them. What the tour of those files found:

- DeepSpeed refuses `reduce_bucket_size: 0`, a key given twice and the sections 0.19 removed
  (`sparse_attention`); the activation_checkpointing keys shardplan does not model are named;
- accelerate's Ulysses sequence parallelism (`parallelism_config_sp_size`) is context
  parallel, and leaves the sequence ranks out of DeepSpeed's data-parallel world; HSDP keeps
  its shard group; a config without num_processes takes --world (or --dp) as the launch does;
- gpt-neox's YAML opens with `{` (flow style) and is not reported as bad JSON.

What is read is compared with what the framework itself reads from the same config:
DeepSpeed 0.19.8's `DeepSpeedConfig`, torchtitan 0.2.2's `ConfigManager`, accelerate 1.15's
launcher (the `interop` extra; those tests are skipped with the reason where it is absent).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomli_w
import yaml

from conftest import run_cli

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TARGETS = ("deepspeed", "torchtitan", "accelerate", "megatron")


def as_json(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


def as_yaml(config: dict) -> str:
    return yaml.safe_dump(config, sort_keys=False)


def as_toml(config: dict) -> str:
    return tomli_w.dumps(config)


def line_of(text: str, needle: str) -> int:
    """The 1-based line of the one line of `text` that holds `needle` (where a note points)."""
    found = [number for number, line in enumerate(text.splitlines(), 1) if needle in line]
    assert len(found) == 1, (needle, found)
    return found[0]


# -- the configs ------------------------------------------------------------------------------
# DeepSpeed configs. Where a value is a float in the file (`1e9`), it is one here too: that is
# what json reads from it.

# huggingface/transformers tests/deepspeed/ds_config_zero3.json (61c7ec94b563d371cbafde35f3c6822049ebf131):
# ZeRO-3 with reduce_bucket_size 0, which DeepSpeed 0.19's DeepSpeedZeroConfig refuses (`Field(gt=0)`).
DS_REDUCE_BUCKET_0 = {
    "fp16": {"enabled": True},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "reduce_bucket_size": 0},
}

# huggingface/transformers tests/deepspeed/ds_config_zero3_bf16.json (a9c1721ff6eeba4729ba7760c6ec809c72935b2b):
# "auto" (which the Hugging Face Trainer fills in) for the precision ("bfloat16", DeepSpeed's
# other name for bf16), lr, the bucket and the batch; ZeRO-3 offloading both to pinned CPU
# memory; stage3_max_live_parameters 1e9, the one number it gives.
DS_AUTO_BF16 = {
    "bfloat16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9},
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

# microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs8_zero0_gas3.json
# (38327e07f6cd39b63418f60cedd1651b0be3e7c3): micro batch 8 x 3 accumulation steps, stage 0
# with bucket sizes anyway, and contiguous_memory_optimization: true, which shardplan does not model.
DS_ZERO0_GAS3 = {
    "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 3,
    "zero_optimization": {"stage": 0, "reduce_bucket_size": 7000000, "allgather_bucket_size": 7000000},
    "fp16": {"enabled": True},
    "activation_checkpointing": {"partition_activations": True, "contiguous_memory_optimization": True},
}

# microsoft/DeepSpeed tests/model/Megatron_GPT2/ds_config_func_bs8_zero2_offload.json (38327e07):
# a global batch of 8 (so 64 GPUs are too many for it), ZeRO-2 with the deprecated `cpu_offload`,
# fp16, partitioned activation checkpoints (read as full checkpointing).
DS_ZERO2_CPU_OFFLOAD = {
    "train_batch_size": 8,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 7000000, "allgather_bucket_size": 7000000,
                          "cpu_offload": True},
    "fp16": {"enabled": True},
    "activation_checkpointing": {"partition_activations": True},
}

# microsoft/DeepSpeed tests/hybrid_engine/hybrid_engine_config.json (38327e07): parameter
# offload at ZeRO stage 0, which DeepSpeed 0.19.8 accepts and ignores (it reads offload_param on
# the stage-3 path only: deepspeed/runtime/engine.py:2655-2688, 2731, 2773).
DS_STAGE0_PARAM_OFFLOAD = {
    "train_batch_size": 32,
    "train_micro_batch_size_per_gpu": 2,
    "zero_optimization": {"stage": 0, "offload_param": {"device": "cpu"}},
    "fp16": {"enabled": True},
}

# microsoft/DeepSpeedExamples training/BingBertSquad/deepspeed_bsz24_config.json
# (83757d9c937daabd1089a08051061706cb73900d): 24 = micro 3 x the world x accumulation, fp16, no ZeRO.
DS_BSZ24 = {
    "train_batch_size": 24,
    "train_micro_batch_size_per_gpu": 3,
    "optimizer": {"type": "Adam", "params": {"lr": 3e-5}},
    "fp16": {"enabled": True},
}

# microsoft/DeepSpeedExamples training/pipeline_parallelism/ds_config.json (83757d9c): the
# batch keys alone (256 = micro 8 x ...), no precision section: fp32.
DS_PIPELINE = {
    "train_batch_size": 256,
    "train_micro_batch_size_per_gpu": 8,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
}

# microsoft/DeepSpeedExamples training/imagenet/config/ds_fp16_z1_config.json (83757d9c):
# 256 with one accumulation step (the micro batch is derived), Adam at lr 0.001, ZeRO-1, fp16.
DS_FP16_Z1 = {
    "train_batch_size": 256,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "Adam", "params": {"lr": 0.001}},
    "zero_optimization": {"stage": 1},
    "fp16": {"enabled": True},
}

# huggingface/accelerate examples/deepspeed_config_templates/zero_stage3_offload_config.json
# (16cb6eb80dd9aa8b4df1a63ef57863e455d53b83): ZeRO-3 offloading both, fp16, "auto" batch and bucket.
DS_ZERO3_OFFLOAD_AUTO = {
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True},
                          "reduce_bucket_size": "auto", "stage3_max_live_parameters": 1e9},
    "gradient_accumulation_steps": 1,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}

# microsoft/DeepSpeedExamples training/bing_bert/deepspeed_bsz64k_lamb_config_seq128.json
# (83757d9c): 65536 = micro 64 x 128 steps x 8 GPUs, and a `sparse_attention` section, which
# DeepSpeed 0.19 removed (runtime/config.py, _REMOVED_TOP_LEVEL_CONFIG_KEYS) and refuses.
DS_SPARSE_ATTENTION = {
    "train_batch_size": 65536,
    "train_micro_batch_size_per_gpu": 64,
    "optimizer": {"type": "Lamb", "params": {"lr": 11e-3}},
    "fp16": {"enabled": True},
    "sparse_attention": {"mode": "fixed", "block": 16},
}

# huggingface/accelerate examples/deepspeed_config_templates/zero_stage1_config.json (16cb6eb8):
# ZeRO-1 with allgather_bucket_size 2e8, fp16, AdamW, "auto" batch; what the YAML below names.
DS_ZERO1_TEMPLATE = {
    "fp16": {"enabled": True},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
    "zero_optimization": {"stage": 1, "allgather_bucket_size": 2e8, "reduce_bucket_size": "auto"},
    "gradient_accumulation_steps": 1,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
# huggingface/accelerate examples/config_yaml_templates/deepspeed.yaml (16cb6eb8): 2 processes,
# and the DeepSpeed file above by its path from the YAML's folder.
ACC_DEEPSPEED_TEMPLATE = {
    "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"deepspeed_config_file": "../deepspeed_config_templates/zero_stage1_config.json",
                         "zero3_init_flag": False},
    "num_processes": 2,
}

# huggingface/accelerate examples/alst_ulysses_sequence_parallelism/sp-alst.ds-config.json and
# sp-alst.accelerate-config.yml (16cb6eb8): 4 processes with a DeepSpeed file (ZeRO-3, bf16,
# "auto" batch) named by the bare file name, which accelerate opens from the working directory.
DS_ALST = {
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 3},
    "gradient_accumulation_steps": 1,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
}
ACC_ALST = {
    "deepspeed_config": {"deepspeed_config_file": "sp-alst.ds-config.json", "zero3_init_flag": False},
    "distributed_type": "DEEPSPEED",
    "num_machines": 1,
    "num_processes": 4,
}

# accelerate configs.

# huggingface/trl examples/accelerate_configs/alst_ulysses_4gpu.yaml (f2cd57710ae345ea6428ae95363267fcf38a3dc8):
# DeepSpeed ZeRO-3 over 4 processes = dp_shard 2 x Ulysses sp 2 (ParallelismConfig.total_size
# counts sp); sp_backend deepspeed, which accelerate needs for sp.
ULYSSES_SIZES = {
    "parallelism_config_dp_replicate_size": 1,
    "parallelism_config_dp_shard_size": 2,
    "parallelism_config_tp_size": 1,
    "parallelism_config_sp_size": 2,
    "parallelism_config_sp_backend": "deepspeed",
}
ACC_ULYSSES = {
    "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "none", "offload_param_device": "none"},
    "distributed_type": "DEEPSPEED",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 4,
    "parallelism_config": ULYSSES_SIZES,
}

# huggingface/accelerate examples/torch_native_parallelism/configs/tp_hsdp.yaml (16cb6eb8):
# FSDP2 over 8 processes as 2 replicas x 2 shard ranks x tp 2, on one machine.
ACC_TP_HSDP = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_reshard_after_forward": True, "fsdp_version": 2},
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
    "parallelism_config": {"parallelism_config_cp_size": 1, "parallelism_config_dp_replicate_size": 2,
                           "parallelism_config_dp_shard_size": 2, "parallelism_config_tp_size": 2},
}

# huggingface/accelerate examples/torch_native_parallelism/configs/cp.yaml (16cb6eb8): FSDP2
# with activation checkpointing, cp 8 over 8 processes, bf16.
ACC_CP = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_activation_checkpointing": True, "fsdp_reshard_after_forward": True, "fsdp_version": 2},
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
    "parallelism_config": {"parallelism_config_cp_size": 8, "parallelism_config_dp_replicate_size": 1,
                           "parallelism_config_dp_shard_size": 1, "parallelism_config_tp_size": 1},
}

# huggingface/accelerate examples/slurm/fsdp_config.yaml (16cb6eb8): FSDP1 FULL_SHARD and no
# num_processes nor num_machines (its launch script passes --num_processes and --num_machines).
ACC_NO_NUM_PROCESSES = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_offload_params": False, "fsdp_sharding_strategy": "FULL_SHARD"},
}

# huggingface/trl examples/accelerate_configs/fsdp_qlora.yaml (e0c3b15cdf8434ba74bbdcc88a104dcc0a1eb543):
# FSDP1 FULL_SHARD with parameter offload over 8 processes, and four FSDP1 keys shardplan does
# not carry (prefetching, sync_module_states, use_orig_params).
ACC_FSDP1_QLORA = {
    "distributed_type": "FSDP",
    "fsdp_config": {"fsdp_backward_prefetch": "BACKWARD_PRE", "fsdp_forward_prefetch": False,
                    "fsdp_offload_params": True, "fsdp_sharding_strategy": "FULL_SHARD",
                    "fsdp_sync_module_states": True, "fsdp_use_orig_params": False},
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
}

# huggingface/trl examples/accelerate_configs/deepspeed_zero3.yaml (f2cd5771): inline DeepSpeed
# ZeRO-3 without offload, bf16, 8 processes.
ACC_DEEPSPEED_ZERO3 = {
    "deepspeed_config": {"offload_optimizer_device": "none", "offload_param_device": "none", "zero_stage": 3},
    "distributed_type": "DEEPSPEED",
    "mixed_precision": "bf16",
    "num_machines": 1,
    "num_processes": 8,
}

# torchtitan job configs (release tags v0.2.2, 73a0e6979dd10b6b1904098eb3c8f62c18ab87ce, and
# v0.1.0, f7084fc78567f865d0c411f2c7b9bbbef6b155ac): what shardplan reads of them. Each leaves
# the data-parallel size to the world (data_parallel_shard_degree = -1).

# pytorch/torchtitan torchtitan/models/llama3/train_configs/llama3_8b.toml (v0.2.2): local batch 1
# of 8192 tokens, lr 3e-4, 1000 steps, selective (op) activation checkpointing.
TT_LLAMA3_8B = {
    "model": {"name": "llama3", "flavor": "8B"},
    "optimizer": {"name": "AdamW", "lr": 3e-4},
    "training": {"local_batch_size": 1, "seq_len": 8192, "steps": 1000},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "context_parallel_degree": 1},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
}

# pytorch/torchtitan torchtitan/models/llama3/train_configs/llama3_70b.toml (v0.2.2): tp 8 of
# 64 GPUs, local batch 8, lr 1.5e-4, full activation checkpointing.
TT_LLAMA3_70B = {
    "model": {"name": "llama3", "flavor": "70B"},
    "optimizer": {"name": "AdamW", "lr": 1.5e-4},
    "training": {"local_batch_size": 8, "seq_len": 8192, "steps": 1000},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "tensor_parallel_degree": 8, "pipeline_parallel_degree": 1, "context_parallel_degree": 1},
    "activation_checkpoint": {"mode": "full"},
}

# pytorch/torchtitan torchtitan/models/deepseek_v3/train_configs/deepseek_v3_16b.toml (v0.2.2):
# expert parallel 8, which shardplan has no setting for; local batch 4 of 4096 tokens, lr 2.2e-4.
TT_DEEPSEEK_V3_16B = {
    "model": {"name": "deepseek_v3", "flavor": "16B"},
    "optimizer": {"name": "AdamW", "lr": 2.2e-4},
    "training": {"local_batch_size": 4, "seq_len": 4096, "steps": 1000},
    "parallelism": {"data_parallel_replicate_degree": 1, "data_parallel_shard_degree": -1,
                    "tensor_parallel_degree": 1, "pipeline_parallel_degree": 1, "expert_parallel_degree": 8},
    "activation_checkpoint": {"mode": "selective", "selective_ac_option": "op"},
}

# pytorch/torchtitan torchtitan/models/llama3/train_configs/llama3_70b.toml (v0.1.0): the names
# 0.2 changed, `[checkpoint] enable_checkpoint` and a top-level `[float8]` table, with tp 8.
TT_0_1_LLAMA3_70B = {
    "model": {"name": "llama3", "flavor": "70B"},
    "optimizer": {"name": "AdamW", "lr": 1.5e-4},
    "training": {"local_batch_size": 8, "seq_len": 8192, "steps": 1000},
    "parallelism": {"data_parallel_shard_degree": -1, "tensor_parallel_degree": 8},
    "checkpoint": {"enable_checkpoint": False},
    "activation_checkpoint": {"mode": "full"},
    "float8": {"enable_fsdp_float8_all_gather": False},
}

# EleutherAI/gpt-neox configs/llama2/7B.yml (ea7aefd8f8e183256992d9fede4d7c71a46d67a5): YAML in
# flow style, so it opens with `{`, with `#` comments and a trailing comma: not JSON.
NEOX_FLOW_YAML = """{
  "pipe_parallel_size": 1,
  "model_parallel_size": 1,

  # model settings
  "num_layers": 32,
  "hidden_size": 4096,
}
"""


# -- helpers ----------------------------------------------------------------------------------
@dataclass
class Case:
    """Files to write (the first is the one imported), the flags a user gives with it (a
    DeepSpeed config and torchtitan's data_parallel_shard_degree = -1 name no world size),
    and the exit code of `shardplan import`."""

    files: dict[str, str]
    flags: tuple[str, ...] = ()
    code: int = 0

    def write(self, root: Path) -> Path:
        for name, text in self.files.items():
            path = root / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
        return root / next(iter(self.files))


WORLD_8 = ("--world", "8")
CASES = {
    "deepspeed-reduce-bucket-0": Case({"ds.json": as_json(DS_REDUCE_BUCKET_0)}, WORLD_8, 2),
    "deepspeed-auto-bf16": Case({"ds.json": as_json(DS_AUTO_BF16)}, WORLD_8),
    "deepspeed-zero0-accumulation": Case({"ds.json": as_json(DS_ZERO0_GAS3)}, WORLD_8),
    "deepspeed-zero2-cpu-offload": Case({"ds.json": as_json(DS_ZERO2_CPU_OFFLOAD)}, WORLD_8),
    "deepspeed-stage0-param-offload": Case({"ds.json": as_json(DS_STAGE0_PARAM_OFFLOAD)}, WORLD_8),
    "deepspeed-batch-24": Case({"ds.json": as_json(DS_BSZ24)}, WORLD_8),
    "deepspeed-batch-keys-only": Case({"ds.json": as_json(DS_PIPELINE)}, WORLD_8),
    "deepspeed-zero1-fp16": Case({"ds.json": as_json(DS_FP16_Z1)}, WORLD_8),
    "deepspeed-zero3-offload-auto": Case({"ds.json": as_json(DS_ZERO3_OFFLOAD_AUTO)}, WORLD_8),
    "deepspeed-removed-section": Case({"ds.json": as_json(DS_SPARSE_ATTENTION)}, WORLD_8),
    # the DeepSpeed files accelerate's YAMLs name, on their own and without a world
    "deepspeed-zero1-auto-batch-no-world": Case({"ds.json": as_json(DS_ZERO1_TEMPLATE)}),
    "deepspeed-zero3-auto-batch-no-world": Case({"ds.json": as_json(DS_ALST)}),
    "accelerate-ulysses": Case({"acc.yaml": as_yaml(ACC_ULYSSES)}),
    "accelerate-tp-hsdp": Case({"acc.yaml": as_yaml(ACC_TP_HSDP)}),
    "accelerate-cp": Case({"acc.yaml": as_yaml(ACC_CP)}),
    "accelerate-no-num-processes": Case({"acc.yaml": as_yaml(ACC_NO_NUM_PROCESSES)}),
    "accelerate-fsdp1-qlora": Case({"acc.yaml": as_yaml(ACC_FSDP1_QLORA)}),
    "accelerate-inline-deepspeed": Case({"acc.yaml": as_yaml(ACC_DEEPSPEED_ZERO3)}),
    "accelerate-deepspeed-file-by-relative-path": Case({
        "examples/config_yaml_templates/deepspeed.yaml": as_yaml(ACC_DEEPSPEED_TEMPLATE),
        "examples/deepspeed_config_templates/zero_stage1_config.json": as_json(DS_ZERO1_TEMPLATE)}),
    "accelerate-deepspeed-file-by-name": Case({"alst/sp-alst.accelerate-config.yml": as_yaml(ACC_ALST),
                                               "alst/sp-alst.ds-config.json": as_json(DS_ALST)}),
    "torchtitan-0.2-llama3-8b": Case({"tt.toml": as_toml(TT_LLAMA3_8B)}, WORLD_8),
    "torchtitan-0.2-llama3-70b": Case({"tt.toml": as_toml(TT_LLAMA3_70B)}, ("--world", "64")),
    "torchtitan-0.2-deepseek-v3": Case({"tt.toml": as_toml(TT_DEEPSEEK_V3_16B)}, ("--world", "64")),
    "torchtitan-0.1-llama3-70b": Case({"tt.toml": as_toml(TT_0_1_LLAMA3_70B)}, ("--world", "64")),
    "gpt-neox-flow-yaml": Case({"7B.yml": NEOX_FLOW_YAML}, (), 2),
}


def imported_job(path, *flags: str) -> dict:
    result = run_cli("import", str(path), "--json", *flags)
    assert result.code == 0, result.err
    return result.json["job"]


def notes_of(path, *flags: str) -> list[str]:
    return [line for line in run_cli("import", str(path), *flags).err_lines if line.startswith("import: ")]


# -- every config -----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(CASES))
def test_every_config_is_imported_or_refused_in_one_line_and_exports(tmp_path, name):
    """Every config is read (exit 0) or refused in one line (exit 2, with the error document
    on stdout under --json); what it reads exports to every target without a traceback
    (CONTRACT: bad input never prints one)."""
    case = CASES[name]
    path = case.write(tmp_path)
    result = run_cli("import", str(path), *case.flags)
    assert "Traceback" not in result.err
    assert result.code == case.code, result.err
    as_json_doc = run_cli("import", str(path), "--json", *case.flags)
    assert as_json_doc.code == case.code
    if case.code == 2:
        assert len(result.err_lines) == 1 and result.err_lines[0].startswith(str(path)), result.err
        assert len(as_json_doc.json["error"]["problems"]) == 1
        return
    assert set(as_json_doc.json) >= {"format", "job", "notes"}
    job = tmp_path / "job.toml"
    assert run_cli("import", str(path), *case.flags, "--set", "model.preset=llama-3-8b", "-o", str(job)).code == 0
    for target in TARGETS:
        exported = run_cli("export", str(job), "--to", target, "--json")
        assert "Traceback" not in exported.err
        assert exported.code == 0, (target, exported.err)


# -- DeepSpeed: what shardplan reads is what DeepSpeedConfig reads ---------------------------
def as_deepspeed_reads(parsed) -> dict:
    """The plan's keys as DeepSpeed reads them from a config."""
    zero = parsed.zero_config
    read = {
        "batch": (parsed.train_batch_size, parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps),
        "stage": parsed.zero_optimization_stage,
        "precision": "bf16-mixed" if parsed.bfloat16_config.enabled else
                     "fp16-mixed" if parsed.float16_config.enabled else "fp32",
        "offload_optimizer": zero.offload_optimizer is not None and zero.offload_optimizer.device != "none",
        "offload_param": zero.offload_param is not None and zero.offload_param.device != "none",
    }
    if parsed.zero_optimization_stage:
        read["reduce_bucket_size"] = zero.reduce_bucket_size
        if parsed.zero_optimization_stage < 3:
            read["allgather_bucket_size"] = zero.allgather_bucket_size
    return read


def as_shardplan_reads(job: dict, defaults: dict) -> dict:
    par, zero, off, train = (job.get(t, {}) for t in ("parallel", "zero", "offload", "train"))
    micro, steps = par.get("micro_batch_size", 1), par.get("num_microbatches", 1)
    read = {
        "batch": (par["dp"] * micro * steps, micro, steps),
        "stage": zero.get("stage", 0),
        "precision": train["precision"],
        "offload_optimizer": off.get("optimizer", False),
        "offload_param": off.get("params", False),
    }
    if read["stage"]:
        # a key the config leaves out is DeepSpeed's default, and shardplan's (spec/job.py)
        read["reduce_bucket_size"] = zero.get("reduce_bucket_size", defaults["reduce_bucket_size"])
        if read["stage"] < 3:
            read["allgather_bucket_size"] = zero.get("allgather_bucket_size", defaults["allgather_bucket_size"])
    return read


# The DeepSpeed configs without "auto" (which only the Hugging Face Trainer fills in).
PLAIN_DEEPSPEED = {
    "zero0-accumulation": DS_ZERO0_GAS3,
    "zero2-cpu-offload": DS_ZERO2_CPU_OFFLOAD,
    "batch-24": DS_BSZ24,
    "batch-keys-only": DS_PIPELINE,
    "zero1-fp16": DS_FP16_Z1,
}


@pytest.mark.interop
@pytest.mark.parametrize("name", list(PLAIN_DEEPSPEED))
@pytest.mark.parametrize("world", [2, 8, 64])
def test_deepspeed_configs_are_read_as_deepspeed_reads_them(deepspeed_parse, write, name, world):
    """Over 2, 8 and 64 GPUs: the batch arithmetic (DeepSpeed derives the missing one of
    train_batch_size / micro batch / accumulation from the world), stage, precision, offload
    and bucket sizes are DeepSpeed's; where DeepSpeed refuses the world (its derived micro
    batch or accumulation is 0), so does shardplan, in one line."""
    from shardplan.spec.job import ZeroSpec

    source = PLAIN_DEEPSPEED[name]
    path = write("ds.json", as_json(source))
    try:
        parsed = deepspeed_parse(source, world)
    except (AssertionError, ValueError) as refused:  # DeepSpeed's batch checks are assertions
        result = run_cli("import", path, "--world", str(world))
        assert result.code == 2 and len(result.err_lines) == 1, (refused, result.err)
        assert ": train_batch_size: " in result.err_lines[0]
        return
    job = imported_job(path, "--world", str(world))
    assert as_shardplan_reads(job, ZeroSpec().model_dump()) == as_deepspeed_reads(parsed)


EXPORTABLE_DEEPSPEED = {**PLAIN_DEEPSPEED, "auto-bf16": DS_AUTO_BF16, "zero3-offload-auto": DS_ZERO3_OFFLOAD_AUTO}


@pytest.mark.interop
@pytest.mark.parametrize("name", list(EXPORTABLE_DEEPSPEED))
def test_deepspeed_reads_the_export_of_an_imported_config(deepspeed_parse, write, name):
    """import then export --to deepspeed: DeepSpeedConfig accepts the file, and it reads the
    plan as it reads the original (where the original has no "auto" for it to refuse)."""
    source = EXPORTABLE_DEEPSPEED[name]
    original = write("original.json", as_json(source))
    job = write("job.toml", "")
    assert run_cli("import", original, "--world", "8", "--set", "model.preset=gpt2", "-o", job).code == 0
    result = run_cli("export", job, "--to", "deepspeed", "--json")
    assert result.code == 0, result.err
    again = deepspeed_parse(result.json["config"], 8)
    if name in PLAIN_DEEPSPEED:
        assert as_deepspeed_reads(again) == as_deepspeed_reads(deepspeed_parse(source, 8))
    # and back: import of the export gives every key the first import read
    back = imported_job(write("ds.json", json.dumps(result.json["config"])), "--set", "model.preset=gpt2")
    first = tomllib.loads(open(job).read())
    for table in ("parallel", "zero", "offload", "train"):
        for key, value in first.get(table, {}).items():
            assert back[table][key] == value, f"{table}.{key}"


def test_reduce_bucket_size_zero_is_refused_as_deepspeed_refuses_it(write):
    """DS_REDUCE_BUCKET_0 (transformers' ds_config_zero3.json): reduce_bucket_size 0 was read as
    0 and exported as 0, which DeepSpeed then refused. It is refused at its line, and so is a
    job file that says 0 (DeepSpeed's bound is the job file's)."""
    text = as_json(DS_REDUCE_BUCKET_0)
    path = write("ds.json", text)
    result = run_cli("import", path, "--world", "8")
    assert result.err_lines == [f"{path}:{line_of(text, 'reduce_bucket_size')}: zero_optimization.reduce_bucket_size: "
                                "must be > 0 (got 0): DeepSpeed refuses it (zero/config.py, DeepSpeedZeroConfig)"]
    job = write("job.toml", '[model]\npreset = "gpt2"\n[parallel]\ndp = 2\n[zero]\nstage = 2\n'
                            "reduce_bucket_size = 0\n")
    exported = run_cli("export", job, "--to", "deepspeed")
    assert exported.code == 2 and exported.err_lines == [f"{job}:7: zero.reduce_bucket_size: must be >= 1 (got 0)"]


@pytest.mark.interop
def test_deepspeed_itself_refuses_reduce_bucket_size_zero(deepspeed_parse):
    """The refusal above, from DeepSpeed's own config class (DeepSpeedZeroConfig, `gt=0`)."""
    with pytest.raises(Exception, match="reduce_bucket_size"):
        deepspeed_parse(DS_REDUCE_BUCKET_0, 8)


def test_activation_checkpointing_keys_are_named_when_set(write):
    """DS_ZERO0_GAS3 (DeepSpeed's ds_config_func_bs8_zero0_gas3.json) sets
    contiguous_memory_optimization: true, which shardplan does not model; it was read silently.
    false, DeepSpeed's default (and what export writes), is not named."""
    text = as_json(DS_ZERO0_GAS3)
    path = write("ds.json", text)
    assert f"import: {path}:{line_of(text, 'contiguous_memory_optimization')}: " \
           "activation_checkpointing.contiguous_memory_optimization: not read: shardplan has no setting for it" \
           in notes_of(path, "--world", "8")
    default = {**DS_ZERO0_GAS3, "activation_checkpointing": {"contiguous_memory_optimization": False}}
    path = write("default.json", as_json(default))
    assert not [n for n in notes_of(path, "--world", "8") if "contiguous_memory_optimization" in n]


def test_auto_values_are_named_and_not_read(write):
    """DS_AUTO_BF16 (transformers' ds_config_zero3_bf16.json): every "auto" is named once,
    "bfloat16" is DeepSpeed's other name for bf16, and with it "auto" the plan is fp32."""
    text = as_json(DS_AUTO_BF16)
    path = write("ds.json", text)
    job = imported_job(path, "--world", "8")
    assert job["zero"] == {"framework": "deepspeed", "stage": 3, "max_live_parameters": 1_000_000_000}
    assert job["offload"] == {"optimizer": True, "grads": True, "params": True, "gpu_param_budget": 0,
                              "pin_memory": True, "strategy": "conservative"}  # no offload beyond the config's
    assert job["train"]["precision"] == "fp32"
    notes = notes_of(path, "--world", "8")
    for needle, key in (('"enabled"', "bfloat16.enabled"), ('"lr"', "optimizer.params.lr"),
                        ("gradient_accumulation_steps", "gradient_accumulation_steps"),
                        ('"train_batch_size"', "train_batch_size")):
        assert f"import: {path}:{line_of(text, needle)}: {key}: 'auto' is filled in by the Hugging Face Trainer; " \
               "not read" in notes
    # The Trainer fills reduce_bucket_size from the model's hidden size (transformers 5.23.0
    # integrations/deepspeed.py:232), which a DeepSpeed config alone does not name.
    assert f"import: {path}:{line_of(text, 'reduce_bucket_size')}: zero_optimization.reduce_bucket_size: 'auto' is " \
           "filled in by the Hugging Face Trainer and accelerate as hidden_size * hidden_size of the model, whose " \
           "hidden size the import was not given: planned at DeepSpeed's default 500,000,000" in notes


def test_sections_deepspeed_removed_are_named_as_removed(write):
    """DS_SPARSE_ATTENTION (DeepSpeedExamples' BERT config): `sparse_attention` is a section
    DeepSpeed 0.19 removed (runtime/config.py, _REMOVED_TOP_LEVEL_CONFIG_KEYS): the note says
    DeepSpeed refuses it, and the rest is read: 65536 = micro 64 x 128 steps x 8 GPUs."""
    text = as_json(DS_SPARSE_ATTENTION)
    result = run_cli("import", write("ds.json", text), "--dp", "8", "--json")
    assert result.code == 0, result.err
    notes = {(n["line"], n["path"]): n["message"] for n in result.json["notes"]}
    message = notes[(line_of(text, "sparse_attention"), "sparse_attention")]
    assert "removed in DeepSpeed 0.19" in message and "refuses" in message
    parallel = result.json["job"]["parallel"]
    assert (parallel["dp"], parallel["micro_batch_size"], parallel["num_microbatches"]) == (8, 64, 128)


@pytest.mark.interop
def test_deepspeed_itself_refuses_the_removed_section_and_reads_the_rest(deepspeed_parse):
    """The note's claim, from DeepSpeed's own config class; without the section, DeepSpeed's
    batch arithmetic over 8 data-parallel ranks is the imported plan's."""
    with pytest.raises(Exception, match="Sparse Attention has been removed"):
        deepspeed_parse(DS_SPARSE_ATTENTION, 8)
    rest = {key: value for key, value in DS_SPARSE_ATTENTION.items() if key != "sparse_attention"}
    parsed = deepspeed_parse(rest, 8)
    assert (parsed.train_micro_batch_size_per_gpu, parsed.gradient_accumulation_steps) == (64, 128)


def test_a_deepspeed_key_given_twice_is_refused(write):
    """json keeps the last of two equal keys silently; DeepSpeed refuses the file
    (runtime/config.py, dict_raise_error_on_duplicate_keys). DS_ZERO2_CPU_OFFLOAD with a
    second zero_optimization pasted in:"""
    path = write("ds.json", '{\n  "train_batch_size": 8,\n  "zero_optimization": {"stage": 2, "cpu_offload": true},\n'
                            '  "fp16": {"enabled": true},\n  "zero_optimization": {"stage": 3}\n}\n')
    result = run_cli("import", path, "--world", "8")
    assert result.err_lines == [f"{path}:5: zero_optimization: given twice (lines 3 and 5)"]


# -- accelerate -----------------------------------------------------------------------------
def accelerate_sizes(path) -> tuple[int, dict[str, int]]:
    """(num_processes, ParallelismConfig sizes) as `accelerate launch` hands them to the workers
    (commands/launch.py `_validate_launch_command`, utils/launch.py
    `prepare_extend_env_parallelism_config`)."""
    pytest.importorskip("accelerate", reason="accelerate is in the `interop` extra")
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_extend_env_parallelism_config

    args, _, _ = _validate_launch_command(launch_command_parser().parse_args(["--config_file", str(path), "x.py"]))
    env = prepare_extend_env_parallelism_config(args, {})
    return args.num_processes, {k: int(env[f"PARALLELISM_CONFIG_{k.upper()}_SIZE"])
                                for k in ("dp_replicate", "dp_shard", "tp", "cp", "sp")}


@pytest.mark.interop
def test_ulysses_sequence_parallel_is_read_as_context_parallel(write):
    """ACC_ULYSSES (trl's alst_ulysses_4gpu.yaml): dp_shard 2 x sp 2 = 4 processes, which
    accelerate takes (ParallelismConfig.total_size counts sp). It was refused as "2 does not
    match 4"."""
    text = as_yaml(ACC_ULYSSES)
    path = write("acc.yaml", text)
    processes, sizes = accelerate_sizes(path)
    assert (processes, sizes["dp_shard"], sizes["sp"]) == (4, 2, 2)
    job = imported_job(path)
    assert job["parallel"] == {"tp": 1, "cp": sizes["sp"], "dp": sizes["dp_shard"]}
    assert job["zero"] == {"framework": "deepspeed", "stage": 3}
    assert f"import: {path}:{line_of(text, 'parallelism_config_sp_size')}: parallelism_config." \
           "parallelism_config_sp_size: Ulysses sequence parallelism (DeepSpeed's ALST) over 2 ranks is planned as " \
           "context parallel (parallel.cp = 2): each rank keeps the activations of 1/2 of the sequence, and ZeRO " \
           "shards over the data-parallel and sequence-parallel ranks together, as DeepSpeed does" in notes_of(path)


def _alst(tmp_path, monkeypatch, extra: dict | None = None) -> tuple[int, dict, str]:
    """ACC_ALST and DS_ALST (accelerate's ALST example) run from their folder, as `accelerate
    launch` opens sp-alst.ds-config.json (from the working directory); `extra`: keys added
    to the YAML."""
    (tmp_path / "sp-alst.ds-config.json").write_text(as_json(DS_ALST))
    (tmp_path / "sp-alst.accelerate-config.yml").write_text(as_yaml({**ACC_ALST, **(extra or {})}))
    monkeypatch.chdir(tmp_path)
    result = run_cli("import", "sp-alst.accelerate-config.yml", "-o", "job.toml")
    job = tomllib.loads((tmp_path / "job.toml").read_text()) if result.code == 0 else {}
    return result.code, job, result.err


def test_deepspeed_file_of_accelerate_is_read_over_its_processes(tmp_path, monkeypatch):
    code, job, err = _alst(tmp_path, monkeypatch)
    assert code == 0, err
    assert job["parallel"]["dp"] == 4 and job["zero"]["stage"] == 3  # num_processes 4; "stage": 3 in the JSON
    assert job["train"]["precision"] == "bf16-mixed"  # "bf16": {"enabled": true}


def test_ulysses_sizes_leave_the_sequence_ranks_out_of_deepspeed_data_parallel(tmp_path, monkeypatch):
    """The ALST example with trl's Ulysses sizes (ULYSSES_SIZES, for the same 4 processes):
    with sp_size 2 of 4 processes, DeepSpeed's data-parallel world is 2 (accelerate hands
    DeepSpeed the Ulysses mpu, whose data-parallel group excludes the sequence ranks), as the
    inline-config import of the same sizes reads it; it was 4, and the plan (dp 4 x cp 2) did
    not fit the 4 processes (exit 2)."""
    code, job, err = _alst(tmp_path, monkeypatch, {"parallelism_config": ULYSSES_SIZES})
    assert code == 0, err
    assert (job["parallel"]["dp"], job["parallel"]["cp"]) == (2, 2)
    assert job["cluster"]["gpus_per_node"] * job["cluster"]["nodes"] == 4


@pytest.mark.interop
def test_hsdp_keeps_its_shard_group(write):
    """ACC_TP_HSDP (accelerate's tp_hsdp.yaml): 8 processes as 2 replicas x 2 shard ranks x
    tp 2. It was read as sharding over one node's 4 data-parallel ranks (twice the sharding
    accelerate runs); now as nodes of 4 GPUs, and exports give back accelerate's and
    torchtitan's sizes."""
    text = as_yaml(ACC_TP_HSDP)
    path = write("acc.yaml", text)
    processes, sizes = accelerate_sizes(path)
    job = imported_job(path)
    assert job["parallel"] == {"tp": sizes["tp"], "cp": sizes["cp"], "dp": sizes["dp_replicate"] * sizes["dp_shard"]}
    assert job["zero"] == {"stage": 3, "hybrid": True}
    assert job["cluster"] == {"nodes": 2, "gpus_per_node": sizes["dp_shard"] * sizes["tp"] * sizes["cp"]}
    assert f"import: {path}:{line_of(text, 'parallelism_config_dp_shard_size')}: parallelism_config." \
           "parallelism_config_dp_shard_size: HSDP (2 replicas of 2 shard ranks) is read as hybrid sharding inside " \
           "nodes of 4 GPUs (cluster.gpus_per_node, cluster.nodes; shardplan shards inside a node)" in notes_of(path)
    out = write("job.toml", "")
    assert run_cli("import", path, "--set", "model.preset=llama-3-8b", "-o", out).code == 0
    yaml_out = write("exported.yaml", "")
    assert run_cli("export", out, "--to", "accelerate", "-o", yaml_out).code == 0
    assert accelerate_sizes(yaml_out) == (processes, sizes)
    titan = run_cli("export", out, "--to", "torchtitan", "--json")
    par = titan.json["config"]["parallelism"]
    assert (par["data_parallel_replicate_degree"], par["data_parallel_shard_degree"], par["tensor_parallel_degree"]) \
        == (sizes["dp_replicate"], sizes["dp_shard"], sizes["tp"])


@pytest.mark.interop
def test_context_parallel_config_is_read_as_accelerate_launches_it(write):
    """ACC_CP (accelerate's cp.yaml): cp 8 over 8 processes, with activation checkpointing."""
    path = write("acc.yaml", as_yaml(ACC_CP))
    processes, sizes = accelerate_sizes(path)
    job = imported_job(path)
    assert job["parallel"]["cp"] == sizes["cp"] == 8 and job["parallel"]["dp"] * 8 == processes
    assert job["train"] == {"precision": "bf16-mixed", "activation_checkpointing": "full"}


def test_num_processes_left_to_the_launcher(write):
    """ACC_NO_NUM_PROCESSES (accelerate's slurm fsdp_config.yaml) has no num_processes: its
    launch script passes --num_processes, and accelerate refuses the file without it. --world
    (or --dp) now stands for it; before, the file planned one GPU and both flags were refused.
    The file names no machines either (the script passes --num_machines): nodes of 8 GPUs
    are planned."""
    from shardplan.io.job import load_job

    path = write("acc.yaml", as_yaml(ACC_NO_NUM_PROCESSES))
    for flags in (("--world", "16"), ("--dp", "16")):
        job = imported_job(path, *flags)
        assert job["parallel"]["dp"] == 16 and "cluster" not in job, flags  # the launch names the machines too
        assert not [n for n in notes_of(path, *flags) if ": num_processes: " in n]
    # and the job file it writes is one `validate` and `estimate` take
    out = write("job.toml", "")
    assert run_cli("import", path, "--world", "16", "-o", out).code == 0
    resolved = load_job(out)
    assert (resolved.job.parallel.dp, resolved.job.cluster.gpus_per_node) == (16, 8)
    job = imported_job(path)
    assert job["parallel"] == {"dp": 1} and "cluster" not in job
    assert f"import: {path}: num_processes: not given: `accelerate launch` needs --num_processes with this config; " \
           "planned as 1 process: give --world N (or --dp N)" in notes_of(path)


def test_world_contradicting_num_processes_is_refused(write):
    """ACC_FSDP1_QLORA says num_processes 8: --world 16 contradicts it, --world 8 agrees."""
    text = as_yaml(ACC_FSDP1_QLORA)
    path = write("acc.yaml", text)
    result = run_cli("import", path, "--world", "16")
    assert result.code == 2
    assert result.err_lines == [f"{path}:{line_of(text, 'num_processes')}: num_processes: 8 processes, but --world 16"]
    assert imported_job(path, "--world", "8")["parallel"] == {"dp": 8}


def test_fsdp1_qlora_config(write):
    """ACC_FSDP1_QLORA (trl's fsdp_qlora.yaml, FSDP1): FULL_SHARD with parameter offload; every
    FSDP1 key not carried over is named."""
    text = as_yaml(ACC_FSDP1_QLORA)
    path = write("acc.yaml", text)
    job = imported_job(path)
    assert job["zero"] == {"stage": 3}
    assert job["offload"] == {"params": True, "grads": True, "optimizer": True, "gpu_param_budget": 0,
                              "strategy": "conservative"}  # no offload beyond the config's
    notes = notes_of(path)
    for key in ("fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_sync_module_states", "fsdp_use_orig_params"):
        line = line_of(text, key)
        assert any(n.startswith(f"import: {path}:{line}: fsdp_config.{key}: not read: ") for n in notes), key


def test_accelerate_deepspeed_template_reads_the_file_it_names(tmp_path, monkeypatch):
    """ACC_DEEPSPEED_TEMPLATE (accelerate's config_yaml_templates/deepspeed.yaml) names
    ../deepspeed_config_templates/zero_stage1_config.json (DS_ZERO1_TEMPLATE), read beside the
    YAML here (not found from the working directory)."""
    case = CASES["accelerate-deepspeed-file-by-relative-path"]
    path = case.write(tmp_path / "accelerate")
    monkeypatch.chdir(tmp_path)
    job = imported_job(path)
    # gradient_accumulation_steps 1 beside an "auto" micro batch (the Trainer's): the micro
    # batch is left out of the job, for `plan` to choose.
    assert job["parallel"] == {"dp": 2, "num_microbatches": 1}
    assert job["zero"] == {"framework": "deepspeed", "stage": 1, "allgather_bucket_size": 200_000_000}
    assert job["train"] == {"precision": "fp16-mixed", "optimizer": "adamw"}


# -- torchtitan: what shardplan reads is what ConfigManager reads ---------------------------
@pytest.mark.interop
@pytest.mark.parametrize("config, world", [(TT_LLAMA3_8B, 8), (TT_LLAMA3_70B, 64), (TT_DEEPSEEK_V3_16B, 64)],
                         ids=["llama3-8b", "llama3-70b", "deepseek-v3-16b"])
def test_torchtitan_configs_are_read_as_torchtitan_reads_them(write, config, world):
    config_module = pytest.importorskip("torchtitan.config", reason="torchtitan is in the `interop` extra")
    path = write("tt.toml", as_toml(config))
    parsed = config_module.ConfigManager().parse_args(["--job.config_file", path])
    t, p, ac = parsed.training, parsed.parallelism, parsed.activation_checkpoint
    job = imported_job(path, "--world", str(world))
    par, train = job["parallel"], job["train"]
    model_parallel = p.tensor_parallel_degree * p.pipeline_parallel_degree * p.context_parallel_degree
    assert (par["tp"], par["pp"], par["cp"], par["dp"]) == (p.tensor_parallel_degree, p.pipeline_parallel_degree,
                                                            p.context_parallel_degree, world // model_parallel)
    assert (par["micro_batch_size"], train["seq_len"], train["steps"], train["lr"]) == \
        (t.local_batch_size, t.seq_len, t.steps, parsed.optimizer.lr)
    assert train["activation_checkpointing"] == {"selective": "op"}.get(ac.mode, ac.mode)
    assert par["communication_timeout"] == parsed.comm.train_timeout_seconds
    # the export is a config torchtitan loads, with the same values
    out = write("job.toml", "")
    assert run_cli("import", path, "--world", str(world), "-o", out).code == 0
    titan = write("exported.toml", "")
    assert run_cli("export", out, "--to", "torchtitan", "-o", titan).code == 0
    again = config_module.ConfigManager().parse_args(["--job.config_file", titan])
    for section, keys in (("training", ("local_batch_size", "seq_len", "steps")),
                          ("parallelism", ("tensor_parallel_degree", "pipeline_parallel_degree",
                                           "context_parallel_degree")),
                          ("activation_checkpoint", ("mode",))):
        for key in keys:
            assert getattr(getattr(again, section), key) == getattr(getattr(parsed, section), key), (section, key)
    assert again.parallelism.data_parallel_shard_degree == world // model_parallel


def test_torchtitan_0_1_config_names_what_0_2_renamed(write):
    """TT_0_1_LLAMA3_70B (torchtitan v0.1.0's llama3_70b.toml): enable_checkpoint and [float8],
    which 0.2.2 refuses; tp 8 of 64 GPUs leaves dp 8."""
    text = as_toml(TT_0_1_LLAMA3_70B)
    path = write("tt.toml", text)
    job = imported_job(path, "--world", "64")
    assert job["model"] == {"preset": "llama-3.1-70b"}  # as torchtitan 0.2.2 builds the flavor: RoPE scaled
    assert (job["parallel"]["tp"], job["parallel"]["dp"]) == (8, 8)
    notes = notes_of(path, "--world", "64")
    assert f"import: {path}:{line_of(text, 'enable_checkpoint')}: checkpoint.enable_checkpoint: torchtitan 0.2 " \
           "renamed it checkpoint.enable and refuses this name: read as enable" in notes
    assert any(n.startswith(f"import: {path}:{line_of(text, '[float8]')}: float8: torchtitan 0.2 moved [float8]")
               for n in notes)


def test_expert_parallel_is_named(write):
    """TT_DEEPSEEK_V3_16B (torchtitan's deepseek_v3_16b.toml): expert parallel (8) has no
    shardplan setting."""
    text = as_toml(TT_DEEPSEEK_V3_16B)
    path = write("tt.toml", text)
    assert f"import: {path}:{line_of(text, 'expert_parallel_degree')}: parallelism.expert_parallel_degree: not read: " \
           "shardplan has no setting for it" in notes_of(path, "--world", "64")


# -- files that are none of the formats --------------------------------------------------------
def test_flow_style_yaml_is_not_reported_as_bad_json(write):
    """NEOX_FLOW_YAML (gpt-neox's configs/llama2/7B.yml) opens with `{` (YAML flow style, with
    comments): it was refused as "invalid JSON"; it is YAML, and none of the three formats. An
    accelerate config in flow style is read."""
    path = write("7B.yml", NEOX_FLOW_YAML)
    result = run_cli("import", path)
    assert result.err_lines == [f"{path}: not a DeepSpeed config (JSON), a torchtitan job config (TOML) or an "
                                "accelerate config (YAML)"]
    flow = write("acc", "{distributed_type: FSDP, num_processes: 2, fsdp_config: {fsdp_version: 2, "
                        "fsdp_reshard_after_forward: true, fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP}}\n")
    assert imported_job(flow)["zero"] == {"stage": 3}
    # a DeepSpeed config with a JSON mistake (DS_BSZ24 with a trailing comma) still gets the
    # JSON error, whatever its name: at the `}` after the comma
    text = as_json(DS_BSZ24)
    after_comma = line_of(text, '"enabled": true') + 1
    broken = write("ds.conf", text.replace('"enabled": true', '"enabled": true,'))
    assert run_cli("import", broken).err_lines == [f"{broken}:{after_comma}: invalid JSON: Expecting property name "
                                                   "enclosed in double quotes"]
