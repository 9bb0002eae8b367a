"""The pieces of a step before they are put in time: every stage's per-microbatch costs and,
per pipeline rank, what follows its last backward (gradient reduction, optimizer, offload).

Data parallelism (Rajbhandari et al. 2020, ZeRO, section 7; ring volumes in collectives.py):

- stage 0: one all-reduce of the gradients per step (DDP buckets; not during gradient
  accumulation's earlier microbatches);
- stage 1: a reduce-scatter of the gradients, the sharded optimizer step, an all-gather of
  the updated 16-bit parameters;
- stage 2: a reduce-scatter per microbatch; fsdp2 gathers the parameters once per microbatch
  (kept until backward), DeepSpeed all-gathers the updated ones after the step;
- stage 3: per microbatch an all-gather before the forward, another before the backward
  (DeepSpeed's hooks gather again for a full recomputation's forward) and a reduce-scatter;
- hybrid sharding: those collectives inside the node, plus an all-reduce of the gradient
  shard across the replicas;
- FSDP2 in torch's pipeline stages (core/estimate_inputs.py `defers_to_step_end`): the
  schedules defer resharding and gradient reduction to the end of the step, so stage 2
  gathers once per step and keeps the blocks, stage 3 gathers before each forward and each
  backward, and neither reduce-scatters per microbatch: the whole reduction (stage 0's
  all-reduce too) runs in `perform_reduce_grad` after the last backward, with no compute
  left to overlap it.

The reduction overlaps the last backward where the framework does so (step_time.py).
Offload (ZeRO-Offload, Ren et al. 2021; FSDP2 CPUOffloadPolicy): gradients go to the host
during backward, the CPU runs the optimizer (bound by the node's DRAM bandwidth, every GPU's
share at once), updated 16-bit parameters come back; offloaded parameters are fetched per
layer in forward and backward, prefetched beside the compute.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..spec.model import ModelShape
from .collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Link, collective_seconds
from .deepspeed import accumulation_bytes, deepspeed_overlap, steps_with_bf16_optimizer
from .estimate_inputs import EstimateInputs, defers_to_step_end
from .hardware import Hardware, TimeConstants
from .layer_time import LayerCosts, LayerWork, local_linears, layer_costs
from .pipeline import stage_layers
from .precision import MIXED, ElementBytes, element_bytes
from .schedule import SPLIT_BACKWARD, chunks_per_rank
from .stage_time import EdgeCosts, ShardedTraffic, StageCost, edge_costs, overlapped, p2p_seconds, stage_cost
from .quantized import nf4_sharded_bytes
from .stages import rank_params


@dataclass(frozen=True)
class LoraShape:
    """Adapters of this rank on these linears (names as in core/params.py); the base is frozen."""

    rank: int
    targets: tuple[str, ...]
    nf4: bool = False  # QLoRA: the layer linears stored (and all-gathered) as NF4, dequantized to compute


@dataclass(frozen=True)
class TimePlan:
    """What the step's pieces share, derived once from the inputs."""

    inputs: EstimateInputs
    shape: ModelShape
    hw: Hardware
    c: TimeConstants
    eb: ElementBytes
    peak: float
    chunks: int
    stage_layers: tuple[int, ...]  # layers of every global stage
    degree: int  # ranks that shard (ZeRO >= 1) or replicate the gradients' reduction
    links: dict[str, Link]
    lora: LoraShape | None

    @property
    def frozen(self) -> bool:
        return self.lora is not None

    @property
    def overlap(self) -> bool:
        """The gradient reduction runs during backward: FSDP2 and DDP always; DeepSpeed as its
        `overlap_comm` says ([zero] overlap_comm; by default on at stage 3 only,
        deepspeed/runtime/zero/config.py; off under its pipeline engine, core/deepspeed.py)."""
        if self.c.overlap_grad_reduce is not None:
            return self.c.overlap_grad_reduce
        if self.inputs.framework == "fsdp2":
            return True
        return deepspeed_overlap(self.inputs.zero_stage, self.inputs.overlap_comm, self.inputs.degrees.pp > 1)

    @property
    def host_link(self) -> float:
        return self.hw.host_bandwidth * self.c.host_link_efficiency


def make_plan(inputs: EstimateInputs, hw: Hardware, c: TimeConstants, lora: LoraShape | None,
              links: dict[str, Link]) -> TimePlan:
    if inputs.shape is None:
        raise ValueError("the time model needs the model's architecture, not a bare parameter count")
    from .estimate import shard_degree  # the memory estimate's rule, kept in one place

    d = inputs.degrees
    chunks = chunks_per_rank(inputs.schedule, inputs.virtual)
    stages = tuple(len(s) for s in stage_layers(inputs.shape.num_layers, d.pp * chunks, *inputs.stage_split))
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    return TimePlan(inputs, inputs.shape, hw, c, eb, hw.peak_for(inputs.precision), chunks, stages,
                    shard_degree(inputs), links, lora)


def layer_of(plan: TimePlan) -> LayerCosts:
    inputs, lora = plan.inputs, plan.lora
    work = LayerWork(
        shape=plan.shape, micro_batch=inputs.micro_batch, seq_len=inputs.seq_len, tp=inputs.degrees.tp,
        cp=inputs.degrees.cp, sequence_parallel=inputs.sequence_parallel, attention=inputs.attention,
        dropout=inputs.dropout, recompute=inputs.recompute, act_bytes=plan.eb.compute, frozen=plan.frozen,
        lora_rank=lora.rank if lora else 0, lora_targets=lora.targets if lora else (),
        nf4=bool(lora and lora.nf4),
        sp_regather=inputs.framework != "fsdp2",
    )
    return layer_costs(work, plan.peak, plan.hw, plan.c, plan.links["tp"], plan.links["cp"])


def edges_of(plan: TimePlan) -> EdgeCosts:
    inputs = plan.inputs
    tokens = inputs.micro_batch * inputs.seq_len // inputs.degrees.cp
    sp = inputs.sequence_parallel and inputs.degrees.tp > 1
    return edge_costs(plan.shape, tokens, inputs.degrees.tp, sp, plan.eb.compute, plan.frozen, inputs.loss,
                      plan.peak, plan.hw, plan.c, plan.links["tp"])


def stage_elements(plan: TimePlan) -> list[int]:
    """Parameter elements of every global stage on tensor-parallel rank 0."""
    d, shape, inputs = plan.inputs.degrees, plan.shape, plan.inputs
    first = rank_params(shape, d.pp, inputs.virtual, 0, d.tp, 0, inputs.stage_split)
    last = rank_params(shape, d.pp, inputs.virtual, d.pp - 1, d.tp, 0, inputs.stage_split)
    embed = sum(p.numel for p in first.root if p.info.part in ("embedding", "position"))
    head = sum(p.numel for p in last.root if p.info.part not in ("embedding", "position"))
    elements = [layers * first.layer_numel for layers in plan.stage_layers]
    elements[0] += embed
    elements[-1] += head
    return elements


def adapter_elements(plan: TimePlan) -> int:
    """One layer's LoRA adapter elements on a tensor-parallel rank: r * (in + out) per target."""
    lora = plan.lora
    if lora is None:
        return 0
    return sum(lora.rank * (fan_in + fan_out)
               for name, fan_in, fan_out, _ in local_linears(plan.shape, plan.inputs.degrees.tp) if name in lora.targets)


def trained_elements(plan: TimePlan, elements: int, layers: int) -> int:
    """Elements with gradients and optimizer states: all of them, or LoRA's adapters."""
    return elements if plan.lora is None else layers * adapter_elements(plan)


def gathered_bytes(plan: TimePlan, elements: int, layers: int) -> float:
    """Bytes all-gathered for `elements` parameters of `layers` layers: the compute dtype, except
    QLoRA's layer linears, which FSDP2 gathers as NF4 codes, scalers and factors (torchao's
    `fsdp_pre_all_gather`; core/quantized.py)."""
    full = float(elements * plan.eb.compute)
    if plan.lora is None or not plan.lora.nf4:
        return full
    linears = layers * sum(fan_in * fan_out for _, fan_in, fan_out, _ in local_linears(plan.shape, plan.inputs.degrees.tp))
    if plan.shape.moe:
        linears = layers * sum(fan_in * fan_out * (1 if dense else plan.shape.num_experts)
                               for _, fan_in, fan_out, dense in local_linears(plan.shape, plan.inputs.degrees.tp))
    return full - linears * plan.eb.compute + nf4_sharded_bytes(linears)


def sharded_traffic(plan: TimePlan, elements: int, trained: int, layers: int = 0) -> ShardedTraffic:
    """Per-microbatch collectives of one stage: ZeRO stage 2/3's gathers and reduce-scatters
    (module docstring), fsdp2's all-reduce at stage 0 and its hybrid sharding's all-reduce
    across replicas (both every microbatch outside pipelines)."""
    inputs, eb, n, link = plan.inputs, plan.eb, plan.degree, plan.links["dp"]
    if reduces_every_microbatch(plan):
        # `run`'s stage 0 is fully_shard on a replicate-only mesh, which has no `no_sync`:
        # FSDP2 all-reduces each microbatch's gradients in its backward (runtime/train.py).
        return ShardedTraffic(0.0, collective_seconds(ALL_REDUCE, trained * eb.grads, n, link), plan.overlap)
    replicated = hybrid_reduce_every_microbatch(plan, trained)
    if inputs.zero_stage < 2 or n == 1:
        return ShardedTraffic(0.0, replicated, plan.overlap)
    gather = collective_seconds(ALL_GATHER, gathered_bytes(plan, elements, layers), n, link)
    if defers_to_step_end(inputs):  # reduced once when the step ends (`tail`)
        return ShardedTraffic(0.0, 0.0, plan.overlap) if inputs.zero_stage == 2 else ShardedTraffic(
            gather, gather, plan.overlap)
    reduce = collective_seconds(REDUCE_SCATTER, trained * eb.grads, n, link) + replicated
    if inputs.zero_stage == 2:
        return ShardedTraffic(gather if inputs.framework == "fsdp2" else 0.0, reduce, plan.overlap)
    regathers = 2 if inputs.framework != "fsdp2" and inputs.recompute == "full" else 1
    return ShardedTraffic(gather, regathers * gather + reduce, plan.overlap)


def reduces_every_microbatch(plan: TimePlan) -> bool:
    """ZeRO-0 under fsdp2 outside pipelines: replicated FSDP2 reduces every microbatch (DDP's
    `no_sync` has no FSDP2 counterpart in `run`'s loop); pipelines defer it to the step's end."""
    inputs = plan.inputs
    return (inputs.framework == "fsdp2" and inputs.zero_stage == 0 and plan.degree > 1
            and not defers_to_step_end(inputs))


def hybrid_reduce_every_microbatch(plan: TimePlan, trained: int) -> float:
    """Hybrid sharding under fsdp2 outside pipelines: after each microbatch's reduce-scatter in
    the node, FSDP2 all-reduces the gradient shard across the replicas (HSDP's post-backward);
    seconds of that all-reduce, else 0 (DeepSpeed's, and a pipeline's deferred one, run once)."""
    inputs = plan.inputs
    if not (inputs.hybrid and inputs.zero_stage >= 2 and inputs.framework == "fsdp2") or defers_to_step_end(inputs):
        return 0.0
    replicas = inputs.degrees.dp * inputs.degrees.cp // plan.degree
    return collective_seconds(ALL_REDUCE, trained * plan.eb.grads / plan.degree, replicas, plan.links["replicate"])


def offloaded_share(plan: TimePlan, pp_rank: int) -> float:
    """Share of a pipeline rank's layers whose parameters live on the host (0 without)."""
    inputs = plan.inputs
    if not inputs.offload_params:
        return 0.0
    from .estimate import resident_layers  # the memory estimate's decision, kept in one place

    d = inputs.degrees
    rp = rank_params(plan.shape, d.pp, inputs.virtual, pp_rank, d.tp, 0, inputs.stage_split)
    if not rp.num_layers:
        return 0.0
    return (rp.num_layers - resident_layers(rp, plan.eb, inputs, plan.degree)) / rp.num_layers


def optimizer_elements(plan: TimePlan, trained: int) -> int:
    """Elements this rank's optimizer updates: its shard from ZeRO stage 1 on, and under
    DeepSpeed's BF16_Optimizer, which partitions the fp32 master over dp even without ZeRO."""
    sharded = plan.inputs.zero_stage >= 1 or steps_with_bf16_optimizer(plan.inputs)
    return -(-trained // plan.degree) if sharded else trained


def cpu_optimizer_elements(plan: TimePlan, trained: int, share: float, layers_trained: int) -> int:
    """Of those, the ones the CPU updates: all with optimizer offload; under fsdp2 the
    offloaded layers' (their gradients and optimizer states go with the parameters; the
    embedding and head stay on the GPU). `layers_trained`: the part of `trained` in layers."""
    inputs = plan.inputs
    if inputs.offload_optimizer:
        return optimizer_elements(plan, trained)
    if inputs.framework == "fsdp2" and inputs.offload_params:
        return int(optimizer_elements(plan, layers_trained) * share)
    return 0


def layer_elements(plan: TimePlan) -> int:
    """One layer's parameter elements on tensor-parallel rank 0."""
    d, inputs = plan.inputs.degrees, plan.inputs
    return rank_params(plan.shape, d.pp, inputs.virtual, 0, d.tp, 0, inputs.stage_split).layer_numel


def streamed(plan: TimePlan, layers: int, trained: int, share: float) -> tuple[float, float]:
    """Host traffic of one stage per microbatch: (forward, backward) seconds. Offloaded
    parameters come in before the forward and again before the backward; gradients leave
    during backward when the CPU holds them and they are reduced per microbatch (stage >= 2,
    unless a pipeline defers the reduction to the step's end: `tail`), on the other direction
    of the link."""
    inputs, eb, host = plan.inputs, plan.eb, plan.host_link
    in_layers = layers * layer_elements(plan)
    fetch = 0.0
    if inputs.offload_params and share > 0:
        # The offloaded layers' parameters, as stored: compression applies to optimizer states
        # (core/offload.py); the embedding and head stay on the GPU.
        fetch = share * in_layers / plan.degree * eb.params / host
    leave = 0.0
    cpu = cpu_optimizer_elements(plan, trained, share, trained_elements(plan, in_layers, layers))
    if (cpu or inputs.offload_grads) and inputs.zero_stage >= 2 and not defers_to_step_end(inputs):
        grads = cpu if cpu else optimizer_elements(plan, trained)
        leave = grads * eb.grads / host
    return fetch, max(fetch, leave)


def stage_costs(plan: TimePlan, layer: LayerCosts, edges: EdgeCosts) -> list[StageCost]:
    """Every global stage's cost of one microbatch."""
    inputs = plan.inputs
    d = inputs.degrees
    tokens = inputs.micro_batch * inputs.seq_len // d.cp
    sp = inputs.sequence_parallel and d.tp > 1
    send = p2p_seconds(tokens, plan.shape.hidden_size, plan.eb.compute, d.tp, sp, plan.links["pp"], plan.links["tp"])
    split = inputs.schedule in SPLIT_BACKWARD
    last_stage = len(plan.stage_layers) - 1
    shares = [offloaded_share(plan, rank) for rank in range(d.pp)]
    costs = []
    # Stages alike in what their cost reads (most middle stages) share one StageCost.
    alike: dict[tuple, StageCost] = {}
    for stage, (layers, elements) in enumerate(zip(plan.stage_layers, stage_elements(plan))):
        share = shares[stage % d.pp]
        key = (layers, elements, share, stage == 0, stage == last_stage)
        cost = alike.get(key)
        if cost is None:
            trained = trained_elements(plan, elements, layers)
            cost = alike[key] = stage_cost(
                layers, layer, stage == 0, stage == last_stage, edges, send if d.pp > 1 else 0.0,
                sharded_traffic(plan, elements, trained, layers), streamed(plan, layers, trained, share), split,
                plan.c,
            )
        costs.append(cost)
    return costs


@dataclass(frozen=True)
class Tail:
    """What a pipeline rank does after its last backward, seconds (exposed parts only)."""

    data_parallel: float
    optimizer: float
    offload: float
    reduce: float  # the gradient reduction's own time (before overlap)
    gather: float  # the all-gather of updated parameters after the step (ZeRO-1, DeepSpeed ZeRO-2)
    optimizer_elements: int
    cpu_elements: int
    traffic_per_element: float


def optimizer_traffic(plan: TimePlan) -> float:
    """HBM bytes the GPU optimizer moves per element: the gradient read (once more for the
    norm clipping), every optimizer state read and written, the parameter read and written
    (or, with a separate fp32 master in the states, the 16-bit copy written)."""
    eb, c = plan.eb, plan.c
    inputs = plan.inputs
    grad_bytes = (accumulation_bytes(inputs.precision, inputs.grad_accum_dtype) if steps_with_bf16_optimizer(inputs)
                  else eb.grads)
    grads = grad_bytes * (1 + c.optimizer_extra_grad_reads)
    master_in_states = inputs.framework != "fsdp2" and inputs.precision in MIXED
    params = eb.params if master_in_states else 2 * eb.params
    return grads + 2 * eb.optimizer + params


# Host memory traffic per parameter that compressed optimizer states add to the CPU step
# (runtime/offload_codec.py): decoding and encoding both moments, every byte each of the
# codec's operations reads and writes, counted operation by operation on the codec itself
# (tests/test_offload_codec.py holds these figures to that count). bf16: its random bits, the
# carry, the truncation and the cast (30 B per moment to encode, 6 to decode); int8: torchao's
# block scaling, the code table's shift, gathers and comparison, and torchao's decoding; fp16:
# its block scaling (absolute values, their maximum, the division: 20 B), bf16's carry on 13
# bits (a random word for two elements, the two fields cut from it, the carry, the truncation
# and the cast: 36 B) and the search for fp16 subnormals (a key and its minimum: 20 B), 76 B
# per moment to encode, and 22 to decode (widen, scale, copy).
# Every pass is counted as if from DRAM; the codec's chunks of 2^20 elements partly stay in
# the caches, so this leans slow.
COMPRESSION_STEP_BYTES = {"none": 0.0, "bf16": 72.0, "fp16": 196.0, "int8": 185.0}


def cpu_step_bytes(plan: TimePlan) -> float:
    """Host memory bytes per parameter of the CPU optimizer step, compression included
    (only fsdp2's engine compresses)."""
    compression = plan.inputs.compression if plan.inputs.framework == "fsdp2" else "none"
    return plan.c.cpu_optimizer_bytes_per_param + COMPRESSION_STEP_BYTES.get(compression, 0.0)


def tail(plan: TimePlan, pp_rank: int, elements: list[int], last_backward: float) -> Tail:
    """Gradient reduction, optimizer and offload after a rank's last backward (`last_backward`:
    that action's compute seconds, which the reduction overlaps)."""
    inputs, eb, c = plan.inputs, plan.eb, plan.c
    d = inputs.degrees
    own = range(pp_rank, len(plan.stage_layers), d.pp)
    trained = sum(trained_elements(plan, elements[s], plan.stage_layers[s]) for s in own)
    per_layer = layer_elements(plan)
    layers_trained = sum(trained_elements(plan, plan.stage_layers[s] * per_layer, plan.stage_layers[s]) for s in own)
    n, link, stage = plan.degree, plan.links["dp"], inputs.zero_stage
    grads = trained * eb.grads
    reduce = gather = 0.0
    ddp = inputs.framework == "fsdp2" and stage == 1  # DDP and ZeroRedundancyOptimizer (runtime/parallel.py)
    if steps_with_bf16_optimizer(inputs):
        # DeepSpeed's BF16_Optimizer (core/deepspeed.py): the engine all-reduces the whole
        # accumulation buffers, in grad_accum_dtype (engine.py `buffered_allreduce_fallback`);
        # each rank steps its 1/dp partition and all-gathers the updated bf16 partitions
        # (`all_gather_dp_groups`, bf16_optimizer.py `step`).
        reduce = collective_seconds(ALL_REDUCE, trained * accumulation_bytes(inputs.precision, inputs.grad_accum_dtype),
                                    n, link)
        gather = collective_seconds(ALL_GATHER, trained * eb.compute, n, link)
    elif stage == 0 and not reduces_every_microbatch(plan):
        reduce = collective_seconds(ALL_REDUCE, grads, n, link)
    elif stage == 1:
        # DDP all-reduces the whole gradients; DeepSpeed's and the paper's ZeRO-1 reduce-scatter them.
        reduce = collective_seconds(ALL_REDUCE if ddp else REDUCE_SCATTER, grads, n, link)
    if stage == 1 or (stage == 2 and inputs.framework != "fsdp2"):
        # The updated parameters go back to every rank: ZeroRedundancyOptimizer broadcasts each
        # from its owner as stored (fp32 under fsdp2; an all-gather's volume), DeepSpeed
        # all-gathers its 16-bit copies.
        gather = collective_seconds(ALL_GATHER, trained * (eb.params if ddp else eb.compute), n, link)
    deferred = defers_to_step_end(inputs)
    if deferred and stage >= 2 and n > 1:
        reduce = collective_seconds(REDUCE_SCATTER, grads, n, link)
    exposed = gather
    if inputs.hybrid and stage >= 2 and not hybrid_reduce_every_microbatch(plan, trained):
        replicas = d.dp * d.cp // n
        reduce += collective_seconds(ALL_REDUCE, grads / n, replicas, plan.links["replicate"])
    exposed += overlapped(last_backward, reduce, c) if plan.overlap and not deferred else reduce
    if d.pp > 1 and plan.shape.tie_embeddings and pp_rank in (0, d.pp - 1) and not plan.frozen:
        # Megatron-LM all-reduces the tied embedding's gradient between the first and last stage.
        vocab = -(-plan.shape.vocab_size // d.tp)
        exposed += collective_seconds(ALL_REDUCE, vocab * plan.shape.hidden_size * eb.grads, 2, plan.links["pp"])
    share = offloaded_share(plan, pp_rank)
    opt = optimizer_elements(plan, trained)
    cpu = cpu_optimizer_elements(plan, trained, share, layers_trained)
    traffic = optimizer_traffic(plan)
    gpu_seconds = (opt - cpu) * traffic / (plan.hw.memory_bandwidth * plan.hw.memory_efficiency)
    offload = 0.0
    host = plan.host_link
    if cpu or inputs.offload_grads:
        moved = cpu if cpu else opt
        if stage < 2 or deferred:  # reduced once per step: the copy to the host follows it
            copy = moved * eb.grads / host
            if deferred:  # after the reduction at the step's end: no compute left to hide it
                offload += copy
            elif plan.overlap:  # the reduction and the copy after it, behind the last backward
                offload += overlapped(last_backward, reduce + copy, c) - overlapped(last_backward, reduce, c)
            else:
                offload += overlapped(last_backward, copy, c)
        if not cpu:  # gradients on the host, optimizer on the GPU: they come back
            offload += moved * eb.grads / host
    if cpu:
        # Every GPU of the node updates its shard at once on the node's CPUs.
        node = cpu * inputs.gpus_per_node * cpu_step_bytes(plan)
        offload += node / (plan.hw.host_memory_bandwidth * c.cpu_memory_efficiency)
        # The updated parameters return, as stored on the device (fsdp2's engine copies fp32
        # masters into fp32 shards; DeepSpeed its 16-bit copy), except where they live on the
        # host: every parameter under ZeRO-Infinity, fsdp2's offloaded layers.
        kept = ((int(optimizer_elements(plan, layers_trained) * share) if inputs.framework == "fsdp2" else cpu)
                if inputs.offload_params else 0)
        offload += max(0, cpu - kept) * eb.params / host
    return Tail(exposed, gpu_seconds, offload, reduce, gather, opt, cpu, traffic)
