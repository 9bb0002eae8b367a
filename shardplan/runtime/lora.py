"""LoRA, QLoRA and 8-bit AdamW for `shardplan run`, with the libraries that implement them.

- peft injects the adapters into the model `run` builds, by module name (q_proj ... down_proj,
  the names of core/params.py), on the meta device (`low_cpu_mem_usage=True`), and freezes
  the base. The model is then materialized a block at a time (runtime/model.py); each block's
  frozen base is stored as the plan says (bf16, or torchao's NF4Tensor for the layer linears,
  as torchtune's QLoRA does) just before `fully_shard` shards it. torchao's NF4Tensor
  implements FSDP2's all-gather hooks, so FSDP2 shards and gathers it as 4-bit codes; on a
  shard group of one rank FSDP2 skips those hooks' all-gather, and the NF4 weights stay out
  of it, whole (runtime/parallel.py `kept_whole`).
- torchao's AdamW8bit keeps block-wise 8-bit moments (Dettmers et al. 2022).

The libraries are the `finetune` extra; `run` checks they are installed before starting
(cli/run_cmd.py).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ..core.lora import LINEAR_SUFFIX
from ..spec.job import LoraSpec

ADAPTER = "default"  # peft's adapter name: parameters are `<linear>.lora_A.default.weight`


def add_adapters(model: nn.Module, lora: LoraSpec) -> None:
    """Inject LoRA adapters into `model`'s target linears (peft) and freeze everything else.
    On a meta-device model the adapters stay on the meta device until materialized."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.targets), bias="none")
    inject_adapter_in_model(config, model, adapter_name=ADAPTER, low_cpu_mem_usage=True)


def preload_libraries(job) -> None:
    """Import the fine-tuning libraries the job uses (peft imports transformers: tens of MB),
    so that a rank's measured growth from here on is its training, not their code."""
    if job.lora is not None:
        import peft  # noqa: F401
    if (job.lora is not None and job.lora.base_dtype == "nf4") or job.train.optimizer == "adamw8bit":
        import torchao  # noqa: F401


def _frozen_linears(module: nn.Module) -> list[nn.Linear]:
    """The layer linears whose weights are the frozen base (peft's `base_layer`s and the
    linears without adapters), by the parameter names of core/params.py."""
    found = []
    for name, child in module.named_modules():
        if not isinstance(child, nn.Linear) or child.weight.requires_grad:
            continue
        weight_name = f"{name}.weight".replace(".base_layer", "")
        if weight_name.endswith(LINEAR_SUFFIX):
            found.append(child)
    return found


def cast_frozen(model: nn.Module) -> None:
    """The frozen base in bf16 (on the meta device, before tensor parallel and materializing)."""
    for param in model.parameters():
        if not param.requires_grad and param.is_floating_point() and param.dtype != torch.bfloat16:
            param.data = param.data.to(torch.bfloat16)


def with_adapters(block: nn.Module, plan: dict) -> dict:
    """A block's tensor-parallel plan with peft's adapters split with their linears (Megatron
    placement, core/lora.py): a column-parallel linear's B by rows (ColwiseParallel: its output
    is the linear's local slice), a row-parallel linear's A by columns (RowwiseParallel: it reads
    the linear's local input, and its rank-r output is all-reduced before B); the other whole."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    result = {}
    for key, style in plan.items():
        module = block.get_submodule(key)
        if not hasattr(module, "base_layer"):
            result[key] = style
            continue
        result[f"{key}.base_layer"] = style
        if isinstance(style, ColwiseParallel):
            result[f"{key}.lora_B.{ADAPTER}"] = ColwiseParallel()
        elif isinstance(style, RowwiseParallel):
            result[f"{key}.lora_A.{ADAPTER}"] = RowwiseParallel()
    return result


@torch.no_grad()
def store_base(module: nn.Module, lora: LoraSpec, in_layers: bool, device: torch.device | None = None) -> None:
    """Store a materialized module's frozen parameters as the plan says: bf16 (`cast_frozen`
    did it on the meta device; a module built otherwise is cast here), and the layer linears
    (`in_layers`) as NF4 under QLoRA (quantized from bf16, torchao's `to_nf4` with its default
    blocks of 64 and scaler blocks of 256), on `device`, the rank's: the weights go there
    anyway, and quantizing there is fast (on a CPU `to_nf4` codes about 17M elements a second
    on 2 cores, a 70B model's layers in over an hour)."""
    if lora.base_dtype == "nf4" and in_layers:
        from torchao.quantization.quantize_.workflows.nf4.nf4_tensor import to_nf4

        for linear in _frozen_linears(module):
            weight = linear.weight.detach().to(device=device or linear.weight.device, dtype=torch.bfloat16)
            linear.weight = nn.Parameter(to_nf4(weight), requires_grad=False)
    for param in module.parameters():
        if not param.requires_grad and param.dtype != torch.bfloat16 and param.is_floating_point():
            param.data = param.data.to(torch.bfloat16)


def is_quantized(tensor: torch.Tensor) -> bool:
    """A tensor subclass made of inner tensors (torchao's NF4Tensor, OptimState8bit)."""
    return type(tensor) is not torch.Tensor and hasattr(tensor, "__tensor_flatten__") \
        and type(tensor).__name__ not in ("DTensor", "Parameter")


def inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors holding a quantized tensor's data (recursively)."""
    names, _ = tensor.__tensor_flatten__()
    found = []
    for name in names:
        inner = getattr(tensor, name)
        found += inner_tensors(inner) if is_quantized(inner) else [inner]
    return found


def adamw8bit_class() -> type[torch.optim.Optimizer]:
    """torchao's AdamW8bit (block size 256, its default)."""
    from torchao.optim import AdamW8bit

    return AdamW8bit
