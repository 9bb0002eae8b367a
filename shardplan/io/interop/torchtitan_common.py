"""torchtitan's facts that its export (torchtitan.py) and import (torchtitan_import.py) share:
model flavors, pipeline schedule names, the JobConfig defaults that decide a plan and when
torchtitan applies FSDP.

Sources: torchtitan 0.2.2 (the last release on the package index whose `ConfigManager` reads
TOML job files; 0.3.0 replaced them with Python config registries),
torchtitan/config/job_config.py (`JobConfig`), torchtitan/distributed/parallel_dims.py
(the data-parallel world is data_parallel_replicate_degree * data_parallel_shard_degree; FSDP
is applied when the shard degree or context parallel is above 1),
torchtitan/models/llama3/infra/parallelize.py (`fsdp_reshard_after_forward`: "default"
reshards unless pipeline parallel is on; tensor parallel always shards the norms along the
sequence), torchtitan/distributed/pipeline_parallel.py (`pipeline_llm`: microbatches =
local_batch_size / pipeline_parallel_microbatch_size; stages from module_fqns_per_model_part,
else `generate_llm_fqn_per_model_part`), torchtitan/train.py (gradient accumulation steps =
global_batch_size / (local_batch_size * data-parallel degree)).
"""

from __future__ import annotations

# torchtitan model name and flavor -> the shardplan preset of the same architecture
# (torchtitan/models/llama3/__init__.py, `llama3_args`; the parameter counts are checked
# against torchtitan's own model in the tests). The _flex / _varlen flavors differ only in
# the attention kernel. Every llama3 flavor scales RoPE as Llama 3.1 does (RoPEScalingArgs'
# defaults, torchtitan/models/llama3/model/args.py, which TransformerModelArgs applies to all
# of them), so each maps to the Llama 3.1 preset of its shape, whose rope_scaling is the same.
FLAVORS = {
    ("llama3", "8B"): "llama-3.1-8b",
    ("llama3", "8B_flex"): "llama-3.1-8b",
    ("llama3", "8B_varlen"): "llama-3.1-8b",
    ("llama3", "70B"): "llama-3.1-70b",
    ("llama3", "405B"): "llama-3.1-405b",
}

# shardplan schedule -> torch.distributed.pipelining's name, which torchtitan passes to
# `get_schedule_class` (the same classes `shardplan run` uses, runtime/pipeline.py).
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "round-robin": "LoopedBFS",
    "zero-bubble": "InterleavedZeroBubble",
}
CHUNKED = ("interleaved-1f1b", "round-robin")  # shardplan places `virtual_stages` chunks per rank

# JobConfig defaults that decide the plan (job_config.py, torchtitan 0.2.2).
DEFAULTS = {
    "local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "steps": 10000,
    "dtype": "float32", "mixed_precision_param": "bfloat16", "lr": 8e-4,
    "ac_mode": "selective", "reshard": "default", "schedule": "1F1B", "microbatch_size": 1,
    "first_less": 1, "last_less": 1, "train_timeout": 100,
    # [job] and [checkpoint]: checkpoints go to {dump_folder}/{folder} (components/checkpoint.py,
    # CheckpointManager: os.path.join(base_folder, folder), base_folder = job.dump_folder).
    "dump_folder": "./outputs", "checkpoint_folder": "checkpoint", "checkpoint_interval": 500, "keep_latest_k": 10,
}

# torchtitan/distributed/parallel_dims.py: `fsdp_enabled` is dp_shard > 1 or cp > 1, and
# llama3/infra/parallelize.py applies FSDP (with enable_cpu_offload's CPUOffloadPolicy) only then.
NO_FSDP = "which it applies only with data_parallel_shard_degree or context_parallel_degree above 1"


def fsdp_applied(shard: int, cp: int) -> bool:
    """Whether torchtitan wraps the model in FSDP for these degrees."""
    return shard > 1 or cp > 1
