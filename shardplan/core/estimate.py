"""Per-device GPU memory and per-node CPU memory of a training step.

For every pipeline stage the estimate takes the stage's fullest rank (tensor-parallel rank 0,
shard index 0: `torch.chunk`-style splits give the first ranks the most), and adds

    model states (states.py) + saved activations * microbatches in flight (activations.py,
    schedule.py) + transient buffers of the busier phase (buffers.py) + allowances.

`rank_estimate` gives the same figures for any one rank; `shardplan run` compares them with
what each rank measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import lru_cache

from .activations import (
    ActivationShape,
    embedding_terms,
    head_terms,
    loss_backward_terms,
    recompute_working_terms,
    stored_layer_terms,
)
from .buffers import allowance_terms, deepspeed_buffers, fsdp2_buffers, step_buffers
from .estimate_inputs import EstimateInputs
from .params import ParamInfo, count_params
from .precision import MIXED, ElementBytes, element_bytes, uses_autocast
from .schedule import ALL_FORWARDS_FIRST, SPLIT_BACKWARD, chunks_per_rank, held_peak, rank_order
from .schedule_sim import BACKWARD, WEIGHT, Action
from .stages import LocalParam, RankParams, chunk_size, rank_params
from .states import Offload, Sharding, rank_states
from .terms import Term

KINDS = ("params", "grads", "optimizer")


@dataclass
class DeviceEstimate:
    """One device's figures, in bytes, with the terms they add up from."""

    stage: int
    ranks: list[int]
    gpu: dict[str, int]
    cpu: dict[str, int]
    terms: dict[str, list[Term]]
    phase: str  # the phase that sets the GPU peak
    resident_layers: int
    num_layers: int
    phase_totals: dict[str, int]  # GPU bytes at the peak of each phase
    saved_activations: int  # activations of the forward/backward phase, whichever phase peaks


@dataclass
class Estimate:
    params: dict[str, int]
    devices: list[DeviceEstimate]
    peak_gpu_bytes: int
    cpu_bytes_per_node: int
    fits: bool | None
    assumptions: dict[str, object] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    decisions: list[str] = field(default_factory=list)
    cpu_pinned: bool = False  # offloaded states in page-locked memory (pin_memory, on a GPU node)
    # The plan as the offload strategy decided it (what is offloaded, resident layers): what
    # `shardplan run` executes.
    inputs: EstimateInputs | None = None


@dataclass(frozen=True)
class Coordinates:
    """A rank's position as the estimate needs it."""

    pp_rank: int = 0
    tp_rank: int = 0
    shard_index: int = 0


def flat_rank_params(params: int, tp: int, pp: int, tp_rank: int = 0, pp_rank: int = 0) -> RankParams:
    """A bare parameter count as one flat tensor, split evenly over tp and pp."""
    per_stage = chunk_size(params, pp, pp_rank)
    local = chunk_size(per_stage, tp, tp_rank)
    info = ParamInfo("params", (per_stage,), "layer", None, 0)
    return RankParams(0, (), (), (LocalParam(info, (local,)),), pp_rank == pp - 1)


def shard_degree(inputs: EstimateInputs) -> int:
    """Ranks one ZeRO/FSDP group shards over (core.layout.shard_group_size)."""
    if inputs.hybrid:
        from .layout import Layout, shard_group_size

        return shard_group_size(Layout(inputs.degrees, inputs.order, inputs.gpus_per_node), hybrid=True)
    return inputs.degrees.dp * inputs.degrees.cp


def rank_coordinates(inputs: EstimateInputs, rank: int) -> Coordinates:
    """Where `rank` sits for the estimate: its pipeline stage, tensor-parallel rank, and its
    position in the group that shards its model states (dp x cp; hybrid: the node's part)."""
    from .layout import Layout, hybrid_shard_groups

    layout = Layout(inputs.degrees, inputs.order, inputs.gpus_per_node)
    coords = layout.coords(rank)
    if inputs.hybrid:
        group = next(g for g in hybrid_shard_groups(layout, group="dp_cp")[0] if rank in g)
    else:
        group = layout.group_of("dp_cp", rank)
    return Coordinates(pp_rank=coords["pp"], tp_rank=coords["tp"], shard_index=sorted(group).index(rank))


def _rank_params(inputs: EstimateInputs, at: Coordinates) -> RankParams:
    d = inputs.degrees
    if inputs.shape is None:
        return flat_rank_params(inputs.params or 0, d.tp, d.pp, at.tp_rank, at.pp_rank)
    return rank_params(inputs.shape, d.pp, inputs.virtual, at.pp_rank, d.tp, at.tp_rank, inputs.stage_split)


def resident_layers(rp: RankParams, eb: ElementBytes, inputs: EstimateInputs, degree: int) -> int:
    """Layers whose parameters stay on the GPU: all without parameter offload; with it, as
    many whole layers (in order) as fit in `gpu_param_budget` at their sharded size. The
    embedding, final norm and head (the FSDP root) always stay on the GPU."""
    if not inputs.offload_params:
        return rp.num_layers
    if inputs.resident_layers is not None:
        return min(rp.num_layers, inputs.resident_layers)
    layer_bytes = sum(p.padded_shard_numel(degree) for p in rp.layer) * eb.params
    if layer_bytes == 0:
        return rp.num_layers
    return min(rp.num_layers, inputs.gpu_param_budget // layer_bytes)


def _activation_shape(inputs: EstimateInputs, eb: ElementBytes) -> ActivationShape:
    assert inputs.shape is not None
    d = inputs.degrees
    return ActivationShape(
        shape=inputs.shape, micro_batch=inputs.micro_batch, seq_len=inputs.seq_len, tp=d.tp, cp=d.cp,
        sequence_parallel=inputs.sequence_parallel and d.tp > 1, recompute=inputs.recompute,
        attention=inputs.attention, dropout=inputs.dropout, act_bytes=eb.compute,
        autocast=uses_autocast(inputs.framework, inputs.zero_stage, inputs.precision),
    )


def torch_sequence_parallel_extra(inputs: EstimateInputs) -> int:
    """Bytes per layer and microbatch held that torch's DTensor sequence parallel (what
    `shardplan run` and torchtitan execute) keeps beyond the paper's accounting, which the
    estimate follows (CONTRACT): the gathered, not sequence-sharded, inputs of the QKV and MLP
    linears. 0 without sequence parallel, and under `deepspeed`, whose accounting is the paper's."""
    if inputs.framework != "fsdp2" or inputs.shape is None or not inputs.sequence_parallel or inputs.degrees.tp == 1:
        return 0
    paper = _activation_shape(inputs, element_bytes(inputs.framework, inputs.precision, inputs.optimizer))
    torch_sp = replace(paper, keeps_gathered=True)
    return sum(t.bytes for t in stored_layer_terms(torch_sp)) - sum(t.bytes for t in stored_layer_terms(paper))


def walked_microbatches(pp: int, microbatches: int, virtual: int) -> int:
    """How many microbatches of a schedule's order must be walked to meet its peak.

    1F1B-like schedules (1f1b, zero-bubble, interleaved-1f1b) reach their peak during the
    warm-up, which spans fewer than pp * (virtual + 2) forwards; later steady-state steps only
    repeat it (tested over many pp, virtual and microbatches: tests/test_estimate.py). The
    count keeps interleaved-1f1b's multiple of pp.
    """
    cap = pp * (virtual + 2)
    return microbatches if microbatches <= cap else cap


@lru_cache(maxsize=512)
def _rank_order(schedule: str, pp: int, microbatches: int, virtual: int, pp_rank: int) -> tuple[Action, ...]:
    walked = walked_microbatches(pp, microbatches, virtual)
    return tuple(rank_order(schedule, pp, walked, virtual, pp_rank))


def held_at_peak(schedule: str, pp: int, microbatches: int, virtual: int, pp_rank: int,
                 stage_bytes: dict[int, int]) -> dict[int, int]:
    """Microbatches of each of this rank's stages held when its activations peak.

    One stage (pp = 1) runs gradient accumulation: one microbatch at a time through every
    chunk. gpipe and round-robin run every forward before any backward: all microbatches of
    every stage. The 1F1B-like schedules: walk the rank's order (core/schedule.py)."""
    if pp == 1:
        return dict.fromkeys(stage_bytes, 1)
    if schedule in ALL_FORWARDS_FIRST:
        return dict.fromkeys(stage_bytes, microbatches)
    order = _rank_order(schedule, pp, microbatches, chunks_per_rank(schedule, virtual), pp_rank)
    return held_peak(order, stage_bytes, WEIGHT if schedule in SPLIT_BACKWARD else BACKWARD)[1]


def activation_terms(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, pp_rank: int) -> list[Term]:
    """Saved activations at the peak of this rank's pipeline schedule.

    Each stage (model chunk) the rank holds costs its layers' activations plus, on the first
    stage, the embedding's and, on the last, the head's and loss's; the schedule's order
    decides how many microbatches of each stage are held at once (core/schedule.py)."""
    if inputs.shape is None:
        return []
    act = _activation_shape(inputs, eb)
    d = inputs.degrees
    per_layer = sum(t.bytes for t in stored_layer_terms(act))
    stages = [pp_rank + chunk * d.pp for chunk in range(len(rp.chunk_layers))] or [pp_rank]
    last_stage = d.pp * max(1, len(rp.chunk_layers)) - 1

    def edges(stage: int) -> list[Term]:
        return (embedding_terms(act) if stage == 0 else []) + (head_terms(act) if stage == last_stage else [])

    stage_bytes = {}
    for stage, layers in zip(stages, rp.chunk_layers or (0,)):
        stage_bytes[stage] = layers * per_layer + sum(t.bytes for t in edges(stage))
    held = held_at_peak(inputs.schedule, d.pp, inputs.num_microbatches, inputs.virtual, pp_rank, stage_bytes)
    terms = []
    for stage, layers in zip(stages, rp.chunk_layers or (0,)):
        count = held[stage]
        if not count:
            continue
        if layers:
            terms.append(Term(
                f"layers of stage {stage}", count * layers * per_layer,
                lambda count=count, layers=layers: f"{count} microbatches held * {layers} layers * {per_layer:,} B per layer",
            ))
        terms += [t.scaled(count, f"{count} microbatches held") for t in edges(stage)]
    return terms


def rank_estimate(inputs: EstimateInputs, at: Coordinates, ranks: list[int]) -> DeviceEstimate:
    """The figures of the rank at `at` (`ranks`: the ranks these figures stand for)."""
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    rp = _rank_params(inputs, at)
    degree = shard_degree(inputs)
    resident = resident_layers(rp, eb, inputs, degree)
    sharding = Sharding(inputs.framework, inputs.zero_stage, degree, at.shard_index, inputs.min_num_params)
    offload = Offload(inputs.offload_params, inputs.offload_grads, inputs.offload_optimizer, resident, inputs.compression)
    states = rank_states(rp, eb, sharding, offload)
    activations = activation_terms(inputs, rp, eb, at.pp_rank)
    mixed = inputs.precision in MIXED
    phases = fsdp2_buffers(rp, eb, inputs.zero_stage, degree, inputs.prefetch_layers, mixed) \
        if inputs.framework == "fsdp2" and inputs.shape is not None else None
    forward_backward = list(phases.forward_backward) if phases else []
    if inputs.framework != "fsdp2":
        forward_backward += deepspeed_buffers(rp, eb, inputs.zero_stage)
    if inputs.shape is not None:
        # Recomputation rebuilds one layer's activations at a time during backward: transient.
        forward_backward += recompute_working_terms(_activation_shape(inputs, eb))
    if rp.has_head and inputs.shape is not None:
        forward_backward += loss_backward_terms(_activation_shape(inputs, eb))
    gpu_optimizer_elements = sum(t.bytes for t in states.gpu["optimizer"]) // max(eb.optimizer, 1)
    step = step_buffers(gpu_optimizer_elements, eb, inputs.optimizer) if inputs.framework == "fsdp2" else []

    state_bytes = sum(states.gpu_bytes(k) for k in KINDS)
    activation_bytes = sum(t.bytes for t in activations)
    fwd_total = activation_bytes + sum(t.bytes for t in forward_backward)
    step_total = sum(t.bytes for t in step)
    phase, buffer_terms = ("forward/backward", forward_backward) if fwd_total >= step_total else ("optimizer step", step)
    saved = activation_bytes
    if phase == "optimizer step":
        activations, activation_bytes = [], 0  # freed before the step
    tensors = state_bytes + activation_bytes + sum(t.bytes for t in buffer_terms)
    buffer_terms = buffer_terms + allowance_terms(tensors, inputs.on_gpu)
    gpu = {k: states.gpu_bytes(k) for k in KINDS}
    gpu["activations"] = activation_bytes
    gpu["buffers"] = sum(t.bytes for t in buffer_terms)
    gpu["total"] = sum(gpu.values())
    cpu = {k: states.cpu_bytes(k) for k in KINDS}
    cpu["total"] = sum(cpu.values())
    terms = {f"gpu.{k}": states.gpu[k] for k in KINDS}
    terms.update({f"cpu.{k}": states.cpu[k] for k in KINDS})
    terms["gpu.activations"] = activations
    terms["gpu.buffers"] = buffer_terms
    phase_totals = {"forward/backward": state_bytes + fwd_total, "optimizer step": state_bytes + step_total}
    return DeviceEstimate(at.pp_rank, ranks, gpu, cpu, terms, phase, resident, rp.num_layers, phase_totals, saved)


def param_counts(inputs: EstimateInputs) -> dict[str, int]:
    if inputs.shape is None:
        total = inputs.params or 0
        return {"total": total, "embedding": 0, "active": total}
    counts = count_params(inputs.shape)
    return {"total": counts.total, "embedding": counts.embedding, "active": counts.active}
