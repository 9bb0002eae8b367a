"""Apply the plan to a model: tensor parallel, activation checkpointing, then ZeRO/FSDP or
DDP, offload and prefetching, and build the optimizer that steps where its states live.

Order and APIs follow torchtitan (parallelize_llama): `parallelize_module` on the tp mesh,
`checkpoint_wrapper` per block, `fully_shard` per block then on the root.

ZeRO stage -> torch:
- 0: fully_shard on a (dp_replicate = dp, dp_shard = 1) mesh: every rank holds whole fp32
  states, gradients are all-reduced, and MixedPrecisionPolicy computes in 16 bits, as stages
  2 and 3 do (DDP under autocast would keep the residual stream in fp32);
- 1: DistributedDataParallel (gradient_as_bucket_view) with torch's ZeroRedundancyOptimizer
  (optimizer states sharded by parameter), autocast for mixed precision;
- 2: fully_shard(reshard_after_forward=False): parameters stay gathered from forward to backward;
- 3: fully_shard(reshard_after_forward=True).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn as nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

from ..core.offload import frees_device_grads
from ..core.precision import MIXED
from ..spec.job import LoraSpec
from .dist import Runtime
from .lora import adamw8bit_class, cast_frozen, is_quantized, store_base, with_adapters
from .model import materialize
from .offload import EngineConfig, HostOptimizer, OptimizerSet

COMPUTE_DTYPES = dict(zip(MIXED, (torch.bfloat16, torch.float16)))  # core.precision.MIXED, in order


@dataclass(frozen=True)
class ParallelPlan:
    """The decisions this rank applies (all taken by the planner beforehand)."""

    zero_stage: int
    precision: str
    optimizer: str
    lr: float
    recompute: str
    resident_layers: int  # layers (in order) whose parameters stay on the device
    offload_params: bool
    prefetch_layers: int
    pin_memory: bool
    sequence_parallel: bool = False
    seed: int = 0  # weights come from (seed, parameter name): runtime/model.py init_parameter
    tied_head: bool = False  # a last pipeline stage holding its copy of a tied embedding
    offload_optimizer: bool = False  # optimizer states and fp32 masters on the host (runtime/offload.py)
    offload_grads: bool = False  # with offload_optimizer: device gradients freed once copied
    compression: str = "none"  # how host optimizer states are stored (runtime/offload_codec.py)
    lora: LoraSpec | None = None  # LoRA / QLoRA: the base frozen and stored as it says


def apply_tensor_parallel(model: nn.Module, runtime: Runtime, sequence_parallel: bool) -> None:
    """Megatron-LM's split (Shoeybi et al. 2019): q/k/v and MLP up/gate column-parallel,
    attention output and MLP down row-parallel, the embedding and head vocabulary-parallel;
    the head's logits stay sharded over the vocabulary for `loss_parallel`. With sequence
    parallel (Korthikanti et al. 2022) the residual stream and the norms are sharded over the
    sequence, gathered before attention and the MLP (torchtitan's plan)."""
    tp_mesh = runtime.mesh["tp"]
    sp = sequence_parallel
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    block_plan = {
        "attn.q_proj": ColwiseParallel(),
        "attn.k_proj": ColwiseParallel(),
        "attn.v_proj": ColwiseParallel(),
        "attn.o_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
        "mlp.up_proj": ColwiseParallel(),
        "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)) if sp else RowwiseParallel(),
    }
    if sp:
        block_plan.update({"attn_norm": SequenceParallel(), "attn": gather,
                           "mlp_norm": SequenceParallel(), "mlp": gather})
    for block in model.layers.values():
        plan = dict(block_plan)
        if block.mlp.gated:
            plan["mlp.gate_proj"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, with_adapters(block, plan))
    root_plan = {}
    if model.embed is not None:
        root_plan["embed"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1) if sp else Replicate())
    if model.final_norm is not None and sp:
        root_plan["final_norm"] = SequenceParallel()
    if model.lm_head is not None:
        root_plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(),
                                               output_layouts=Shard(-1), use_local_output=False)
    if root_plan:
        parallelize_module(model, tp_mesh, root_plan)


def apply_checkpointing(model: nn.Module, recompute: str) -> None:
    """full: recompute each block in backward; selective: only the attention core."""
    if recompute == "none":
        return
    for name, block in list(model.layers.items()):
        if recompute == "full":
            model.layers[name] = checkpoint_wrapper(block)
        else:
            block.attn.core = checkpoint_wrapper(block.attn.core)


def _blocks(model: nn.Module) -> list[nn.Module]:
    return list(model.layers.values())


def apply_fsdp(model: nn.Module, runtime: Runtime, plan: ParallelPlan) -> None:
    """fully_shard each block, then the root; blocks past the resident count are offloaded."""
    # Hybrid sharding (HSDP) and stage 0: a 2-D (replicate, shard) mesh.
    dp_mesh = runtime.mesh[("dp_replicate", "dp_shard")] if runtime.dp_split else runtime.mesh["dp"]
    compute = COMPUTE_DTYPES.get(plan.precision)
    if plan.lora is not None and plan.precision == "fp32":
        compute = torch.float32  # the bf16 frozen base is gathered in fp32 for fp32 compute
    mp_policy = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    # pin_memory only where an accelerator exists (TORCH-NOTES: pinning raises on CPU).
    offload = CPUOffloadPolicy(pin_memory=plan.pin_memory and runtime.on_gpu)
    reshard = plan.zero_stage in (0, 3)  # stage 0: frees the 16-bit copies after forward
    blocks = _blocks(model)
    # One block at a time: materialized on the CPU (the model is built on the meta device),
    # then sharded, so the host never holds more than a block and the root in full.
    for index, (key, block) in enumerate(model.layers.items()):
        materialize(block, plan.seed, prefix=f"layers.{key}.")
        if plan.lora is not None:
            store_base(block, plan.lora, in_layers=True, device=runtime.device)
        offloaded = plan.offload_params and index >= plan.resident_layers
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp_policy,
                    offload_policy=offload if offloaded else OffloadPolicy(),
                    ignored_params=kept_whole(block, plan, dp_mesh, runtime.device))
    for name, child in model.named_children():
        if name != "layers":
            materialize(child, plan.seed, prefix=f"{name}.", tied_head=plan.tied_head)
            if plan.lora is not None:
                store_base(child, plan.lora, in_layers=False)
    # The root (embedding, final norm, head) is needed again as soon as backward starts:
    # torch's default (None) keeps it gathered from forward to backward.
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=None if reshard else False, mp_policy=mp_policy)
    ahead = plan.prefetch_layers
    for index, block in enumerate(blocks):
        following = blocks[index + 1:index + 1 + ahead]
        preceding = blocks[max(0, index - ahead):index][::-1]
        if following:
            block.set_modules_to_forward_prefetch(following)
        if preceding:
            block.set_modules_to_backward_prefetch(preceding)


def kept_whole(block: nn.Module, plan: ParallelPlan, dp_mesh, device: torch.device) -> set[nn.Parameter]:
    """QLoRA's NF4 weights on a shard group of one rank (ZeRO 0's (dp, 1) mesh, or one
    data-parallel rank), moved to `device` and left out of FSDP2 (`ignored_params`): FSDP2
    skips the all-gather on one rank and hands torchao's NF4Tensor only the first of its three
    all-gather inputs (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py, world_size
    == 1), which NF4Tensor.fsdp_post_all_gather cannot unpack. One rank holds the whole weight
    either way; frozen, it has no gradient to reduce, and its linear dequantizes it to the
    input's dtype, which the block's mixed-precision policy still casts. Each inner tensor
    keeps only its own storage, as FSDP2's shards do (core/finetune.py `frozen_bytes`):
    `to_nf4` leaves a single quantization factor a view of its (1, 256) column's storage."""
    if plan.lora is None or plan.lora.base_dtype != "nf4" or dp_mesh.size(dp_mesh.ndim - 1) > 1:
        return set()
    kept = set()
    for module in block.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if not is_quantized(param):
                continue
            if param.device != device:  # fully_shard moves only the parameters it manages
                param = nn.Parameter(param.to(device), requires_grad=False)
                setattr(module, name, param)
            for inner in param.__tensor_flatten__()[0]:
                data = getattr(param, inner)
                if data.untyped_storage().nbytes() > data.numel() * data.element_size():
                    setattr(param, inner, data.clone())
            kept.add(param)
    return kept


def apply_ddp(model: nn.Module, runtime: Runtime) -> nn.Module:
    device_ids = [runtime.device.index] if runtime.on_gpu else None
    return DistributedDataParallel(model, process_group=runtime.group("dp"), device_ids=device_ids,
                                   gradient_as_bucket_view=True)


def engine_groups(modules: list[nn.Module]) -> dict[nn.Parameter, str]:
    """The offload engine's groups: each block's parameters (an FSDP module), and the rest of
    each stage (its root)."""
    group_of: dict[nn.Parameter, str] = {}
    for index, module in enumerate(modules):
        inner = unwrapped(module)
        for key, block in inner.layers.items():
            for p in block.parameters():
                group_of[p] = f"layers.{key}"
        for p in inner.parameters():
            group_of.setdefault(p, f"root.{index}")
    return group_of


def host_parameters(modules: list[nn.Module]) -> frozenset:
    """Parameters that FSDP2's CPUOffloadPolicy keeps on the host."""
    return frozenset(p for module in modules for block in unwrapped(module).layers.values()
                     if offloaded_block(block) for p in block.parameters())


def build_optimizer(modules: list[nn.Module], runtime: Runtime, plan: ParallelPlan):
    """The optimizer stepping where the plan keeps the states: torch's AdamW/SGD for states on
    the device; the offload engine (runtime/offload.py) for states on the host (optimizer
    offload, or the blocks CPUOffloadPolicy keeps there); ZeroRedundancyOptimizer at stage 1."""
    params = [p for module in modules for p in module.parameters() if p.requires_grad]  # LoRA: the adapters
    if plan.optimizer == "adamw8bit":
        kind = adamw8bit_class()  # torchao's AdamW8bit
    else:
        kind = torch.optim.AdamW if plan.optimizer == "adamw" else torch.optim.SGD
    on_host = host_parameters(modules)
    engine_params = [p for p in params if plan.offload_optimizer or p in on_host]
    sharded_by_zero = plan.zero_stage == 1 and runtime.layout.degrees.dp > 1
    if not engine_params:
        if sharded_by_zero:
            return ZeroRedundancyOptimizer(params, optimizer_class=kind, process_group=runtime.group("dp"), lr=plan.lr)
        return kind(params, lr=plan.lr)
    config = EngineConfig(
        optimizer=plan.optimizer, compression=plan.compression, prefetch=plan.prefetch_layers,
        free_device_grads=frees_device_grads(plan.offload_grads, plan.offload_optimizer, plan.zero_stage),
        pin=plan.pin_memory and runtime.on_gpu, seed=plan.seed, rank=runtime.rank,
    )
    engine_class = partial(HostOptimizer, config=config, device=runtime.device, group_of=engine_groups(modules),
                           on_host=on_host)
    if sharded_by_zero:  # every state on the host: ZeRO partitions, the engine steps its share
        optimizer = ZeroRedundancyOptimizer(params, optimizer_class=engine_class, process_group=runtime.group("dp"),
                                            lr=plan.lr)
        for module in modules:
            optimizer.optim.watch_ddp(module, runtime.group("dp"))
        return optimizer
    engine = engine_class(engine_params, plan.lr)
    engine.watch_fsdp()
    held = set(engine_params)
    device_params = [p for p in params if p not in held]
    return OptimizerSet([kind(device_params, lr=plan.lr), engine]) if device_params else engine


def offloaded_block(block: nn.Module) -> bool:
    """Whether `fully_shard` keeps this block's parameters on the CPU (its CPUOffloadPolicy)."""
    if not hasattr(block, "_get_fsdp_state"):
        return False
    group = block._get_fsdp_state()._fsdp_param_group
    return group is not None and isinstance(group.offload_policy, CPUOffloadPolicy)


def unwrapped(module: nn.Module) -> nn.Module:
    """The model inside a DistributedDataParallel wrapper (stage 1), else the module itself."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def parallelize(model: nn.Module, runtime: Runtime, plan: ParallelPlan) -> nn.Module:
    """Apply tp, checkpointing and data parallelism to `model` (a whole model or a stage)."""
    if plan.precision == "bf16":
        model.to(torch.bfloat16)
    if plan.lora is not None:
        cast_frozen(model)  # on the meta device: the frozen base is built in bf16
    if runtime.layout.degrees.tp > 1:
        apply_tensor_parallel(model, runtime, plan.sequence_parallel)
    apply_checkpointing(model, plan.recompute)
    if plan.zero_stage != 1:
        apply_fsdp(model, runtime, plan)  # fully_shard moves the states to the mesh's device
        return model
    materialize(model, plan.seed, tied_head=plan.tied_head)  # DDP replicates whole tensors
    model.to(runtime.device)
    if runtime.layout.degrees.dp > 1:
        return apply_ddp(model, runtime)
    return model
