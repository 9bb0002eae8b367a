"""The whole estimate: every pipeline stage, per-node host memory, the offload strategy's
decisions, and whether the plan fits.

Offload strategy (`[offload] strategy`): when the GPU memory is known, the strategy says how
much of it the peak may use: `conservative` offloads nothing beyond what the job asks,
`balanced` (the default) only as far as the plan needs to fit (100%), `aggressive` until a
quarter of the GPU is free (75%), `extreme` until half is (50%). Over it, the planner offloads
more, in the order that costs the least speed, and stops as soon as the peak is under:

- deepspeed: optimizer states with the gradient partitions (ZeRO-Offload's offload_optimizer
  moves both), then every parameter (ZeRO-Infinity's offload_param, stage 3 only: it has no
  layer-by-layer budget);
- fsdp2: optimizer states with fp32 master weights (the offload engine of `run`, core/offload.py),
  then gradients, then parameters layer by layer (stage 3 only), each offloaded layer taking
  its gradients and optimizer states along (`CPUOffloadPolicy`). Moving optimizer states costs
  the CPU step and one copy of gradients and parameters per step; moving parameters costs
  copies in every forward and backward: the cheaper first.

What the job file asks for is never undone; the strategy only adds, and says so.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from .buffers import CUDA_CONTEXT_BYTES, FRAGMENTATION
from .estimate import (
    Coordinates,
    DeviceEstimate,
    _rank_params,
    param_counts,
    rank_estimate,
    resident_layers,
    shard_degree,
    torch_sequence_parallel_extra,
)
from .precision import element_bytes
from .estimate_inputs import EstimateInputs
from .figures import rank_figures, rank_host_figures
from .host import PROCESS_HOST_BYTES, PROCESS_HOST_BYTES_CPU, node_host, process_allowance
from .layout import Layout
from .offload import ENGINE_OPTIMIZERS
from ..spec.units import GIB, format_bytes

# Share of the GPU memory the peak may use under each strategy (None: never offload more).
PRESSURE = {"conservative": None, "balanced": 1.0, "aggressive": 0.75, "extreme": 0.5}


@dataclass
class Estimate:
    params: dict[str, int]
    devices: list[DeviceEstimate]
    peak_gpu_bytes: int
    cpu_bytes_per_node: int  # = host["per_node"]
    fits: bool | None
    assumptions: dict[str, object] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    cpu_pinned: bool = False  # offloaded states in page-locked memory (pin_memory, on a GPU node)
    host_moment: str = "training"  # the host moment that needs the most on the busiest node
    host_breakdown: dict[str, int] = field(default_factory=dict)  # bytes by label on that node
    # The plan as the offload strategy decided it (what is offloaded, resident layers): what
    # `shardplan run` executes.
    inputs: EstimateInputs | None = None


def _devices(inputs: EstimateInputs, layout: Layout) -> list[DeviceEstimate]:
    pp_column = layout.column("pp")
    ranks_of_stage: list[list[int]] = [[] for _ in range(inputs.degrees.pp)]
    for rank, stage in enumerate(pp_column):
        ranks_of_stage[stage].append(rank)
    return [
        rank_estimate(inputs, Coordinates(pp_rank=stage), ranks_of_stage[stage])
        for stage in range(inputs.degrees.pp)
    ]


@lru_cache(maxsize=1024)
def node_mixes(degrees, order: str, gpus_per_node: int) -> tuple[tuple[int, ...], ...]:
    """The distinct multisets of pipeline stages that a node's ranks hold (sorted)."""
    stages = Layout(degrees, order, gpus_per_node).column("pp")
    return tuple(sorted({tuple(sorted(stages[start:start + gpus_per_node]))
                         for start in range(0, len(stages), gpus_per_node)}))


# Schedules under which a pipeline rank holds no more microbatches than the rank before it,
# with one model chunk per rank (core/schedule.py: 1F1B holds pp - r, GPipe and zero-bubble
# the same on every rank).
MONOTONE_SCHEDULES = ("1f1b", "gpipe", "zero-bubble")


def _candidate_stages(inputs: EstimateInputs, single_stage_nodes: bool) -> range | tuple[int, ...]:
    """The stages whose figures can be the largest. Under a monotone schedule the middle
    stages hold their layers in order of decreasing layer counts (the even split gives the
    first stages the extra layer) and decreasing held microbatches, with the same blocks and
    no embedding or head: every figure of a middle stage grows with both, so stage 1 bounds
    the others (tests/test_plan.py checks the shortcut against every stage). With nodes that
    mix stages, the host needs them all."""
    pp = inputs.degrees.pp
    if pp <= 3 or inputs.schedule not in MONOTONE_SCHEDULES or inputs.virtual > 1 or not single_stage_nodes:
        return range(pp)
    return (0, 1, pp - 1)


def plan_figures(inputs: EstimateInputs, stop_above: int | None = None) -> tuple[int, int]:
    """(peak GPU bytes over the stages, host bytes of the busiest node) of `inputs` exactly as
    given: the numbers `estimate_memory` reports for the same inputs when its offload strategy
    adds nothing, computed from the same parts without building a term (the planner's inner
    loop; tests/test_plan.py holds the two equal). `stop_above`: once a stage's peak exceeds
    it, return (that peak, 0) without the other stages: the plan does not fit, and the peak
    returned is a lower bound of the plan's. The full figures are kept on the instance (as
    `with_` drops them from copies): the offload strategy measures the plan it decides on, and
    the search then checks that same plan."""
    known = inputs.__dict__.get("_figures")
    if known is not None:
        return known
    mixes = node_mixes(inputs.degrees, inputs.order, inputs.gpus_per_node)
    single = all(len(set(mix)) == 1 for mix in mixes)
    gpu_stages = _candidate_stages(inputs, True)  # stage 1 bounds the middle ones' GPU either way
    peak = 0
    host: dict[int, tuple[int, int]] = {}
    allowance = process_allowance(inputs.on_gpu).bytes
    for stage in gpu_stages:
        figures = rank_figures(inputs, Coordinates(pp_rank=stage))
        peak = max(peak, max(figures.moments.values()))
        if stop_above is not None and peak > stop_above:
            return peak, 0
        host[stage] = (figures.host + allowance, figures.startup + allowance)
    for stage in _candidate_stages(inputs, single):
        if stage not in host:  # a middle stage a node mixes with others: its host bytes only
            training, startup = rank_host_figures(inputs, Coordinates(pp_rank=stage))
            host[stage] = (training + allowance, startup + allowance)
    node = 0
    for mix in mixes:
        if any(stage not in host for stage in mix):
            continue  # a middle stage's node, bounded by stage 1's (single-stage nodes only)
        training = sum(host[stage][0] for stage in mix)
        startup = sum(host[stage][1] for stage in mix)
        node = max(node, training, startup)
    inputs.__dict__["_figures"] = (peak, node)
    return peak, node


def _host(devices: list[DeviceEstimate], layout: Layout, on_gpu: bool = True) -> tuple[int, str, dict[str, int]]:
    """The busiest node's host bytes, at its larger moment, with the breakdown: each rank
    counts its stage's figures (core/host.py). Nodes that hold the same stages need the same,
    so only distinct mixes of stages are added up."""
    stages = layout.column("pp")
    gpn = layout.gpus_per_node
    seen: set[tuple[int, ...]] = set()
    best = (0, "training", {})
    for start in range(0, len(stages), gpn):
        mix = tuple(sorted(stages[start:start + gpn]))
        if mix in seen:
            continue
        seen.add(mix)
        node = node_host([(devices[stage].host, devices[stage].startup) for stage in mix], on_gpu)
        if node[0] > best[0]:
            best = node
    return best


def _cpu_per_node(devices: list[DeviceEstimate], layout: Layout, on_gpu: bool = True) -> int:
    return _host(devices, layout, on_gpu)[0]


def _peak(devices: list[DeviceEstimate]) -> int:
    return max(d.gpu["total"] for d in devices)


def cpu_limit(inputs: EstimateInputs) -> int:
    """Host bytes a node may use: the job's cpu_memory_budget (by default the node's RAM less
    a reserve, core/estimate_inputs.py), and never more than the RAM when it is known."""
    return min(inputs.cpu_memory_per_node or inputs.cpu_memory_budget, inputs.cpu_memory_budget)


# What the offload strategy reads of a plan: (peak GPU bytes, host bytes of the busiest node,
# most layers of a stage, most resident layers of a stage).
Measure = Callable[[EstimateInputs], tuple[int, int, int, int]]


def _explained_measure(layout: Layout, first: EstimateInputs, devices: list[DeviceEstimate]) -> Measure:
    """The strategy's figures from the explained estimate (`estimate_memory`)."""
    seen: dict[EstimateInputs, tuple[int, int, int, int]] = {}

    def figures(devices: list[DeviceEstimate], inputs: EstimateInputs) -> tuple[int, int, int, int]:
        return (_peak(devices), _cpu_per_node(devices, layout, inputs.on_gpu),
                max(d.num_layers for d in devices), max(d.resident_layers for d in devices))

    seen[first] = figures(devices, first)

    def measure(inputs: EstimateInputs) -> tuple[int, int, int, int]:
        if inputs not in seen:
            seen[inputs] = figures(_devices(inputs, layout), inputs)
        return seen[inputs]

    return measure


def numeric_measure(inputs: EstimateInputs) -> tuple[int, int, int, int]:
    """The same figures from the planner's numeric twin (`plan_figures`, equal to the
    explained estimate's: tests/test_plan_figures.py)."""
    peak, host = plan_figures(inputs)
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    degree = shard_degree(inputs)
    layers = resident = 0
    for stage in range(inputs.degrees.pp):
        rp = _rank_params(inputs, Coordinates(pp_rank=stage))
        layers = max(layers, rp.num_layers)
        resident = max(resident, resident_layers(rp, eb, inputs, degree))
    return peak, host, layers, resident


def resolve_offload(inputs: EstimateInputs) -> EstimateInputs:
    """The plan after the offload strategy's decision, as `estimate_memory(inputs).inputs`
    gives it, from the numeric figures (the planner's path; tests/test_plan.py)."""
    return decide_offload(inputs, numeric_measure)[0]


def _strategy(inputs: EstimateInputs, layout: Layout,
              devices: list[DeviceEstimate]) -> tuple[EstimateInputs, list[str]]:
    """The offload strategy's decision and its reasons; `devices` are the figures without
    further offload."""
    return decide_offload(inputs, _explained_measure(layout, inputs, devices))


def strategy_capacity(inputs: EstimateInputs) -> int | None:
    """The GPU bytes a plan may use under the job's offload strategy: its share of the GPU
    memory when the strategy keeps headroom (aggressive, extreme), else all of it."""
    share = PRESSURE.get(inputs.strategy)
    if inputs.gpu_memory is None or share is None or share >= 1:
        return inputs.gpu_memory
    return int(share * inputs.gpu_memory)


def offload_host_need(inputs: EstimateInputs, capacity: int) -> int | None:
    """The least host bytes per node with which the offload strategy brings `inputs` to a plan
    whose peak is at most `capacity`, in whole GiB of limit (None when even a host without
    limit does not): what that plan holds. The strategy goes past a step that needs more than
    the plan it ends with (`decide_offload`), and with the optimizer offloaded a smaller limit
    can be met by offloading more layers, at some speed: so the limit is bisected, with the
    strategy's numeric figures."""

    def holds(limit: int) -> int | None:
        decided = decide_offload(inputs.with_(cpu_memory_per_node=limit, cpu_memory_budget=limit), numeric_measure)[0]
        peak, host = plan_figures(decided)
        return host if peak <= capacity and host <= limit else None

    most = holds(HOST_WITHOUT_LIMIT)
    if most is None:
        return None
    low, high = 0, -(-most // GIB)
    while low < high:
        middle = (low + high) // 2
        if holds(middle * GIB) is None:
            low = middle + 1
        else:
            high = middle
    least = holds(high * GIB)
    return most if least is None else least


# A host limit more than any node holds (1 PiB): what `offload_host_need` and the planner's
# what-would-fit search (io/plan_search.py) lend the offload strategy.
HOST_WITHOUT_LIMIT = 2**50


def decide_offload(inputs: EstimateInputs, measure: Measure) -> tuple[EstimateInputs, list[str]]:
    """Offload more until the peak is under the strategy's share of the GPU memory, ending at a
    plan within the node's CPU limit. A step over that limit is taken provisionally: a later
    step can need less host memory (other staging buffers, or the states of offloaded layers
    counted once), and only the plan the strategy ends with runs. When no later step comes back
    under the limit, the strategy ends at the last plan within it."""
    if inputs.gpu_memory is None:
        return inputs, []
    threshold = PRESSURE[inputs.strategy]
    if threshold is None:
        return inputs, []
    peak = measure(inputs)[0]
    share = lambda value: f"{format_bytes(value)} ({value / inputs.gpu_memory:.0%})"
    target = int(threshold * inputs.gpu_memory)
    limit = cpu_limit(inputs)
    if threshold >= 1:
        head = f"strategy {inputs.strategy} (offload only as far as the plan needs to fit in {format_bytes(inputs.gpu_memory)})"
    else:
        head = (f"strategy {inputs.strategy} (keep the peak under {threshold:.0%} of "
                f"{format_bytes(inputs.gpu_memory)}, at {format_bytes(target)})")
    if peak <= target:
        return inputs, []
    decisions = [f"{head}: without more offload the peak would be {share(peak)}"]
    # The last plan within the CPU limit, its decisions, and the first step past the limit
    # (what it offloads, the host bytes it needs) while the strategy goes on past it.
    within, kept, over = inputs, 1, None

    def back() -> tuple[EstimateInputs, list[str]]:
        what, cpu = over
        return within, decisions[:kept] + [
            f"not offloading {what}: a node would need {format_bytes(cpu)} of CPU memory, over its "
            f"{format_bytes(limit)} (cpu_memory_budget / cpu_memory_per_node), and no further offload needs less"]

    # DeepSpeed moves the fp32 gradients with the optimizer (offload_optimizer); the paper and
    # the fsdp2 engine count gradients on their own.
    steps = {"deepspeed": ["offload_optimizer"]}.get(inputs.framework, ["offload_optimizer", "offload_grads"])
    if inputs.framework == "fsdp2" and inputs.optimizer not in ENGINE_OPTIMIZERS:
        steps = []  # the offload engine of `run` steps these optimizers only
    for flag in steps:
        if getattr(inputs, flag):
            continue
        trial = inputs.with_(**{flag: True})
        trial_peak, cpu, _, _ = measure(trial)
        what = flag.removeprefix("offload_").replace("optimizer", "optimizer states").replace("grads", "gradients")
        if trial_peak >= peak:
            # Freed gradients only help a peak at the step: in backward a block's are in flight.
            decisions.append(f"not offloading {what}: the peak would not fall ({share(trial_peak)})")
            continue
        inputs, peak = trial, trial_peak
        if cpu > limit:
            over = over or (what, cpu)
            decisions.append(f"offload {what}: peak {share(peak)}; a node would need {format_bytes(cpu)} of CPU "
                             f"memory, over its {format_bytes(limit)}: offloading more may need less")
            continue
        within, kept, over = inputs, len(decisions) + 1, None
        decisions.append(f"offload {what}: peak {share(peak)}")
        if peak <= target:
            return inputs, decisions
    if inputs.zero_stage != 3:
        if over:
            return back()
        decisions.append(f"parameters can only be offloaded with zero.stage = 3 (got {inputs.zero_stage}); stopping")
        return inputs, decisions
    if inputs.framework == "deepspeed":
        return _every_parameter(inputs, measure, peak, target, limit, decisions, share, back if over else None)
    chosen, resident, peak, cpu_bound = _fewest_offloaded_layers(inputs, measure, target, limit)
    _, host, layers, _ = measure(chosen)
    if over and (resident == layers or host > limit):
        return back()
    if resident == layers:
        decisions.append(f"offloading layers would take more CPU memory than the {format_bytes(limit)} limit")
        return inputs, decisions
    along = " with their gradients and optimizer states" if inputs.framework == "fsdp2" and not inputs.offload_optimizer else ""
    decisions.append(f"offload the parameters of {layers - resident} of {layers} layers{along}: peak {share(peak)}")
    if cpu_bound == "fewer":
        decisions.append(f"stopped by the CPU limit ({format_bytes(limit)} per node)")
    elif cpu_bound == "more" and host > limit:
        decisions.append(f"every layer offloaded, and a node still needs {format_bytes(host)} of CPU memory, over "
                         f"its {format_bytes(limit)} limit")
    elif cpu_bound == "more":
        decisions.append(f"more layers than the GPU needs: a resident layer's states take more CPU memory than an "
                         f"offloaded layer's, and the CPU limit ({format_bytes(limit)} per node) allows no more resident")
    elif peak > target:
        decisions.append("still over the threshold with every layer offloaded")
    return chosen, decisions


def _every_parameter(inputs: EstimateInputs, measure: Measure, peak: int, target: int, limit: int,
                     decisions: list[str], share, back) -> tuple[EstimateInputs, list[str]]:
    """DeepSpeed's parameter offload, one step: offload_param moves every parameter partition
    (ZeRO-Infinity), so the plan either keeps them all on the GPU or none. `back`, when a step
    went past the CPU limit, returns to the last plan within it."""
    if inputs.offload_params:  # the job asked for it: nothing more to move
        if back is not None:
            return back()
        return inputs, decisions + ["still over the threshold with every parameter offloaded"]
    trial = inputs.with_(offload_params=True)
    trial_peak, cpu, _, _ = measure(trial)
    if back is not None and cpu > limit:
        return back()
    # Past the CPU limit before, a trial back within it is the plan to end with, whatever the
    # peak of the step that went past; else it must lower the peak within the limit.
    if back is None and (trial_peak >= peak or cpu > limit):
        why = (f"the peak would not fall ({share(trial_peak)})" if trial_peak >= peak else
               f"a node would need {format_bytes(cpu)} of CPU memory, over its {format_bytes(limit)} "
               f"(cpu_memory_budget / cpu_memory_per_node)")
        return inputs, decisions + [f"not offloading parameters: {why}"]
    decisions.append(f"offload parameters (every layer's: deepspeed's offload_param): peak {share(trial_peak)}")
    if trial_peak > target:
        decisions.append("still over the threshold with every parameter offloaded")
    return trial, decisions


def _search(low: int, high: int, good, guess: int | None = None) -> int | None:
    """The largest value in [low, high] for which the monotone `good` holds (None if none).
    `high` is tried first: it is the answer whenever the limit does not bind (a host with
    memory to spare), one check instead of a bisection. A `guess` is checked with its
    neighbour (good there and not one above, or not good there and good one below, settles
    it: two checks), else it narrows the bisection."""
    if low <= high and good(high):
        return high
    best = None
    high -= 1
    if guess is not None and low <= guess <= high:
        if good(guess):
            best, low = guess, guess + 1
            if low > high or not good(low):
                return best
            best, low = low, low + 1
        else:
            high = guess - 1
            if high >= low and good(high):
                return high
            high -= 1
    while low <= high:
        middle = (low + high) // 2
        if good(middle):
            best, low = middle, middle + 1
        else:
            high = middle - 1
    return best


def _fewest_offloaded_layers(inputs: EstimateInputs, measure: Measure, target: int,
                             limit: int) -> tuple[EstimateInputs, int, int, str]:
    """Most resident layers whose GPU peak meets `target` and whose host bytes meet the CPU
    `limit`. Returns (inputs, resident, peak, what the CPU limit did: "" when it decided
    nothing, "fewer" when it kept more layers resident than the GPU allows, "more" when it
    offloaded more layers than the GPU needs).

    The GPU peak grows with the resident layers. The host bytes move one way or the other:
    they fall as layers stay resident when an offloaded layer holds more on the host than a
    resident one (parameter offload alone), and they grow when the resident layers' states sit
    on the host as well, in the optimizer offload's pinned buffers (fsdp2's offload engine:
    fp32 master, gradient staging and moments, each rounded up to a power of two), which hold a
    layer in more than FSDP's offloaded shards do. The limit is then a floor on the offloaded
    layers, else a ceiling."""
    current = inputs.with_(offload_params=True)
    layers = measure(inputs)[2]
    upper = min(layers, measure(current)[3]) if inputs.offload_params else layers
    measured: dict[int, tuple[EstimateInputs, tuple[int, int, int, int]]] = {}  # resident -> (plan, figures)

    def at(resident: int) -> tuple[int, int, int, int]:
        if resident not in measured:
            plan = current.with_(resident_layers=resident)
            measured[resident] = plan, measure(plan)
        return measured[resident][1]

    # The GPU: all layers resident when the most meets the target, none when even none
    # resident does not; between, about linearly, so the line through the two ends guesses
    # where it crosses the target and `_search` checks the guess.
    most, least = at(upper)[0], at(0)[0]
    if most <= target:
        by_gpu: int | None = upper
    elif least > target:
        by_gpu = None
    else:
        guess = (target - least) * upper // (most - least)
        by_gpu = _search(0, upper, lambda r: at(r)[0] <= target, guess)  # its first check, the most, is known
    wanted = by_gpu if by_gpu is not None else 0  # every layer offloaded when none meets the target
    if at(0)[1] <= at(upper)[1]:
        # Host bytes grow with the resident layers: the most resident the CPU allows.
        # (Monotone: when the least, at 0 resident, is over the limit, nothing is within it.)
        by_cpu = _search(0, upper, lambda r: at(r)[1] <= limit) if at(0)[1] <= limit else None
        most_allowed = by_cpu if by_cpu is not None else 0
        resident, cpu = min(wanted, most_allowed), "more" if most_allowed < wanted else ""
    else:
        # Host bytes fall as layers stay resident: the fewest resident the CPU allows.
        by_cpu = _search(0, upper, lambda r: at(upper - r)[1] <= limit) if at(upper)[1] <= limit else None
        fewest = upper - by_cpu if by_cpu is not None else upper
        resident, cpu = max(wanted, fewest), "fewer" if fewest > wanted else ""
    at(resident)
    chosen, (peak, *_) = measured[resident]
    return chosen, resident, peak, cpu


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
        "loss": inputs.loss,
        "devices_shown": "each stage's fullest rank (tp rank 0; shard index 0, or under ZeroRedundancyOptimizer "
                         "the rank it gives the most, under DeepSpeed's ZeRO-1/2 the rank with the largest "
                         "grads_in_partition)",
        "peak": "the largest moment of the step (forward, loss, backward, backward end, step); "
                "buffers that never coexist are never added",
        "cuda_context_bytes": CUDA_CONTEXT_BYTES if inputs.on_gpu else 0,
        "fragmentation_allowance": FRAGMENTATION if inputs.on_gpu else 0,
        "host_process_bytes": PROCESS_HOST_BYTES if inputs.on_gpu else PROCESS_HOST_BYTES_CPU,
        "logits_and_loss": _logits_and_loss(inputs),
        "embedding_output": "token ids (int64) and, with dropout, the embedding dropout mask",
        "host_memory": "per node, the larger of start-up (model built on the CPU before sharding) and training "
                       "(offloaded states as allocated, pinned buffers rounded up to a power of two, staging), "
                       "plus a runtime allowance per process",
    }


def _logits_and_loss(inputs: EstimateInputs) -> str:
    """What the loss keeps (docs/estimate.md, "Embedding, head and loss"): the 16-bit logits are
    held until backward by a DeepSpeed loop (transformers' model output) and by torch's pipeline
    stages (pp > 1); `run` at pp = 1 and torchtitan free them (core/estimate.py)."""
    if inputs.framework == "deepspeed":
        kept = "the loop keeps the 16-bit logits until backward (transformers' model output), "
    elif inputs.degrees.pp > 1:
        kept = "the pipeline stage keeps its output, the 16-bit logits, until backward, "
    else:
        kept = "the 16-bit logits are freed before backward, "
    if inputs.loss == "fp32":
        return f"fp32: {kept}fp32 log-probabilities are saved, log_softmax's backward holds two fp32 gradients"
    return f"fused: {kept}an fp32 softmax is saved and becomes its gradient in place"


def estimate_memory(inputs: EstimateInputs) -> Estimate:
    """The estimate of a plan: every pipeline stage's fullest rank, per-node host memory, the fit."""
    layout = Layout(inputs.degrees, inputs.order, inputs.gpus_per_node)
    devices = _devices(inputs, layout)
    decided, decisions = _strategy(inputs, layout, devices)
    if decided is not inputs:
        inputs, devices = decided, _devices(decided, layout)
    peak = _peak(devices)
    host_node, host_moment, host_breakdown = _host(devices, layout, inputs.on_gpu)
    fits = None
    warnings: list[str] = []
    if inputs.gpu_memory is not None:
        fits = peak <= inputs.gpu_memory
        if not fits:
            warnings.append(f"the peak device needs {format_bytes(peak)}, more than its {format_bytes(inputs.gpu_memory)} "
                            f"(over by {format_bytes(peak - inputs.gpu_memory)})")
        limit = cpu_limit(inputs)
        if host_node > limit:
            fits = False
            warnings.append(f"a node needs {format_bytes(host_node)} of host memory at {host_moment}, over its "
                            f"limit {format_bytes(limit)} by {format_bytes(host_node - limit)}")
    gathered = torch_sequence_parallel_extra(inputs)
    if gathered:
        warnings.append(f"sequence parallel is counted as Megatron-LM keeps it (Korthikanti et al.); torch's "
                        f"DTensor plan, which `shardplan run` uses, also keeps the gathered QKV and MLP inputs: "
                        f"{format_bytes(gathered)} more per layer and microbatch held (docs/estimate.md)")
    if inputs.shape is None:
        built = ", and the model `run` builds at start-up" if inputs.framework == "fsdp2" else ""
        warnings.append(f"no architecture: model states only (activations, the buffers that depend on the layers"
                        f"{built} are not estimated)")
        if inputs.offload_params:
            warnings.append("no architecture: offload.params puts every parameter on the CPU (there are no layers "
                            "to keep resident)")
    result = Estimate(param_counts(inputs), devices, peak, host_node, fits, assumptions(inputs), warnings, decisions)
    result.cpu_pinned = inputs.pin_memory and inputs.on_gpu and any(d.cpu["total"] for d in devices)
    result.host_moment, result.host_breakdown = host_moment, host_breakdown
    result.inputs = inputs
    result.assumptions["offload"] = {
        "params": inputs.offload_params, "grads": inputs.offload_grads, "optimizer": inputs.offload_optimizer,
        "resident_layers": [d.resident_layers for d in devices],
        "cpu_compression": inputs.compression if inputs.framework == "fsdp2" else "none",
    }
    return result
