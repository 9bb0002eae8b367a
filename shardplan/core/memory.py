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

from .estimate import Coordinates, DeviceEstimate, Estimate, param_counts, rank_estimate, torch_sequence_parallel_extra
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


def cpu_limit(inputs: EstimateInputs) -> int:
    """CPU bytes a node may use: its RAM when known, and the job's cpu_memory_budget."""
    return min(inputs.cpu_memory_per_node or inputs.cpu_memory_budget, inputs.cpu_memory_budget)


def _strategy(inputs: EstimateInputs, layout: Layout,
              devices: list[DeviceEstimate]) -> tuple[EstimateInputs, list[str]]:
    """Offload more until the peak is under the strategy's share of the GPU memory, never
    past the node's CPU limit; `devices` are the figures without further offload."""
    if inputs.gpu_memory is None:
        return inputs, []
    threshold = PRESSURE[inputs.strategy]
    target = int(threshold * inputs.gpu_memory)
    limit = cpu_limit(inputs)
    peak = _peak(devices)
    share = lambda value: f"{format_bytes(value)} ({value / inputs.gpu_memory:.0%})"
    head = f"strategy {inputs.strategy} (peak at most {threshold:.0%} of {format_bytes(inputs.gpu_memory)})"
    if peak <= target:
        return inputs, [f"{head}: peak {share(peak)}; no further offload"]
    decisions = [f"{head}: peak {share(peak)} is over"]
    steps = ["offload_optimizer", "offload_grads"] if inputs.framework != "fsdp2" else []
    for flag in steps:
        if getattr(inputs, flag):
            continue
        trial = inputs.with_(**{flag: True})
        trial_devices = _devices(trial, layout)
        what = flag.removeprefix("offload_").replace("optimizer", "optimizer states").replace("grads", "gradients")
        cpu = _cpu_per_node(trial_devices, layout)
        if cpu > limit:
            decisions.append(f"not offloading {what}: a node would need {format_bytes(cpu)} of CPU memory, "
                             f"over its {format_bytes(limit)} (cpu_memory_budget / cpu_memory_per_node)")
            return inputs, decisions
        inputs, peak = trial, _peak(trial_devices)
        decisions.append(f"offload {what}: peak {share(peak)}")
        if peak <= target:
            return inputs, decisions
    if inputs.zero_stage != 3:
        decisions.append(f"parameters can only be offloaded with zero.stage = 3 (got {inputs.zero_stage}); stopping")
        return inputs, decisions
    chosen, resident, peak, cpu_bound = _fewest_offloaded_layers(inputs, layout, target, limit)
    layers = max(d.num_layers for d in _devices(chosen, layout))
    if resident == layers:
        decisions.append(f"offloading layers would take more CPU memory than the {format_bytes(limit)} limit")
        return inputs, decisions
    along = " with their gradients and optimizer states" if inputs.framework == "fsdp2" else ""
    decisions.append(f"offload the parameters of {layers - resident} of {layers} layers{along}: peak {share(peak)}")
    if cpu_bound:
        decisions.append(f"stopped by the CPU limit ({format_bytes(limit)} per node)")
    elif peak > target:
        decisions.append("still over the threshold with every layer offloaded")
    return chosen, decisions


def _search(low: int, high: int, good) -> int | None:
    """The largest value in [low, high] for which the monotone `good` holds (None if none)."""
    best = None
    while low <= high:
        middle = (low + high) // 2
        if good(middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def _fewest_offloaded_layers(inputs: EstimateInputs, layout: Layout, target: int,
                             limit: int) -> tuple[EstimateInputs, int, int, bool]:
    """Most resident layers whose GPU peak meets `target`; fewer resident layers cost CPU
    memory, so never below the fewest the CPU `limit` allows. Returns (inputs, resident,
    peak, whether the CPU limit decided)."""
    current = inputs.with_(offload_params=True)
    layers = max(d.num_layers for d in _devices(inputs, layout))
    upper = min(layers, max(d.resident_layers for d in _devices(current, layout))) if inputs.offload_params else layers
    at = lambda resident: _devices(current.with_(resident_layers=resident), layout)
    by_gpu = _search(0, upper, lambda r: _peak(at(r)) <= target)
    # CPU use falls as more layers stay resident: the fewest resident the CPU allows.
    by_cpu = _search(0, upper, lambda r: _cpu_per_node(at(upper - r), layout) <= limit)
    fewest = upper - by_cpu if by_cpu is not None else upper
    wanted = by_gpu if by_gpu is not None else 0  # every layer offloaded when none meets the target
    resident = max(wanted, fewest)
    chosen = current.with_(resident_layers=resident)
    return chosen, resident, _peak(_devices(chosen, layout)), fewest > wanted


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
        "communication_buffers": "fsdp2 stages 0, 2, 3: all-gathered blocks (1 + prefetch_layers), root kept "
                                 "unsharded, one block's gradients before reduce-scatter; stage 1 (DDP): "
                                 "gradient buckets are the gradients (gradient_as_bucket_view)",
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
        limit = cpu_limit(inputs)
        if cpu_node > limit:
            fits = False
            warnings.append(f"a node needs {format_bytes(cpu_node)} of CPU memory, over its limit {format_bytes(limit)}")
    gathered = torch_sequence_parallel_extra(inputs)
    if gathered:
        warnings.append(f"sequence parallel is counted as Megatron-LM keeps it (Korthikanti et al.); torch's "
                        f"DTensor plan, which `shardplan run` uses, also keeps the gathered QKV and MLP inputs: "
                        f"{format_bytes(gathered)} more per layer and microbatch held (docs/estimate.md)")
    if inputs.shape is None:
        warnings.append("no architecture: model states only (activations and the buffers that depend on the "
                        "layers are not estimated)")
    result = Estimate(param_counts(inputs), devices, peak, cpu_node, fits, assumptions(inputs), warnings, decisions)
    result.cpu_pinned = inputs.pin_memory and inputs.on_gpu and cpu_node > 0
    result.inputs = inputs
    result.assumptions["offload"] = {
        "params": inputs.offload_params, "grads": inputs.offload_grads, "optimizer": inputs.offload_optimizer,
        "resident_layers": [d.resident_layers for d in devices],
    }
    return result
