"""The narrow inputs of a memory estimate, and their derivation from a job."""

from __future__ import annotations

from dataclasses import dataclass, fields

from ..spec.job import JobSpec
from ..spec.model import ModelShape, cached_hash
from .degrees import Degrees
from .lora import LoraPlan


# Host memory a job cannot have: the operating system, the page cache that data loading and
# checkpoint writes run through, and other processes. A tenth of the node's RAM, at least
# 8 GiB: a stated reserve, not a measurement.
HOST_RESERVE_SHARE = 0.10
HOST_RESERVE_MIN = 8 * 2**30


def host_reserve(cpu_memory_per_node: int) -> int:
    return max(HOST_RESERVE_MIN, int(cpu_memory_per_node * HOST_RESERVE_SHARE))


def default_cpu_budget(cpu_memory_per_node: int) -> int:
    """`offload.cpu_memory_budget` when the job does not write one: the node's RAM less the
    host reserve (never below a quarter of it)."""
    return max(cpu_memory_per_node // 4, cpu_memory_per_node - host_reserve(cpu_memory_per_node))


@dataclass(frozen=True)
class EstimateInputs:
    """Everything a memory estimate depends on, and nothing else."""

    shape: ModelShape | None  # None: a bare parameter count (`params`)
    params: int | None
    degrees: Degrees
    order: str = "tp-cp-dp-pp"
    gpus_per_node: int = 8
    # sharding
    framework: str = "fsdp2"
    zero_stage: int = 0
    hybrid: bool = False
    min_num_params: int = 0
    # DeepSpeed's ZeRO knobs (deepspeed/runtime/zero/config.py defaults), read by the
    # `deepspeed` accounting only
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    param_persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000
    overlap_comm: bool | None = None  # None: DeepSpeed's default (true at stage 3)
    grad_accum_dtype: str | None = None  # None: the model's dtype (DeepSpeed's default)
    # the step
    precision: str = "bf16-mixed"
    optimizer: str = "adamw"
    seq_len: int = 2048
    micro_batch: int = 1
    num_microbatches: int = 1
    schedule: str = "1f1b"
    virtual: int = 1
    stage_split: tuple[int, int] = (0, 0)  # layers of the first / last pipeline stage (0: even)
    sequence_parallel: bool = False
    recompute: str = "none"
    attention: str = "flash"
    loss: str = "fp32"  # fp32 (torch cross_entropy on upcast logits) | fused (Megatron's kernel)
    dropout: bool = False
    # offload
    offload_params: bool = False
    offload_grads: bool = False
    offload_optimizer: bool = False
    resident_layers: int | None = None  # set by the offload decision; None: from the budget
    gpu_param_budget: int = 2 * 2**30
    cpu_memory_budget: int = 32 * 2**30
    prefetch_layers: int = 1
    compression: str = "none"
    strategy: str = "balanced"
    pin_memory: bool = True
    # limits (None: unknown, `fits` is then null)
    gpu_memory: int | None = None
    cpu_memory_per_node: int | None = None
    on_gpu: bool = True  # CUDA allowances apply
    checkpointing: bool = False  # `run` writes checkpoints: their staging is host memory
    lora: LoraPlan | None = None  # LoRA / QLoRA: adapters train, the base is frozen (None: full training)
    # Sequence parallel counted as torch's DTensor plan keeps it (the gathered inputs of the QKV
    # and MLP linears, core/estimate.py `torch_sequence_parallel_extra`), not as the paper does:
    # the planner's check that `run` holds a plan; the estimate itself follows the paper (CONTRACT).
    sp_keeps_gathered: bool = False

    __hash__ = cached_hash  # planner caches key on this frozen value

    def with_(self, **changes) -> EstimateInputs:
        """A copy with `changes` (as `dataclasses.replace`, which the planner's inner loop cannot
        afford: this class has no validation in its constructor to skip)."""
        if not changes.keys() <= _FIELDS:
            raise TypeError(f"EstimateInputs has no field {sorted(changes.keys() - _FIELDS)[0]!r}")
        copy = object.__new__(EstimateInputs)
        values = copy.__dict__
        values.update(self.__dict__)
        values.update(changes)
        values.pop("_hash", None)
        values.pop("_framework_key", None)  # core/figures.py caches it on the instance
        values.pop("_figures", None)  # core/memory.py plan_figures likewise
        return copy


_FIELDS = frozenset(f.name for f in fields(EstimateInputs))


def defers_to_step_end(inputs: EstimateInputs) -> bool:
    """Whether FSDP2 modules run inside torch's pipeline stages, which defer resharding and
    gradient reduction to the end of the step (core/buffers.py `pipelined_fsdp2_buffers`; core/time_plan.py):
    fsdp2 with pp > 1 at the stages that `fully_shard` (0, 2, 3; stage 1 is DDP), full training
    and LoRA alike (core/finetune.py `lora_pipelined_buffers`)."""
    return (inputs.framework == "fsdp2" and inputs.degrees.pp > 1 and inputs.zero_stage != 1
            and inputs.shape is not None)


def inputs_from_job(job: JobSpec, shape: ModelShape | None, limits_known: bool) -> EstimateInputs:
    """Map a validated job onto estimate inputs; `limits_known` when the job states its
    cluster's memory (a [cluster] table or preset), else `fits` is unknown."""
    par, zero, off, train, cluster = job.parallel, job.zero, job.offload, job.train, job.cluster
    return EstimateInputs(
        shape=shape,
        params=job.model.params,
        degrees=Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp),
        order=par.order,
        gpus_per_node=cluster.gpus_per_node,
        framework=zero.framework,
        zero_stage=zero.stage,
        hybrid=zero.hybrid,
        min_num_params=zero.min_num_params,
        reduce_bucket_size=zero.reduce_bucket_size,
        allgather_bucket_size=zero.allgather_bucket_size,
        prefetch_bucket_size=zero.prefetch_bucket_size,
        max_live_parameters=zero.max_live_parameters,
        param_persistence_threshold=zero.param_persistence_threshold,
        sub_group_size=zero.sub_group_size,
        overlap_comm=zero.overlap_comm,
        grad_accum_dtype=zero.grad_accum_dtype,
        precision=train.precision,
        optimizer=train.optimizer,
        seq_len=train.seq_len,
        micro_batch=par.micro_batch_size,
        num_microbatches=par.num_microbatches,
        schedule=par.pipeline_schedule,
        virtual=par.virtual_stages,
        stage_split=(par.first_stage_layers, par.last_stage_layers),
        sequence_parallel=par.sequence_parallel,
        recompute=train.activation_checkpointing,
        attention=train.attention,
        loss=train.loss,
        dropout=job.model.dropout > 0,
        offload_params=off.params,
        offload_grads=off.grads,
        offload_optimizer=off.optimizer,
        gpu_param_budget=off.gpu_param_budget if "gpu_param_budget" in off.model_fields_set
        else min(off.gpu_param_budget, cluster.gpu_memory),
        cpu_memory_budget=off.cpu_memory_budget if "cpu_memory_budget" in off.model_fields_set
        else default_cpu_budget(cluster.cpu_memory_per_node),
        prefetch_layers=off.prefetch_layers,
        compression=off.cpu_compression,
        strategy=off.strategy,
        pin_memory=off.pin_memory,
        gpu_memory=cluster.gpu_memory if limits_known else None,
        cpu_memory_per_node=cluster.cpu_memory_per_node if limits_known else None,
        checkpointing=bool(job.checkpoint.dir),
        lora=lora_plan(job),
    )


def lora_plan(job: JobSpec) -> LoraPlan | None:
    """The job's [lora] table as estimate inputs (None: full training)."""
    if job.lora is None:
        return None
    lora = job.lora
    return LoraPlan(rank=lora.rank, targets=tuple(lora.targets), base_dtype=lora.base_dtype, dropout=lora.dropout > 0)
