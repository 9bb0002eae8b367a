"""Per-device GPU memory and per-rank host memory of a training step, as a timeline.

For every pipeline stage the estimate takes the stage's fullest rank (tensor-parallel rank 0,
and shard index 0, as `torch.chunk`-style splits give the first ranks the most, except under
ZeroRedundancyOptimizer, `fullest_shard_index`) and lists, for each
moment of the step (core/timeline.py), what is alive in it:

    model states held through the step (states.py; deepspeed.py) + the gradients alive then
    + saved activations * microbatches in flight (activations.py, schedule.py), until the
    step + the moment's transient buffers (buffers.py, deepspeed.py) + allowances.

The device's peak is its largest moment. `rank_estimate` gives the same figures for any one
rank; `shardplan run` compares them with what each rank measures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from math import gcd

from ..spec.model import ModelShape
from ..spec.units import counted
from .activations import (
    ActivationShape,
    embedding_terms,
    head_terms,
    kept_logits_terms,
    loss_backward_terms,
    recompute_working_terms,
    stored_layer_terms,
)
from .buffers import (
    UNSHARDED_BLOCKS,
    allowance_terms,
    deferred_grads,
    fsdp2_buffers,
    grads_in_flight,
    no_buffers,
    padded_unsharded,
    pipelined_fsdp2_buffers,
    step_buffers,
)
from .deepspeed import DeepSpeedPlan, deepspeed_memory, fullest_flat_index
from .degrees import Degrees
from .estimate_inputs import EstimateInputs, defers_to_step_end
from .finetune import (
    deepspeed_frozen_buffers,
    deepspeed_persistent_frozen,
    frozen_bytes,
    frozen_terms,
    gathered_block_bytes,
    lora_ddp_buffers,
    lora_fsdp2_buffers,
    lora_pipelined_buffers,
    pinned_frozen_terms,
    trainable_params,
)
from .lora import LoraPlan, lora_counts
from .host import checkpoint_staging, rank_host, startup_host
from .offload import frees_device_grads
from .params import ParamInfo, count_params
from .precision import MIXED, ElementBytes, element_bytes, uses_autocast
from .schedule import ALL_FORWARDS_FIRST, SPLIT_BACKWARD, chunks_per_rank, held_peak, interleaved_rounds, rank_order
from .schedule_sim import BACKWARD as BACKWARD_ACTION, WEIGHT, Action
from .stages import LocalParam, RankParams, chunk_size, rank_params
from .states import LAYERS, HostGroup, Offload, Sharding, States, fullest_zero1_index, rank_states
from .terms import Term
from .timeline import BACKWARD, BACKWARD_END, FORWARD, LOSS, MOMENTS, STEP, Moment, peak

KINDS = ("params", "grads", "optimizer")
# Labels this module writes and `last_layer_backward` finds again: the saved activations of a
# stage's layers, and the prefix of the adapters' states under LoRA (`_with_frozen`).
LAYERS_OF_STAGE = "layers of stage"
ADAPTERS = "adapters, "


@dataclass
class DeviceEstimate:
    """One device's figures, in bytes, with the terms they add up from."""

    stage: int
    ranks: list[int]
    gpu: dict[str, int]  # by kind, at the peak moment (CONTRACT `devices[].gpu`)
    cpu: dict[str, int]  # model states in host memory, by kind (exact bytes)
    states: dict[str, int]  # model states on the GPU held through the step, by kind
    terms: dict[str, list[Term]]  # the peak moment's terms ("gpu.<kind>") and host states ("cpu.<kind>")
    peak_moment: str
    moments: list[Moment]
    resident_layers: int
    num_layers: int
    saved_activations: int  # bytes saved for backward at the forward/backward peak
    host: list[Term] = field(default_factory=list)  # this rank's host memory while training
    startup: list[Term] = field(default_factory=list)  # this rank's host memory at start-up

    @property
    def moment_totals(self) -> dict[str, int]:
        return {m.name: m.total for m in self.moments}


@dataclass(frozen=True)
class Coordinates:
    """A rank's position as the estimate needs it."""

    pp_rank: int = 0
    tp_rank: int = 0
    shard_index: int | None = None  # None: the stage's fullest (`fullest_shard_index`)


def flat_rank_params(params: int, tp: int, pp: int, tp_rank: int = 0, pp_rank: int = 0) -> RankParams:
    """A bare parameter count as one flat tensor, split evenly over tp and pp."""
    per_stage = chunk_size(params, pp, pp_rank)
    local = chunk_size(per_stage, tp, tp_rank)
    info = ParamInfo("params", (per_stage,), "layer", None, 0)
    return RankParams(0, (), (), (LocalParam(info, (local,)),), pp_rank == pp - 1)


def shard_degree(inputs: EstimateInputs) -> int:
    """Ranks one ZeRO/FSDP group shards over (core.layout.shard_group_size)."""
    if inputs.hybrid:
        return _hybrid_degree(inputs.degrees, inputs.order, inputs.gpus_per_node)
    return inputs.degrees.dp * inputs.degrees.cp


@lru_cache(maxsize=1024)
def _hybrid_degree(degrees: Degrees, order: str, gpus_per_node: int) -> int:
    from .layout import Layout, shard_group_size

    return shard_group_size(Layout(degrees, order, gpus_per_node), hybrid=True)


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
    return rank_params(inputs.shape, d.pp, inputs.virtual, at.pp_rank, d.tp, at.tp_rank, inputs.stage_split,
                       inputs.lora)


def fullest_shard_index(inputs: EstimateInputs, rp: RankParams, degree: int) -> int:
    """The position in its shard group of the rank holding the most model states: 0 where
    tensors are cut `torch.chunk`-style or flat (the first pieces are the largest); under
    fsdp2's stage 1 the rank ZeroRedundancyOptimizer gives the most optimizer-state bytes (of
    the adapters, with LoRA); under DeepSpeed's stages 1 and 2 the rank whose
    grads_in_partition is largest (`fullest_flat_index`)."""
    lora = inputs.lora is not None and inputs.shape is not None
    if inputs.framework == "deepspeed" and inputs.zero_stage in (1, 2) and degree > 1:
        # DeepSpeed flattens the trainable parameters (with LoRA, the adapters).
        return fullest_flat_index(trainable_params(rp) if lora else rp, degree)
    if inputs.framework != "fsdp2" or inputs.zero_stage != 1 or degree <= 1:
        return 0
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    return fullest_zero1_index(trainable_params(rp) if lora else rp, degree, eb)


def resident_layers(rp: RankParams, eb: ElementBytes, inputs: EstimateInputs, degree: int) -> int:
    """Layers whose parameters stay on the GPU: all without parameter offload; with it, as
    many whole layers (in order) as fit in `gpu_param_budget` at their sharded size, none under
    `deepspeed`. The embedding, final norm and head (the FSDP root) always stay on the GPU."""
    if not inputs.offload_params:
        return rp.num_layers
    if inputs.framework == "deepspeed":
        # ZeRO-Infinity's offload_param puts every parameter partition on the host; it keeps
        # no layer on the GPU (DeepSpeedZeroOffloadParamConfig has no such budget).
        return 0
    if inputs.resident_layers is not None:
        return min(rp.num_layers, inputs.resident_layers)
    layer_bytes = sum(p.padded_shard_numel(degree) for p in rp.layer) * eb.params
    if inputs.lora is not None:
        layer_bytes = (sum(frozen_bytes(p, inputs.lora, degree, "fsdp2") for p in rp.layer)
                       + sum(p.padded_shard_numel(degree) for p in rp.adapters) * eb.params)
    if layer_bytes == 0:
        return rp.num_layers
    return min(rp.num_layers, inputs.gpu_param_budget // layer_bytes)


def _activation_shape(inputs: EstimateInputs, eb: ElementBytes) -> ActivationShape:
    """The activation shape of `inputs`: one instance per distinct shape (`_interned_shape`),
    so the caches keyed on it (per-layer bytes, edges, transients) find it by identity."""
    assert inputs.shape is not None
    d = inputs.degrees
    return _interned_shape(inputs.shape, inputs.micro_batch, inputs.seq_len, d.tp, d.cp,
                           inputs.sequence_parallel and d.tp > 1, inputs.recompute, inputs.attention,
                           inputs.dropout, eb.compute,
                           uses_autocast(inputs.framework, inputs.zero_stage, inputs.precision), inputs.loss,
                           inputs.lora, inputs.sp_keeps_gathered)


@lru_cache(maxsize=4096)
def _interned_shape(shape: ModelShape, micro_batch: int, seq_len: int, tp: int, cp: int, sequence_parallel: bool,
                    recompute: str, attention: str, dropout: bool, act_bytes: int, autocast: bool, loss: str,
                    lora: LoraPlan | None, keeps_gathered: bool = False) -> ActivationShape:
    return ActivationShape(shape=shape, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp,
                           sequence_parallel=sequence_parallel, recompute=recompute, attention=attention,
                           dropout=dropout, act_bytes=act_bytes, autocast=autocast, loss=loss, lora=lora,
                           keeps_gathered=keeps_gathered)


def torch_sequence_parallel_extra(inputs: EstimateInputs) -> int:
    """Bytes per layer and microbatch held that torch's DTensor sequence parallel (what
    `shardplan run` and torchtitan execute) keeps beyond the paper's accounting, which the
    estimate follows (CONTRACT): the gathered, not sequence-sharded, inputs of the QKV and MLP
    linears. 0 without sequence parallel, and under `deepspeed`, whose accounting is the paper's."""
    if inputs.framework != "fsdp2" or inputs.shape is None or not inputs.sequence_parallel or inputs.degrees.tp == 1:
        return 0
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    paper = _activation_shape(inputs.with_(sp_keeps_gathered=False), eb)
    torch_sp = _activation_shape(inputs.with_(sp_keeps_gathered=True), eb)
    return sum(t.bytes for t in stored_layer_terms(torch_sp)) - sum(t.bytes for t in stored_layer_terms(paper))


def walked_microbatches(schedule: str, pp: int, microbatches: int, virtual: int) -> int:
    """How many microbatches of a schedule's order must be walked to meet its peak.

    1F1B-like schedules (1f1b, zero-bubble, interleaved-1f1b) reach their peak during the
    warm-up, which spans fewer than pp * (virtual + 2) forwards; later steady-state steps only
    repeat it (tested over many pp, virtual and microbatches: tests/test_estimate.py).
    interleaved-1f1b walks virtual + 2 of its rounds (`interleaved_rounds`): with k > virtual + 2
    rounds of q microbatches, (virtual + 2) * q microbatches make exactly virtual + 2 rounds of
    the same q (q = pp + r / k with r < pp), so the walked order starts as the full one does.
    """
    per_round = interleaved_rounds(pp, microbatches)[1] if schedule == "interleaved-1f1b" else pp
    cap = per_round * (virtual + 2)
    return microbatches if microbatches <= cap else cap


@lru_cache(maxsize=512)
def _rank_order(schedule: str, pp: int, microbatches: int, virtual: int, pp_rank: int) -> tuple[Action, ...]:
    walked = walked_microbatches(schedule, pp, microbatches, virtual)
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
    if schedule == "1f1b" and len(stage_bytes) == 1 and microbatches >= pp:
        # 1F1B's rank r runs pp - r - 1 warm-up forwards, then one more before its first
        # backward: it holds min(pp - r, m) microbatches at its peak (Narayanan et al. 2021,
        # section 2.2: "at most p"), whatever its stage's bytes. The walk's answer
        # (tests/test_estimate.py holds the two equal); fewer microbatches than stages are
        # the walk's to refuse (core/schedule.py `check_schedule`).
        return dict.fromkeys(stage_bytes, min(pp - pp_rank, microbatches))
    # With one chunk per rank the count at the peak does not depend on its bytes; with more,
    # only on their ratios (the walk compares sums of them), so they are divided by their
    # greatest common divisor: micro batches whose bytes scale alike share the walk.
    if len(stage_bytes) > 1:
        common = gcd(*stage_bytes.values()) or 1
        weights = tuple(sorted((stage, amount // common) for stage, amount in stage_bytes.items()))
    else:
        weights = tuple((k, 1) for k in stage_bytes)
    return dict(_held(schedule, pp, microbatches, virtual, pp_rank, weights))


@lru_cache(maxsize=4096)
def _held(schedule: str, pp: int, microbatches: int, virtual: int, pp_rank: int,
          weights: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    order = _rank_order(schedule, pp, microbatches, chunks_per_rank(schedule, virtual), pp_rank)
    held = held_peak(order, dict(weights), WEIGHT if schedule in SPLIT_BACKWARD else BACKWARD_ACTION)[1]
    return tuple(sorted(held.items()))


@lru_cache(maxsize=4096)
def _layer_bytes(act: ActivationShape) -> int:
    return sum(t.bytes for t in stored_layer_terms(act))


@lru_cache(maxsize=4096)
def _first_layer_bytes(act: ActivationShape) -> int:
    return sum(t.bytes for t in stored_layer_terms(act, grad_in=False))


@lru_cache(maxsize=4096)
def _embedding_terms(act: ActivationShape) -> tuple[Term, ...]:
    return tuple(embedding_terms(act))


@lru_cache(maxsize=4096)
def _head_terms(act: ActivationShape) -> tuple[Term, ...]:
    return tuple(head_terms(act))


def activation_terms(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes,
                     pp_rank: int) -> tuple[list[Term], int]:
    """Saved activations at the peak of this rank's pipeline schedule, and how many
    microbatches of the last stage (the head's) are held then (0 when the rank has no head).

    Each stage (model chunk) the rank holds costs its layers' activations plus, on the first
    stage, the embedding's and, on the last, the head's and loss's; the schedule's order
    decides how many microbatches of each stage are held at once (core/schedule.py)."""
    if inputs.shape is None:
        return [], 0
    act = _activation_shape(inputs, eb)
    d = inputs.degrees
    per_layer = _layer_bytes(act)
    stages = [pp_rank + chunk * d.pp for chunk in range(len(rp.chunk_layers))] or [pp_rank]
    last_stage = d.pp * max(1, len(rp.chunk_layers)) - 1
    # Under LoRA the first layer's input comes from the frozen embedding without a gradient:
    # it keeps less than the others (core/lora_activations.py).
    first_layer = _first_layer_bytes(act) if act.lora else per_layer

    def edges(stage: int) -> list[Term]:
        terms = list(_embedding_terms(act)) if stage == 0 else []
        if stage == 0 and first_layer != per_layer and rp.chunk_layers and rp.chunk_layers[0]:
            terms.append(Term("first layer, no gradient into it (LoRA)", first_layer - per_layer,
                              lambda: f"{first_layer:,} B instead of {per_layer:,} B"))
        return terms + (list(_head_terms(act)) if stage == last_stage else [])

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
                f"{LAYERS_OF_STAGE} {stage}", count * layers * per_layer,
                lambda count=count, layers=layers: f"{counted(count, 'microbatch')} held * {counted(layers, 'layer')} * {per_layer:,} B per layer",
            ))
        terms += [t.scaled(count, f"{counted(count, 'microbatch')} held") for t in edges(stage)]
    return terms, held.get(last_stage, 0)


@dataclass
class _RankMemory:
    """What a framework holds on one rank: persistent GPU states, host states, the
    gradients and buffers of each moment, and host memory as allocated."""

    gpu: dict[str, list[Term]]
    cpu: dict[str, list[Term]]
    grads_at: dict[str, list[Term]]
    buffers_at: dict[str, list[Term]]
    host_groups: list[HostGroup] = field(default_factory=list)  # what the offload engine steps (fsdp2)


@lru_cache(maxsize=1024)
def _deepspeed_cached(rp: RankParams, plan: DeepSpeedPlan):
    return deepspeed_memory(rp, plan)


def _deepspeed(inputs: EstimateInputs, rp: RankParams, degree: int, index: int) -> tuple[_RankMemory, list[Term]]:
    plan = DeepSpeedPlan(
        stage=inputs.zero_stage, degree=degree, index=index, precision=inputs.precision,
        optimizer=inputs.optimizer, offload_optimizer=inputs.offload_optimizer, offload_params=inputs.offload_params,
        pin=inputs.pin_memory and inputs.on_gpu, reduce_bucket_size=inputs.reduce_bucket_size,
        prefetch_bucket_size=inputs.prefetch_bucket_size, max_live_parameters=inputs.max_live_parameters,
        persistence_threshold=inputs.param_persistence_threshold, sub_group_size=inputs.sub_group_size,
        overlap_comm=inputs.overlap_comm, grad_accum_dtype=inputs.grad_accum_dtype,
        accumulating=inputs.num_microbatches > 1, pipeline=inputs.degrees.pp > 1,
    )
    ds = _deepspeed_cached(rp, plan)
    return _RankMemory(ds.gpu, ds.cpu, ds.grads_at, ds.buffers_at), ds.host


def _with_frozen(memory: _RankMemory, gpu: list[Term], cpu: list[Term],
                 buffers: dict[str, list[Term]]) -> _RankMemory:
    """A new record (the framework's may be cached) with the frozen base's terms added and the
    framework's own terms, which are the adapters', named so."""
    def adapters(terms) -> list[Term]:
        return [Term(f"{ADAPTERS}{t.label}", t.bytes, t.source) for t in terms]

    return _RankMemory(
        gpu={k: (gpu if k == "params" else []) + adapters(v) for k, v in memory.gpu.items()},
        cpu={k: (cpu if k == "params" else []) + adapters(v) for k, v in memory.cpu.items()},
        grads_at={m: adapters(v) for m, v in memory.grads_at.items()},
        buffers_at={m: list(buffers.get(m, [])) + list(v) for m, v in memory.buffers_at.items()},
    )


def _lora(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int, index: int,
          resident: int) -> tuple[_RankMemory, list[Term]]:
    """LoRA: the framework's rules over the adapters, the frozen base beside them
    (core/finetune.py), and the buffers of the base as it is gathered and dequantized."""
    assert inputs.lora is not None
    trainable = trainable_params(rp)
    if inputs.framework == "deepspeed":
        memory, host = _deepspeed(inputs, trainable, degree, index)
        held = "partition" if inputs.zero_stage == 3 else "whole"
        on_host = inputs.offload_params  # stage 3: zero.Init allocates every partition on the host
        persistent, base = [], rp
        if inputs.zero_stage == 3:
            persistent, base = deepspeed_persistent_frozen(rp, inputs.lora, inputs.param_persistence_threshold,
                                                           degree, on_host)
        gpu, cpu = frozen_terms(base, inputs.lora, degree, 0 if on_host else rp.num_layers, held,
                                root_on_host=on_host)
        gpu += persistent
        memory = _with_frozen(memory, gpu, cpu, deepspeed_frozen_buffers(rp, inputs.lora, inputs.zero_stage))
        return memory, host + cpu
    memory = _torch_or_paper(inputs, trainable, eb, degree, index, resident, buffers=False)
    if inputs.framework == "fsdp2":  # fully_shard at stages 0, 2, 3 (stage 0: one-rank shards); DDP at 1
        held, over = ("whole", 1) if inputs.zero_stage == 1 else ("fsdp2", degree if inputs.zero_stage >= 2 else 1)
    else:
        held, over = ("partition", degree) if inputs.zero_stage == 3 else ("whole", 1)
    gpu, cpu = frozen_terms(rp, inputs.lora, over, resident, held)
    buffers = no_buffers()
    if inputs.framework == "fsdp2" and inputs.shape is not None:
        if inputs.zero_stage == 1:
            buffers = lora_ddp_buffers(rp, eb) if inputs.precision in MIXED else no_buffers()
        elif defers_to_step_end(inputs):
            buffers = lora_pipelined_buffers(rp, eb, inputs.lora, inputs.zero_stage, degree, inputs.prefetch_layers,
                                             kept_in_loss(inputs, rp))
        else:
            buffers = lora_fsdp2_buffers(rp, eb, inputs.lora, inputs.zero_stage, degree, inputs.prefetch_layers)
    memory = _with_frozen(memory, gpu, cpu, buffers)
    host = rank_host(inputs, trainable, eb, degree, resident, memory.cpu) if inputs.framework == "fsdp2" else []
    if inputs.framework == "fsdp2":
        pinned = inputs.pin_memory and inputs.on_gpu and inputs.offload_params
        host += pinned_frozen_terms(rp, inputs.lora, over, rp.num_layers - resident, held) if pinned else cpu
    return memory, host


def torch_or_paper_states(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int, index: int,
                          resident: int) -> States:
    """The model states of `_torch_or_paper` (fsdp2, zero-paper), without its buffers."""
    sharding = Sharding(inputs.framework, inputs.zero_stage, degree, index, inputs.min_num_params)
    # Compressed host states exist only in the engine `run` executes (fsdp2).
    compression = inputs.compression if inputs.framework == "fsdp2" else "none"
    offload = Offload(inputs.offload_params, inputs.offload_grads, inputs.offload_optimizer, resident, compression,
                      inputs.optimizer)
    return rank_states(rp, eb, sharding, offload)


def _torch_or_paper(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int, index: int,
                    resident: int, buffers: bool = True) -> _RankMemory:
    """fsdp2 (what `run` executes) and zero-paper (the paper's model states, no framework
    buffers). fsdp2 frees gradients between steps (`zero_grad(set_to_none=True)`): they are
    alive in forward and backward only when microbatches accumulate into them; DDP's (stage 1)
    gradients are views of buckets allocated once. The paper counts every state throughout."""
    states = torch_or_paper_states(inputs, rp, eb, degree, index, resident)
    grads = states.gpu["grads"]
    if inputs.framework == "zero-paper":
        return _RankMemory(states.gpu, states.cpu, {m: grads for m in MOMENTS}, no_buffers())
    always = inputs.zero_stage == 1 or inputs.num_microbatches > 1
    grads_at = {m: grads if always or m in (BACKWARD_END, STEP) else [] for m in MOMENTS}
    buffers_at = no_buffers()
    deferred = defers_to_step_end(inputs)
    if deferred:  # the sharded gradients exist from the reduction at the step's end only
        unsharded = deferred_grads(rp, eb, inputs.zero_stage, degree)
        grads_at = {m: grads if m == STEP else unsharded for m in MOMENTS}
    if inputs.shape is not None and buffers:
        if deferred:
            buffers_at = pipelined_fsdp2_buffers(rp, eb, inputs.zero_stage, degree, inputs.prefetch_layers,
                                                 kept_in_loss(inputs, rp))
        else:
            buffers_at = fsdp2_buffers(rp, eb, inputs.zero_stage, degree, inputs.prefetch_layers,
                                       inputs.precision in MIXED)
        if frees_device_grads(inputs.offload_grads, inputs.offload_optimizer, inputs.zero_stage):
            for moment, terms in grads_in_flight(rp, eb, inputs.zero_stage, degree, resident).items():
                # Deferred, every group is reduced (and copied out) when the step ends.
                buffers_at[BACKWARD_END if deferred else moment] += terms
    buffers_at[STEP] += step_buffers(states.gpu_optimizer_elements, eb, inputs.optimizer)
    return _RankMemory(states.gpu, states.cpu, grads_at, buffers_at, states.host_groups)


def kept_in_loss(inputs: EstimateInputs, rp: RankParams) -> bool:
    """Whether the loss can follow a backward with no forward between them in torch's pipeline
    stages, so that it finds every block of the rank gathered: every forward first (gpipe,
    round-robin) or several chunks per rank."""
    return inputs.schedule in ALL_FORWARDS_FIRST or len(rp.chunk_layers) > 1


def gathered_block(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int) -> int:
    """Bytes of one of the rank's blocks as FSDP2 gathers it (stage 0: one-rank shards)."""
    degree = 1 if inputs.zero_stage == 0 else degree
    if inputs.lora is not None:
        return gathered_block_bytes(rp, inputs.lora, degree, eb.compute)
    return padded_unsharded(rp.layer, degree) * eb.compute


def _backward_activations(activations: list[Term], act: ActivationShape | None, has_head: bool,
                          head_held: int) -> list[Term]:
    """Saved activations while a layer runs backward: the loss and head of the microbatch
    in backward were consumed and freed before it (the other held microbatches' remain)."""
    if act is None or not has_head or head_held == 0:
        return activations
    head = {t.label for t in head_terms(act)}
    kept = [t for t in activations if t.label not in head]
    if head_held > 1:
        kept += [t.scaled(head_held - 1, f"{head_held - 1} other microbatches held") for t in head_terms(act)]
    return kept


# The GPU gradients of the layers whose parameters stay on the GPU (core/states.py's `LAYERS`
# group; under LoRA the adapters', named so by `_with_frozen`).
LAYER_GRADS = (f"{LAYERS} grads", f"{ADAPTERS}{LAYERS} grads")


def layer_grads_bytes(grads: tuple[Term, ...] | list[Term]) -> int:
    return sum(t.bytes for t in grads if t.label in LAYER_GRADS)


def kept_blocks_bytes(inputs: EstimateInputs, buffers_in_backward) -> int:
    """The blocks FSDP2 keeps gathered from forward into backward at ZeRO-2
    (reshard_after_forward=False), which backward reshards one by one (reshard_after_backward,
    torch's default): their bytes, 0 at the other stages (one block and its prefetch). In
    torch's pipeline stages (`defers_to_step_end`) the blocks gathered when a backward sweep
    starts, whatever the stage."""
    if inputs.framework != "fsdp2" or (inputs.zero_stage != 2 and not defers_to_step_end(inputs)):
        return 0
    return sum(t.bytes for t in buffers_in_backward if t.label == UNSHARDED_BLOCKS)


def last_layer_backward(inputs: EstimateInputs, rp: RankParams, resident: int, layer_grads: int, per_layer: int,
                        grads_in_backward: int, kept_blocks: int = 0) -> tuple[int, int, int | None] | None:
    """(saved activation bytes freed, gathered block bytes freed, gradient bytes produced) when
    backward reaches the last layer of its sweep (the rank's first), if that moment holds more
    than backward through its first: else None. Backward frees each layer's saved activations
    as it goes (and, at ZeRO-2, each block's gathered parameters: `kept_blocks`) and leaves
    each layer's gradients behind (FSDP2 reduce-scatters them into `.grad`), so what is alive
    in it is linear in the layers done, largest at one end of the sweep: at its start every
    layer's activations, at its end every other layer's gradients. Gradients that are alive
    all through backward (microbatches accumulating, DDP's buckets) leave only the start.
    Found where activations are small beside the gradients: QLoRA of LLaMA 65B at 512 tokens
    on an H100 peaked there, 2.3% above backward through the first layer (docs/validation.md).

    In torch's pipeline stages (`defers_to_step_end`) the gradients are alive all through
    the sweep, but its blocks stay gathered after their backward (resharded by the next
    forward, at ZeRO-3 and stage 0): at the sweep's end every block of a one-chunk rank is
    gathered and one layer's activations of the microbatch remain. Then the gathered bytes
    grow (`kept_blocks` is what the sweep starts with), given as negative freed bytes, and
    the gradients stay as they are (None)."""
    if defers_to_step_end(inputs):
        if inputs.zero_stage == 2 or len(rp.chunk_layers) != 1 or rp.num_layers < 2:
            return None
        eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
        added = rp.num_layers * gathered_block(inputs, rp, eb, shard_degree(inputs)) - kept_blocks
        freed = (rp.num_layers - 1) * per_layer
        return (freed, -added, None) if added > freed else None
    if (inputs.framework != "fsdp2" or inputs.num_microbatches > 1 or grads_in_backward or layer_grads == 0
            or len(rp.chunk_layers) != 1 or resident < 2):
        return None
    produced = layer_grads - layer_grads // resident
    freed = (rp.num_layers - 1) * per_layer
    blocks_freed = kept_blocks - kept_blocks // rp.num_layers
    return (freed, blocks_freed, produced) if produced > freed + blocks_freed else None


def _at_last_layer(in_backward: list[Term], grads: tuple[Term, ...], buffers: tuple[Term, ...],
                   sweep: tuple[int, int, int | None], per_layer: int, resident: int,
                   layers: int) -> tuple[list[Term], tuple[Term, ...], tuple[Term, ...]]:
    """The backward moment's activations, gradients and buffers at the sweep's last layer."""
    freed, blocks_freed, produced = sweep
    kept = [Term(f"{t.label}: the layer in backward (the sweep's last; the others freed)", t.bytes - freed,
                 lambda t=t: f"{t.bytes:,} B less {freed:,} B freed: {per_layer:,} B of one layer"
                 + (" beside the other microbatches held" if t.bytes - freed > per_layer else ""))
            if t.label.startswith(LAYERS_OF_STAGE) else t for t in in_backward]
    if produced is not None:
        grads = (Term("layers grads produced before the sweep's last layer", produced,
                      lambda: f"{resident - 1} of {resident} layers' gradients"),)
    if blocks_freed < 0:  # pipelined: every block stays gathered after its backward
        buffers = tuple(Term(f"{t.label}: every block, gathered since its backward in this sweep",
                             t.bytes - blocks_freed, lambda: f"{layers} blocks")
                        if t.label == UNSHARDED_BLOCKS else t for t in buffers)
    elif blocks_freed:
        buffers = tuple(Term(f"{t.label}: the block in backward (the others resharded)", t.bytes - blocks_freed,
                             lambda t=t: f"{t.bytes // layers:,} B of one of {layers} blocks")
                        if t.label == UNSHARDED_BLOCKS else t for t in buffers)
    return kept, grads, buffers


@dataclass(frozen=True)
class RankParts:
    """One rank's terms, grouped so that every moment is a sum of parts: what the explained
    estimate prints and the planner's numeric path (`moment_totals`) add up alike."""

    gpu: dict[str, tuple[Term, ...]]  # params, grads, optimizer held through the step
    cpu: dict[str, tuple[Term, ...]]  # the same kinds in host memory
    grads_at: dict[str, tuple[Term, ...]]  # GPU gradients alive at each moment
    buffers_at: dict[str, tuple[Term, ...]]  # transient buffers of each moment (no allowances)
    activations: tuple[Term, ...]  # saved at the schedule's peak
    in_backward: tuple[Term, ...]  # saved, while a layer runs backward
    moments: tuple[str, ...]  # the moments this rank has
    host: tuple[Term, ...]  # host memory while training
    startup: tuple[Term, ...]  # host memory at start-up
    resident_layers: int
    num_layers: int
    on_gpu: bool


# The moments a rank's estimate has, by (it computes the loss, its gradients accumulate over
# microbatches): the loss moment only on the loss's rank; "backward end" only without
# accumulation (otherwise the backward moments already hold the gradients).
PRESENT = {(loss, accumulates): tuple(m for m in MOMENTS if (m != LOSS or loss) and not (m == BACKWARD_END and accumulates))
           for loss in (False, True) for accumulates in (False, True)}


def accumulates_in_backward(inputs: EstimateInputs) -> bool:
    """Whether the gradients are alive through backward, so that no "backward end" moment is
    shown: microbatches accumulate into them, unless torch's pipeline stages hold them
    unsharded until a reduction at the step's end, which is a moment of its own."""
    return inputs.num_microbatches > 1 and not defers_to_step_end(inputs)


def _present(inputs: EstimateInputs, has_loss: bool) -> tuple[str, ...]:
    return PRESENT[has_loss, accumulates_in_backward(inputs)]


def _transients(inputs: EstimateInputs, act: ActivationShape | None, has_head: bool,
                head_held: int) -> dict[str, list[Term]]:
    """Recomputation's working set, the loss's gradients and the logits a loop keeps."""
    extra: dict[str, list[Term]] = {m: [] for m in MOMENTS}
    if act is None:
        return extra
    extra[BACKWARD] += _recompute_terms(act)
    if has_head:
        extra[LOSS] += _loss_terms(act)
        # Who keeps the logits until backward: transformers' model output (the DeepSpeed
        # loops), and torch's pipeline stages, which cache each stage's output for its
        # backward; `shardplan run` and torchtitan free them before backward.
        # Only the held microbatches' logits: none when the peak holds none of the last stage's
        # (an interleaved rank's other chunk), as the planner's figures count them.
        if (inputs.framework == "deepspeed" or inputs.degrees.pp > 1) and head_held:
            kept = [t.scaled(head_held, f"{head_held} microbatches held") if head_held > 1 else t
                    for t in kept_logits_terms(act)]
            for moment in (FORWARD, LOSS, BACKWARD):
                extra[moment] += kept
    return extra


@lru_cache(maxsize=4096)
def _recompute_terms(act: ActivationShape) -> tuple[Term, ...]:
    return tuple(recompute_working_terms(act))


@lru_cache(maxsize=4096)
def _loss_terms(act: ActivationShape) -> tuple[Term, ...]:
    return tuple(loss_backward_terms(act))


@lru_cache(maxsize=512)
def rank_parts(inputs: EstimateInputs, at: Coordinates) -> RankParts:
    """Everything one rank's moments are made of (cached: the planner asks again and again)."""
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    rp = _rank_params(inputs, at)
    degree = shard_degree(inputs)
    resident = resident_layers(rp, eb, inputs, degree)
    index = at.shard_index if at.shard_index is not None else fullest_shard_index(inputs, rp, degree)
    if inputs.lora is not None and inputs.shape is not None:
        memory, host = _lora(inputs, rp, eb, degree, index, resident)
    elif inputs.framework == "deepspeed":
        memory, host = _deepspeed(inputs, rp, degree, index)
    else:
        memory = _torch_or_paper(inputs, rp, eb, degree, index, resident)
        host = rank_host(inputs, rp, eb, degree, resident, memory.cpu, memory.host_groups)
    activations, head_held = activation_terms(inputs, rp, eb, at.pp_rank)
    act = _activation_shape(inputs, eb) if inputs.shape is not None else None
    in_backward = _backward_activations(activations, act, rp.has_head, head_held)
    extra = _transients(inputs, act, rp.has_head, head_held)
    buffers_at = {m: tuple(memory.buffers_at[m]) + tuple(extra[m]) for m in MOMENTS}
    grads_at = {m: tuple(memory.grads_at[m]) for m in MOMENTS}
    if act is not None:
        per_layer = _layer_bytes(act)
        sweep = last_layer_backward(inputs, rp, resident, layer_grads_bytes(grads_at[BACKWARD_END]), per_layer,
                                    _bytes(grads_at[BACKWARD]), kept_blocks_bytes(inputs, buffers_at[BACKWARD]))
        if sweep is not None:
            in_backward, grads_at[BACKWARD], buffers_at[BACKWARD] = _at_last_layer(
                in_backward, grads_at[BACKWARD], buffers_at[BACKWARD], sweep, per_layer, resident, rp.num_layers)
    return RankParts(
        gpu={k: tuple(memory.gpu[k]) for k in KINDS}, cpu={k: tuple(memory.cpu[k]) for k in KINDS},
        grads_at=grads_at, buffers_at=buffers_at,
        activations=tuple(activations), in_backward=tuple(in_backward),
        moments=_present(inputs, rp.has_head and act is not None),
        host=tuple(host) + tuple(checkpoint_staging(inputs, rp, degree)),
        startup=tuple(startup_host(inputs, rp, eb)), resident_layers=resident, num_layers=rp.num_layers,
        on_gpu=inputs.on_gpu,
    )


def _bytes(terms: tuple[Term, ...]) -> int:
    return sum(t.bytes for t in terms)


def moment_totals(parts: RankParts) -> dict[str, int]:
    """Each moment's GPU bytes, allowances included: the numbers `_moments` prints, without
    building a term (the planner's path; tests/test_plan.py holds them equal)."""
    fixed = _bytes(parts.gpu["params"]) + _bytes(parts.gpu["optimizer"])
    saved, in_backward = _bytes(parts.activations), _bytes(parts.in_backward)
    totals = {}
    for name in parts.moments:
        tensors = fixed + _bytes(parts.grads_at[name]) + _bytes(parts.buffers_at[name])
        tensors += saved if name in (FORWARD, LOSS) else in_backward if name == BACKWARD else 0
        totals[name] = tensors + _bytes(tuple(allowance_terms(tensors, parts.on_gpu)))
    return totals


def _moments(parts: RankParts) -> list[Moment]:
    """The rank's moments: states, the gradients and buffers of each, saved activations
    until the step, the loss and recomputation transients, and the allowances."""
    moments = []
    for name in parts.moments:
        moment = Moment(name)
        moment.add("params", list(parts.gpu["params"])).add("optimizer", list(parts.gpu["optimizer"]))
        moment.add("grads", list(parts.grads_at[name]))
        if name in (FORWARD, LOSS):
            moment.add("activations", list(parts.activations))
        elif name == BACKWARD:
            moment.add("activations", list(parts.in_backward))
        moment.add("buffers", list(parts.buffers_at[name]))
        moment.add("buffers", allowance_terms(moment.total, parts.on_gpu))
        moments.append(moment)
    return moments


def rank_estimate(inputs: EstimateInputs, at: Coordinates, ranks: list[int]) -> DeviceEstimate:
    """The figures of the rank at `at` (`ranks`: the ranks these figures stand for)."""
    parts = rank_parts(inputs, at)
    moments = _moments(parts)
    top = peak(moments)
    terms = {f"gpu.{kind}": list(top.terms[kind]) for kind in (*KINDS, "activations", "buffers")}
    terms.update({f"cpu.{k}": list(parts.cpu[k]) for k in KINDS})
    cpu = {k: _bytes(parts.cpu[k]) for k in KINDS}
    cpu["total"] = sum(cpu.values())
    states = {k: _bytes(parts.gpu[k]) for k in KINDS}
    return DeviceEstimate(
        stage=at.pp_rank, ranks=ranks, gpu=top.breakdown(), cpu=cpu, states=states, terms=terms,
        peak_moment=top.name, moments=moments, resident_layers=parts.resident_layers,
        num_layers=parts.num_layers, saved_activations=_bytes(parts.activations),
        host=list(parts.host), startup=list(parts.startup),
    )


def param_counts(inputs: EstimateInputs) -> dict[str, int]:
    if inputs.shape is None:
        total = inputs.params or 0
        return {"total": total, "embedding": 0, "active": total, "trainable": total}
    counts = count_params(inputs.shape)
    if inputs.lora is not None:
        lora = lora_counts(inputs.shape, inputs.lora)
        return {"total": lora.total, "embedding": counts.embedding, "active": lora.active, "trainable": lora.trainable}
    return {"total": counts.total, "embedding": counts.embedding, "active": counts.active, "trainable": counts.total}
