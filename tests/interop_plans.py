"""Job files the interop tests export to every target (shared by the test_interop_* files).

Each covers a different corner: ZeRO stages 0-3, hybrid sharding, offload, precisions,
tensor / pipeline / context parallel, uneven pipeline stages, custom DeepSpeed buckets,
DeepSpeed's overlap_comm and fp32 gradient accumulation."""

from __future__ import annotations

PLANS = {
    "zero3_dp8": """
[model]
preset = "llama-3-8b"
[parallel]
dp = 8
[zero]
stage = 3
[train]
activation_checkpointing = "full"
""",
    "zero2_offload_fp16": """
[model]
preset = "gpt2-xl"
[parallel]
dp = 4
micro_batch_size = 2
num_microbatches = 4
[zero]
stage = 2
reduce_bucket_size = "200M"
allgather_bucket_size = "100M"
[offload]
optimizer = true
grads = true
[train]
precision = "fp16-mixed"
seq_len = 1024
""",
    "zero3_hybrid_offload": """
[model]
preset = "llama-2-13b"
[parallel]
dp = 16
micro_batch_size = 1
num_microbatches = 2
[zero]
stage = 3
hybrid = true
prefetch_bucket_size = 20000000
max_live_parameters = 300000000
param_persistence_threshold = 50000
sub_group_size = 200000000
[offload]
params = true
grads = true
optimizer = true
gpu_param_budget = 0
pin_memory = false
[train]
seq_len = 4096
lr = 1e-4
[cluster]
gpus_per_node = 8
""",
    "tp4_zero1_sgd_fp32": """
[model]
preset = "llama-2-7b"
[parallel]
dp = 2
tp = 4
sequence_parallel = true
micro_batch_size = 4
num_microbatches = 8
[zero]
stage = 1
[train]
precision = "fp32"
optimizer = "sgd"
""",
    "pp4_interleaved": """
[model]
preset = "llama-3-70b"
[parallel]
dp = 2
tp = 8
pp = 4
sequence_parallel = true
pipeline_schedule = "interleaved-1f1b"
virtual_stages = 2
first_stage_layers = 9
last_stage_layers = 9
micro_batch_size = 1
num_microbatches = 16
[train]
seq_len = 8192
activation_checkpointing = "selective"
steps = 500
seed = 7
[checkpoint]
dir = "ckpt"
every = 50
keep = 3
""",
    # DeepSpeed's BF16_Optimizer at stage 1 (data_types.grad_accum_dtype fp32) with overlap_comm.
    "zero1_bf16_fp32_accumulation": """
[model]
preset = "llama-2-7b"
[parallel]
dp = 8
micro_batch_size = 2
num_microbatches = 4
[zero]
stage = 1
framework = "deepspeed"
overlap_comm = true
grad_accum_dtype = "fp32"
[train]
seq_len = 2048
""",
    "cp2_zero3": """
[model]
preset = "llama-3-8b"
[parallel]
dp = 4
cp = 2
[zero]
stage = 3
[train]
seq_len = 16384
precision = "bf16"
""",
}
