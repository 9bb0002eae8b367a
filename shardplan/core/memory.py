"""The whole estimate: every pipeline stage, per-node CPU memory, the offload strategy's
decisions, and whether the plan fits.

Offload strategy (`[offload] strategy`): when the GPU memory is known, the strategy's
pressure threshold (conservative 0.9, balanced 0.75, aggressive 0.6, extreme 0.4) is the
share of it the peak may use. Over it, the planner offloads more, in the order that costs
the least speed, and stops as soon as the peak is under the threshold:

- deepspeed: optimizer states (ZeRO-Offload), then gradients, then parameters layer by
  layer (ZeRO-Infinity, stage 3 only);
- fsdp2: parameters layer by layer (stage 3 only), each offloaded layer taking its gradients
  and optimizer states along (`CPUOffloadPolicy`).

What the job file asks for is never undone; the strategy only adds, and says so.
"""

from __future__ import annotations

from .estimate import Coordinates, DeviceEstimate, Estimate, param_counts, rank_estimate
from .estimate_inputs import EstimateInputs
from .layout import Layout
from .buffers import CUDA_CONTEXT_BYTES, FRAGMENTATION
from ..spec.units import format_bytes

PRESSURE = {"conservative": 0.9, "balanced": 0.75, "aggressive": 0.6, "extreme": 0.4}


def _devices(inputs: EstimateInputs, layout: Layout) -> list[DeviceEstimate]:
    pp_column = layout.column("pp")
    ranks_of_stage: list[list[int]] = [[] for _ in range(inputs.degrees.pp)]
    for rank, stage in enumerate(pp_column):
        ranks_of_stage[stage].append(rank)
    return [
        rank_estimate(inputs, Coordinates(pp_rank=stage), ranks_of_stage[stage])
        for stage in range(inputs.degrees.pp)
    ]


def _cpu_per_node(devices: list[DeviceEstimate], layout: Layout) -> int:
    """The busiest node's CPU bytes: each rank counts its stage's figure."""
    per_rank = [devices[stage].cpu["total"] for stage in layout.column("pp")]
    gpn = layout.gpus_per_node
    return max(sum(per_rank[start:start + gpn]) for start in range(0, len(per_rank), gpn))


def _peak(devices: list[DeviceEstimate]) -> int:
    return max(d.gpu["total"] for d in devices)


def _strategy(inputs: EstimateInputs, layout: Layout,
              devices: list[DeviceEstimate]) -> tuple[EstimateInputs, list[str]]:
    """Offload more until the peak is under the strategy's share of the GPU memory;
    `devices` are the figures without further offload."""
    if inputs.gpu_memory is None:
        return inputs, []
    threshold = PRESSURE[inputs.strategy]
    target = int(threshold * inputs.gpu_memory)
    peak = _peak(devices)
    head = f"strategy {inputs.strategy} (peak at most {threshold:.0%} of {format_bytes(inputs.gpu_memory)})"
    if peak <= target:
        return inputs, [f"{head}: peak {format_bytes(peak)} ({peak / inputs.gpu_memory:.0%}); no further offload"]
    decisions = [f"{head}: peak {format_bytes(peak)} ({peak / inputs.gpu_memory:.0%}) is over"]
    steps: list[str] = []
    if inputs.framework == "deepspeed":
        steps = ["offload_optimizer", "offload_grads"]
    for flag in steps:
        if getattr(inputs, flag):
            continue
        inputs = inputs.with_(**{flag: True})
        peak = _peak(_devices(inputs, layout))
        what = flag.removeprefix("offload_").replace("optimizer", "optimizer states").replace("grads", "gradients")
        decisions.append(f"offload {what}: peak {format_bytes(peak)} ({peak / inputs.gpu_memory:.0%})")
        if peak <= target:
            return inputs, decisions
    if inputs.zero_stage != 3:
        decisions.append(f"parameters can only be offloaded with zero.stage = 3 (got {inputs.zero_stage}); stopping")
        return inputs, decisions
    inputs, resident, peak = _fewest_offloaded_layers(inputs, layout, target)
    layers = max(d.num_layers for d in _devices(inputs, layout))
    along = " with their gradients and optimizer states" if inputs.framework == "fsdp2" else ""
    decisions.append(
        f"offload the parameters of {layers - resident} of {layers} layers{along}: "
        f"peak {format_bytes(peak)} ({peak / inputs.gpu_memory:.0%})"
    )
    if peak > target:
        decisions.append("still over the threshold with every layer offloaded")
    return inputs, decisions


def _fewest_offloaded_layers(inputs: EstimateInputs, layout: Layout, target: int) -> tuple[EstimateInputs, int, int]:
    """Binary search for the most resident layers whose peak meets `target`."""
    layers = max(d.num_layers for d in _devices(inputs, layout))
    current = inputs.with_(offload_params=True)
    upper = min(layers, max(d.resident_layers for d in _devices(current, layout))) \
        if inputs.offload_params else layers
    low, high = 0, upper
    best = current.with_(resident_layers=0)
    while low <= high:
        middle = (low + high) // 2
        trial = current.with_(resident_layers=middle)
        if _peak(_devices(trial, layout)) <= target:
            best, low = trial, middle + 1
        else:
            high = middle - 1
    resident = best.resident_layers or 0
    return best, resident, _peak(_devices(best, layout))


def assumptions(inputs: EstimateInputs) -> dict[str, object]:
    return {
        "framework": inputs.framework,
        "precision": inputs.precision,
        "optimizer": inputs.optimizer,
        "seq_len": inputs.seq_len,
        "micro_batch_size": inputs.micro_batch,
        "num_microbatches": inputs.num_microbatches,
        "pipeline_schedule": inputs.schedule,
        "activation_checkpointing": inputs.recompute,
        "attention": inputs.attention,
        "devices_shown": "each stage's fullest rank (tp rank 0, shard index 0)",
        "cuda_context_bytes": CUDA_CONTEXT_BYTES if inputs.on_gpu else 0,
        "fragmentation_allowance": FRAGMENTATION if inputs.on_gpu else 0,
        "logits_and_loss": "fp32 log-probabilities kept for backward on the last stage (sb*V/t*4 B), "
                           "their gradient at the start of backward",
        "embedding_output": "token ids (int64) and, with dropout, the embedding dropout mask",
        "communication_buffers": "fsdp2: all-gathered blocks (1 + prefetch_layers), root kept unsharded, "
                                 "one block's gradients before reduce-scatter; DDP: gradient buckets are "
                                 "the gradients (gradient_as_bucket_view)",
        "cpu_memory": "offloaded model states only (pinned when pin_memory and a GPU); "
                      "the processes' own memory is not included",
    }


def estimate_memory(inputs: EstimateInputs) -> Estimate:
    """The estimate of a plan: every pipeline stage's fullest rank, per-node CPU, the fit."""
    layout = Layout(inputs.degrees, inputs.order, inputs.gpus_per_node)
    devices = _devices(inputs, layout)
    decided, decisions = _strategy(inputs, layout, devices)
    if decided is not inputs:
        inputs, devices = decided, _devices(decided, layout)
    peak = _peak(devices)
    cpu_node = _cpu_per_node(devices, layout)
    fits = None
    warnings: list[str] = []
    if inputs.gpu_memory is not None:
        fits = peak <= inputs.gpu_memory
        if not fits:
            warnings.append(f"the peak device needs {format_bytes(peak)}, more than its {format_bytes(inputs.gpu_memory)}")
        cpu_limit = min(inputs.cpu_memory_per_node or cpu_node, inputs.cpu_memory_budget)
        if cpu_node > cpu_limit:
            fits = False
            warnings.append(f"a node needs {format_bytes(cpu_node)} of CPU memory, over its limit {format_bytes(cpu_limit)}")
    if inputs.shape is None:
        warnings.append("no architecture: model states only (activations and communication buffers not estimated)")
    result = Estimate(param_counts(inputs), devices, peak, cpu_node, fits, assumptions(inputs), warnings, decisions)
    result.assumptions["offload"] = {
        "params": inputs.offload_params, "grads": inputs.offload_grads, "optimizer": inputs.offload_optimizer,
        "resident_layers": [d.resident_layers for d in devices],
    }
    return result
