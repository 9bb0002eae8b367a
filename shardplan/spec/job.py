"""The job file: one pydantic table per TOML table, as fixed by CONTRACT ("The job file").

Only single-field rules live here (types, ranges, enumerations). Rules that relate several
fields (dp*tp*pp*cp = world, tp divides heads, ...) are in `shardplan.core.checks`, which
reports them all at once.
"""

from __future__ import annotations

from typing import Annotated, Literal, Optional

from pydantic import BeforeValidator, Field, WithJsonSchema, field_validator, model_validator

from .common import Bandwidth, Capacity, Count, Degree, Dim, Size, Table
from .model import MAX_LAYERS, ModelShape, ModelSpec
from .names import AXES, DEFAULT_ORDER, SCHEDULES, parse_order  # noqa: F401 (re-exported)
from .names import ALL_LINEAR, LAYER_LINEARS, target_hint
from .units import quoted

Schedule = Literal[SCHEDULES]  # type: ignore[valid-type]

# FSDP sharding-strategy names and the ZeRO stage each one behaves like (FSDP docs,
# torch.distributed.fsdp.ShardingStrategy): NO_SHARD is DDP, SHARD_GRAD_OP shards gradients
# and optimizer states (ZeRO-2), FULL_SHARD also parameters (ZeRO-3); the HYBRID variants
# shard inside a node and replicate across nodes.
FSDP_STAGE_NAMES = {
    "no_shard": (0, False),
    "shard_grad_op": (2, False),
    "full_shard": (3, False),
    "hybrid_shard": (3, True),
    "_hybrid_shard_zero2": (2, True),
}


def _derived_default(schema: dict) -> None:
    """For the published schema: a key whose value, when not written, comes from other keys
    (the description says how) shows no fixed `default`."""
    schema.pop("default", None)


class ParallelSpec(Table):
    """How the ranks divide the work."""

    dp: Degree = Field(1, description="data-parallel degree")
    tp: Degree = Field(1, description="tensor-parallel degree")
    pp: Degree = Field(1, description="pipeline-parallel degree (stages)")
    cp: Degree = Field(1, description="context-parallel degree (sequence split across ranks)")
    order: str = Field(
        DEFAULT_ORDER, description="rank order, fastest-varying axis first (Megatron: tp-cp-dp-pp)"
    )
    sequence_parallel: bool = Field(False, description="shard norms/dropout activations along the sequence over tp")
    pipeline_schedule: Schedule = Field("1f1b", description="pipeline schedule")
    virtual_stages: Dim = Field(1, description="model chunks per pipeline rank (interleaved, round-robin)")
    first_stage_layers: int = Field(
        0, ge=0, le=MAX_LAYERS, description="layers on the first pipeline stage (Megatron-LM "
        "--decoder-first-pipeline-num-layers); 0: the even split"
    )
    last_stage_layers: int = Field(
        0, ge=0, le=MAX_LAYERS, description="layers on the last pipeline stage (Megatron-LM "
        "--decoder-last-pipeline-num-layers); 0: the even split"
    )
    micro_batch_size: Dim = Field(1, description="sequences per microbatch on one data-parallel rank")
    num_microbatches: Dim = Field(1, description="pipeline microbatches / gradient accumulation steps")
    communication_timeout: float = Field(
        1800.0, gt=0, le=7 * 24 * 3600, description="seconds a collective may take before the run fails"
    )

    @field_validator("order")
    @classmethod
    def _order(cls, value: str) -> str:
        parse_order(value)
        return value


ZERO_STAGES = ("0", "1", "2", "3")


def _stage_from_name(value: object) -> object:
    """An FSDP name, or a stage number written as a string (`stage = "3"`, as YAML and
    environment variables give it) -> the stage number."""
    if isinstance(value, str):
        name = value.strip().lower()
        if name in ZERO_STAGES:
            return int(name)
        if name not in FSDP_STAGE_NAMES:
            raise ValueError(
                f"unknown sharding {quoted(value)}: write a stage number, stage = 0, 1, 2 or 3, "
                f"or an FSDP name: {', '.join(repr(n) for n in FSDP_STAGE_NAMES)}"
            )
        return FSDP_STAGE_NAMES[name][0]
    return value


ZeroStage = Annotated[
    int,
    BeforeValidator(_stage_from_name),
    Field(ge=0, le=3),
    WithJsonSchema({"anyOf": [
        {"type": "integer", "minimum": 0, "maximum": 3},
        {"type": "string", "enum": [*ZERO_STAGES, *FSDP_STAGE_NAMES]},
    ]}),
]


class ZeroSpec(Table):
    """ZeRO / FSDP sharding of model states over the data-parallel ranks."""

    stage: ZeroStage = Field(
        0, description="0 replicate, 1 shard optimizer states, 2 and gradients, 3 and parameters "
        "(FSDP names: no_shard, shard_grad_op, full_shard, hybrid_shard)",
    )
    hybrid: bool = Field(False, description="shard inside a node, replicate across nodes (HSDP)")
    min_num_params: Count = Field(0, description="parameters smaller than this stay unsharded")
    # DeepSpeed's ZeRO knobs, with its defaults (deepspeed/runtime/zero/config.py, v0.19:
    # reduce_bucket_size 5e8, allgather_bucket_size 5e8, stage3_prefetch_bucket_size 5e7,
    # stage3_max_live_parameters 1e9, stage3_param_persistence_threshold 1e5, sub_group_size 1e9).
    # The `deepspeed` accounting reads them; `export --to deepspeed` writes them.
    reduce_bucket_size: Count = Field(
        # DeepSpeed 0.19.8 zero/config.py: `reduce_bucket_size: int = Field(pp_int(5e8), gt=0)`.
        500_000_000, ge=1, json_schema_extra={"minimum": 1},
        description="elements per gradient reduce bucket (DeepSpeed reduce_bucket_size)",
    )
    allgather_bucket_size: Count = Field(
        500_000_000, description="elements per parameter all-gather bucket, stages 1-2 (DeepSpeed allgather_bucket_size)"
    )
    prefetch_bucket_size: Count = Field(
        50_000_000, description="parameter elements fetched ahead, stage 3 (DeepSpeed stage3_prefetch_bucket_size)"
    )
    max_live_parameters: Count = Field(
        1_000_000_000, description="gathered parameter elements kept before release, stage 3 "
        "(DeepSpeed stage3_max_live_parameters; caps prefetch, not one module's gather)"
    )
    param_persistence_threshold: Count = Field(
        100_000, description="parameters this small stay gathered, stage 3 (DeepSpeed stage3_param_persistence_threshold)"
    )
    sub_group_size: Count = Field(
        # DeepSpeed 0.19.8 zero/config.py: `sub_group_size: int = Field(pp_int(1e9), ge=0)`; 0
        # makes every tensor a sub-group of its own (stage3.py `_create_fp16_sub_groups`).
        1_000_000_000, description="parameter elements per optimizer sub-group, stage 3: the step casts one "
        "sub-group's gradients to fp32 at a time (DeepSpeed sub_group_size)"
    )
    overlap_comm: Optional[bool] = Field(
        None, description="DeepSpeed overlap_comm: reduce gradients during backward in two alternating "
        "buckets; default DeepSpeed's (true at stage 3, false below)"
    )
    grad_accum_dtype: Optional[Literal["fp32", "bf16", "fp16"]] = Field(
        # DeepSpeed 0.19.8 runtime/config.py line 556: data_types.grad_accum_dtype, default None,
        # the model's dtype (engine.py `get_data_types`, lines 1799-1810).
        None, description="DeepSpeed data_types.grad_accum_dtype: the dtype gradients accumulate in; "
        "default the model's. fp32 with bf16 at stage 1 makes DeepSpeed step with BF16_Optimizer "
        "(an fp32 gradient buffer of the whole model); without ZeRO it must be the model's dtype"
    )
    framework: Literal["fsdp2", "deepspeed", "zero-paper"] = Field(
        "fsdp2", description="whose memory accounting: fsdp2 (what `shardplan run` executes), deepspeed "
        "(what DeepSpeed's code allocates) or zero-paper (the ZeRO paper's formulas)"
    )

    @model_validator(mode="before")
    @classmethod
    def _hybrid_names(cls, data: object) -> object:
        # hybrid_shard names set two keys: the stage (above) and hybrid.
        if isinstance(data, dict) and isinstance(data.get("stage"), str):
            known = FSDP_STAGE_NAMES.get(data["stage"].strip().lower())
            if known and known[1]:
                if data.get("hybrid") is False:
                    raise ValueError(f"stage {data['stage']!r} is hybrid sharding, but hybrid = false")
                data = {**data, "hybrid": True}
        return data


class OffloadSpec(Table):
    """What lives in CPU memory instead of on the GPU."""

    params: bool = Field(False, description="keep parameters on the CPU (needs ZeRO stage 3)")
    grads: bool = Field(False, description="move gradients to the CPU (with optimizer under fsdp2: freed on the "
                        "GPU once copied)")
    optimizer: bool = Field(False, description="keep optimizer states and fp32 master weights on the CPU (step runs "
                            "there)")
    cpu_memory_budget: Size = Field(
        2**35, description="CPU memory this job may use per node; when not written: the node's RAM "
        "(cluster.cpu_memory_per_node) less a reserve of 10% (at least 8 GiB)", json_schema_extra=_derived_default
    )
    gpu_param_budget: Size = Field(2**31, description="parameter bytes kept on the GPU; blocks beyond stay on the CPU")
    prefetch_layers: Dim = Field(1, description="blocks fetched ahead of the one computing")
    async_prefetch: bool = Field(True, description="prefetch on a side stream")
    overlap: bool = Field(True, description="overlap transfers with compute")
    pin_memory: bool = Field(True, description="pin CPU buffers (only where an accelerator exists)")
    cpu_compression: Literal["none", "fp16", "bf16", "int8"] = Field(
        "none", description="store the optimizer states kept on the CPU compressed: fp16 or bf16 (stochastic "
        "rounding) or int8 (block-wise, 256 elements per fp32 scale)"
    )
    strategy: Literal["conservative", "balanced", "aggressive", "extreme"] = Field(
        "balanced", description="how eagerly to offload when memory is short"
    )


class TrainSpec(Table):
    """The training step."""

    seq_len: Dim = Field(2048, description="tokens per sequence; when not written: 2048, or the model's "
                         "max_seq_len when that is shorter", json_schema_extra=_derived_default)
    precision: Literal["bf16-mixed", "fp16-mixed", "fp32", "bf16"] = Field(
        "bf16-mixed", description="parameter/compute precision"
    )
    optimizer: Literal["adamw", "adamw8bit", "sgd"] = Field(
        "adamw", description="adamw, adamw8bit (block-wise 8-bit moments, Dettmers et al. 2022) or sgd"
    )
    global_batch_size: int = Field(
        0, ge=0, le=2**31, description="sequences per optimizer step; 0: dp * micro_batch_size * num_microbatches"
    )
    activation_checkpointing: Literal["none", "selective", "op", "full"] = Field(
        "none", description="activation recomputation: none, selective (Korthikanti et al.: attention core), "
        "op (torchtitan's operator policy: keep every other matmul's output), full (each layer)"
    )
    loss: Literal["fp32", "fused"] = Field(
        "fp32", description="cross entropy: fp32 (torch on upcast logits: transformers, torchtitan, `run`) or "
        "fused (Megatron-LM's vocab-parallel kernel: fp32 softmax kept, gradient in place)"
    )
    attention: Literal["flash", "eager"] = Field(
        "flash", description="flash keeps no score matrix; eager keeps it for backward"
    )
    steps: Dim = Field(10, description="optimizer steps `shardplan run` takes")
    lr: float = Field(3e-4, gt=0, le=1e3, description="learning rate")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="seed of weights, data order and dropout")


# Linear layers LoRA can adapt, by the names the job's model gives them (core/params.py, as
# in Hugging Face's Llama: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj), and
# peft's "all-linear": every layer linear the model has (LoraSpec.for_model).
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LORA_TARGETS: tuple[str, ...] = LoraTarget.__args__  # type: ignore[attr-defined]
assert LORA_TARGETS == LAYER_LINEARS


def _renamed_target(value: object) -> object:
    """A name peft users write for a fused or renamed linear (Phi-3's qkv_proj, GPT-2's
    c_attn, ...) gets the unfused names to give, not a close spelling."""
    hint = target_hint(value) if isinstance(value, str) else None
    if hint:
        raise ValueError(hint)
    return value


def _all_linear_string(value: object) -> object:
    """peft's `target_modules="all-linear"` is a string; it is the list ["all-linear"] here."""
    if value == ALL_LINEAR:
        return [ALL_LINEAR]
    if isinstance(value, str):
        raise ValueError(f"expected a list of linear names or {ALL_LINEAR!r}, got a string {quoted(value)}")
    return value


def _targets_schema(schema: dict) -> None:
    """For the published schema: `targets` is an array of names, or the string "all-linear"."""
    array = {k: schema.pop(k) for k in ("type", "items", "minItems") if k in schema}
    schema["anyOf"] = [array, {"const": ALL_LINEAR, "type": "string"}]


TargetName = Annotated[Literal[LORA_TARGETS + (ALL_LINEAR,)], BeforeValidator(_renamed_target)]  # type: ignore[valid-type]


class LoraSpec(Table):
    """Parameter-efficient fine-tuning: low-rank adapters on a frozen base (Hu et al. 2021)."""

    rank: Dim = Field(16, le=65536, description="adapter rank r: A is r x in, B is out x r")
    alpha: float = Field(32.0, gt=0, le=1e6, description="scaling numerator: the update is (alpha / r) * B A")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="dropout on the adapters' input (keeps a mask for backward)")
    targets: Annotated[list[TargetName], BeforeValidator(_all_linear_string)] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1,
        description="linear layers that get adapters (q_proj k_proj v_proj o_proj gate_proj up_proj down_proj), "
        "or 'all-linear': every one the model has (peft's shorthand)", json_schema_extra=_targets_schema,
    )
    base_dtype: Literal["bf16", "nf4"] = Field(
        "bf16", description="frozen base weights: bf16, or nf4 (QLoRA: 4-bit NormalFloat, block-wise scales)"
    )


    @field_validator("targets")
    @classmethod
    def _unique(cls, value: list[str]) -> list[str]:
        seen: set[str] = set()
        repeated: set[str] = set()
        for target in value:  # one pass: counting each of 200,000 names took a minute
            (repeated if target in seen else seen).add(target)
        if repeated:
            raise ValueError(f"{min(repeated)!r} is listed twice")
        return value

    def for_model(self, shape: ModelShape | None) -> LoraSpec:
        """`all-linear` as the layer linears `shape` has (gate_proj only in a gated MLP; an MoE
        model's experts are matched by name, as peft matches them); other lists unchanged."""
        if shape is None or ALL_LINEAR not in self.targets:
            return self
        names = [n for n in LAYER_LINEARS if shape.gated or n != "gate_proj"]
        return self.model_copy(update={"targets": names})


class DataSpec(Table):
    """Where `shardplan run` reads tokens."""

    path: str = Field("", description="flat binary file of token ids; empty: a synthetic stream")
    dtype: Literal["auto", "uint16", "uint32"] = Field(
        "auto", description="token id type of `path`; auto: uint16 when the vocabulary fits"
    )


class CheckpointSpec(Table):
    """Sharded checkpoints written by `shardplan run`."""

    dir: str = Field("", description="checkpoint folder; empty: no checkpoints")
    every: Dim = Field(100, description="steps between checkpoints")
    keep: Dim = Field(2, description="complete checkpoints kept")


class ClusterSpec(Table):
    """The machines the job runs on."""

    preset: Optional[str] = Field(None, description="a shipped node type (`shardplan presets`); keys here override it")
    nodes: Optional[Degree] = Field(
        None, description="number of nodes; when given, nodes * gpus_per_node must equal the world "
        "(default: as many as dp*tp*pp*cp needs)"
    )
    gpus_per_node: Degree = Field(8, description="GPUs (ranks) per node")
    gpu_memory: Capacity = Field(
        80 * 2**30, gt=0, description="memory of one GPU; `estimate` checks the fit only when the job states it "
        "(here or through a cluster preset)", json_schema_extra=_derived_default
    )
    cpu_memory_per_node: Capacity = Field(2**40, gt=0, description="CPU RAM of one node")
    gpu: Optional[str] = Field(
        None, description="GPU hardware preset for the time model (`shardplan presets`: h100-sxm, a100-sxm-80gb, ...)"
    )
    peak_tflops: Optional[float] = Field(
        None, gt=0, le=1e6, description="dense 16-bit TFLOP/s of one GPU (overrides the gpu preset)"
    )
    memory_bandwidth: Optional[Bandwidth] = Field(
        None, description="GPU memory (HBM) bandwidth, e.g. '3.35TB/s' (overrides the gpu preset)"
    )
    intra_node_bandwidth: Optional[Bandwidth] = Field(
        None, description="per GPU, one direction, inside a node (NVLink), e.g. '450GB/s'"
    )
    intra_node_link: Optional[Literal["NVLink", "PCIe", "Infinity Fabric"]] = Field(
        None, description="what intra_node_bandwidth crosses, as the time model's explanation names it "
        "(default NVLink; the gpu presets of PCIe cards say PCIe)"
    )
    inter_node_bandwidth: Optional[Bandwidth] = Field(
        None, description="per GPU, one direction, between nodes (InfiniBand / RoCE), e.g. '50GB/s' or '400Gb/s'"
    )
    host_bandwidth: Optional[Bandwidth] = Field(
        None, description="per GPU, host <-> device (PCIe), e.g. '25GB/s'"
    )
    peak_fp32_tflops: Optional[float] = Field(
        None, gt=0, le=1e6, description="fp32 matmul TFLOP/s of one GPU, for precision = fp32 (overrides the gpu preset)"
    )
    host_memory_bandwidth: Optional[Bandwidth] = Field(
        None, description="CPU DRAM bandwidth of one node, for the CPU optimizer step under offload, e.g. '400GB/s'"
    )
    matmul_efficiency: Optional[float] = Field(
        None, gt=0, le=1, description="fraction of peak_tflops large matmuls reach (time model; default 0.74)"
    )
    memory_efficiency: Optional[float] = Field(
        None, gt=0, le=1, description="fraction of memory_bandwidth elementwise kernels reach (time model; default 0.65)"
    )
    intra_node_efficiency: Optional[float] = Field(
        None, gt=0, le=1, description="fraction of intra_node_bandwidth collectives reach (time model; default 0.75)"
    )
    inter_node_efficiency: Optional[float] = Field(
        None, gt=0, le=1, description="fraction of inter_node_bandwidth collectives reach (time model; default 0.9)"
    )



class JobSpec(Table):
    """A shardplan job: every table is optional and has defaults."""

    model: ModelSpec = Field(default_factory=ModelSpec, description="the model")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec, description="parallel degrees and schedule")
    zero: ZeroSpec = Field(default_factory=ZeroSpec, description="ZeRO / FSDP sharding")
    offload: OffloadSpec = Field(default_factory=OffloadSpec, description="CPU offload")
    train: TrainSpec = Field(default_factory=TrainSpec, description="training step")
    data: DataSpec = Field(default_factory=DataSpec, description="training data for `run`")
    lora: Optional[LoraSpec] = Field(None, description="LoRA / QLoRA fine-tuning; absent: full training")
    checkpoint: CheckpointSpec = Field(default_factory=CheckpointSpec, description="checkpoints for `run`")
    cluster: ClusterSpec = Field(default_factory=ClusterSpec, description="the machines")

    def cluster_given(self) -> bool:
        """True when the file (or a flag) fixed the number of nodes: the world then follows."""
        return self.cluster.nodes is not None


TABLES: dict[str, type[Table]] = {
    name: LoraSpec if name == "lora" else field.annotation  # type: ignore[misc]
    for name, field in JobSpec.model_fields.items()
}
