"""`shardplan plan`: search the plans that fit, fastest first.

The space (every key the job does not fix): the factorisations of the world into dp, tp, pp
and cp that the model allows, sequence parallel, ZeRO stage 0-3 and hybrid sharding,
recomputation, micro batch sizes with the accumulation that makes the global batch, the
pipeline schedule with its virtual stages, the first and last stages' layers, and, only when
nothing fits without, the offload modes the runtime executes.

Each candidate goes through three gates, cheapest first, and only the last one costs a full
evaluation:

1. structure: the validation rules of `validate` that depend on the degrees alone (heads,
   key/value heads, layers per stage, sequence divisibility, the schedule's microbatches);
2. bounds: the model states a stage holds through the step, then those plus the saved
   activations of stage 0 (both parts of every moment) against the GPU memory;
3. the plan's exact figures: `core.memory.plan_figures` (equal to `estimate`'s, tested) and
   the time model's step time.

A rejected candidate counts under its reason; the fitting ones are ranked by step time (ties:
less memory), and the closest misses are kept for when nothing fits.
"""

from __future__ import annotations

import heapq
import time
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import product
from collections.abc import Sequence
from typing import Callable, Iterator

from ..spec.model import ModelShape
from .lora import LoraPlan, nf4_problems
from .degrees import Degrees
from .estimate import Coordinates, _activation_shape, _first_layer_bytes, _layer_bytes, _rank_params, shard_degree
from .buffers import CUDA_CONTEXT_BYTES, FRAGMENTATION
from .figures import rank_states_bytes
from .estimate_inputs import EstimateInputs
from .memory import cpu_limit, plan_figures, strategy_capacity
from .pipeline import split_layers, split_problem
from .offload import ENGINE_OPTIMIZERS
from .precision import element_bytes
from .schedule import CHUNKED_SCHEDULES

RECOMPUTE = ("none", "selective", "full")
# What `shardplan run` executes (runtime/capabilities.py): the search's space under fsdp2.
RUN_SCHEDULES = ("1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class Fixed:
    """Keys the job fixes (None: searched)."""

    dp: int | None = None
    tp: int | None = None
    pp: int | None = None
    cp: int | None = None
    sequence_parallel: bool | None = None
    schedule: str | None = None
    virtual: int | None = None
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    micro_batch: int | None = None
    num_microbatches: int | None = None
    zero_stage: int | None = None
    hybrid: bool | None = None
    recompute: str | None = None
    offload: bool | None = None  # offload keys written: never searched


@dataclass(frozen=True)
class Space:
    """What the search ranges over beside the fixed keys."""

    world: int
    global_batch: int  # sequences per optimizer step
    runnable: bool = True  # only plans `shardplan run` executes (fsdp2)
    # Tensor parallel over tied embeddings in the runnable space: `run` does not execute it,
    # Megatron-LM does (the space of its published runs, tests/test_plan.py).
    tied_tp: bool = False
    offload: bool = True  # try the offload strategy when nothing fits without
    max_microbatch: int = 64
    # Only what DeepSpeed's own engine runs (a job under the `deepspeed` accounting): no context
    # parallel (its Ulysses sequence parallel is another algorithm than the ring the estimate
    # counts), no Megatron-style sequence parallel, and pipelines as its PipelineEngine runs
    # them: 1F1B (its TrainSchedule) over evenly split layers, at ZeRO 0 or 1
    # (`sharding_options`). Keys the job sets stay as set.
    deepspeed: bool = False
    # With `runnable`: let the offload strategy move NF4 weights to the CPU, as FSDP+QLoRA
    # trainers do and `run` does not (io/plan_search.py says what fits that way).
    nf4_offload: bool = False

    @classmethod
    def of_framework(cls, framework: str, world: int, global_batch: int, **others) -> "Space":
        """`plan`'s space for a job's framework: what `run` executes under fsdp2, what
        DeepSpeed's own engine runs under deepspeed, everything under zero-paper."""
        return cls(world=world, global_batch=global_batch, runnable=framework == "fsdp2",
                   deepspeed=framework == "deepspeed", **others)


@dataclass(frozen=True)
class Found:
    """A plan that fits, with its figures: `asked` is the plan as a job states it, `inputs`
    the plan after the offload strategy's decision (the same when nothing was offloaded)."""

    inputs: EstimateInputs
    peak_gpu_bytes: int
    cpu_bytes_per_node: int
    seconds: float
    asked: EstimateInputs


@dataclass(frozen=True)
class Miss:
    """A plan that does not fit, and by how much."""

    inputs: EstimateInputs
    peak_gpu_bytes: int
    cpu_bytes_per_node: int
    short_bytes: int  # beyond the GPU memory or the host limit
    reason: str
    at_least: bool = False  # only the model states were counted: short by at least this much


@dataclass
class SearchResult:
    plans: list[Found]
    evaluated: int
    rejected: Counter = field(default_factory=Counter)
    misses: list[Miss] = field(default_factory=list)
    seconds: float = 0.0
    offloaded: bool = False  # the plans needed offload: nothing fit without
    fitting: int = 0  # plans that fit and were timed

    def batch_unsplit(self) -> bool:
        """Every plan was rejected because the global batch does not divide into its
        microbatches: no plan of the space splits it."""
        return bool(self.evaluated) and set(self.rejected) == {BATCH}


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))


def _options(fixed: int | None, values: list[int]) -> list[int]:
    return [fixed] if fixed is not None else values


def degree_options(shape: ModelShape, space: Space, fixed: Fixed, seq_len: int,
                   lora: LoraPlan | None = None) -> Iterator[Degrees]:
    """dp x tp x pp x cp = world, each degree allowed by the model and the space
    (`degree_refusal`, core/checks.py's rules)."""
    world = space.world
    for tp in _options(fixed.tp, divisors(world)):
        if degree_refusal(shape, space, "tp", tp, seq_len, lora):
            continue
        for cp in _options(fixed.cp, [1] if space.runnable or space.deepspeed else divisors(world // tp)):
            if world % (tp * cp) or degree_refusal(shape, space, "cp", cp, seq_len, lora):
                continue
            for pp in _options(fixed.pp, divisors(world // (tp * cp))):
                if world % (tp * cp * pp) or degree_refusal(shape, space, "pp", pp, seq_len, lora):
                    continue
                dp = world // (tp * cp * pp)
                if fixed.dp is not None and dp != fixed.dp:
                    continue
                yield Degrees(dp=dp, tp=tp, pp=pp, cp=cp)


def degree_refusal(shape: ModelShape, space: Space, name: str, value: int, seq_len: int,
                   lora: LoraPlan | None = None) -> str | None:
    """Why no plan may have degree `name` = `value`, whatever the other degrees (the rules of
    `degree_options`, which asks this of every degree it tries), or None when it may: tp
    divides the query heads and divides or is a multiple of the key/value heads (and, for
    `run`, is at most them), pp at most the layers, cp splits the sequence into 2*cp chunks;
    `run` executes no context parallel, and QLoRA and models with tied embeddings without
    tensor parallelism (runtime/capabilities.py)."""
    if space.world % value:
        return f"{value} does not divide the {space.world:,} GPUs"
    return model_refusal(shape, space, name, value, seq_len, lora)


def model_refusal(shape: ModelShape, space: Space, name: str, value: int, seq_len: int,
                  lora: LoraPlan | None = None) -> str | None:
    """The rules of `degree_refusal` that hold whatever the number of GPUs: the model's heads,
    layers and sequence, and what `run` executes."""
    heads, kv = shape.num_heads, shape.num_kv_heads
    if name == "tp":
        if heads % value:
            return f"{value} does not divide model.num_heads ({heads})"
        if kv % value and value % kv:
            return f"{value} neither divides nor is a multiple of model.num_kv_heads ({kv})"
        if space.runnable and value > kv:
            return f"`shardplan run` splits no key/value head over tensor-parallel ranks ({value} > model.num_kv_heads, {kv})"
        if space.runnable and lora is not None and lora.nf4 and value > 1:
            return "`shardplan run` executes QLoRA without tensor parallelism"
        if space.runnable and not space.tied_tp and shape.tie_embeddings and value > 1:
            return "`shardplan run` executes a model with tied embeddings without tensor parallelism"
    if name == "cp" and value > 1:
        if space.runnable:
            return "`shardplan run` executes no context parallelism"
        if seq_len % (2 * value):
            return f"the sequence of {seq_len:,} tokens does not split into {2 * value} chunks"
    if name == "pp" and value > shape.num_layers:
        return f"{value} stages are more than the model's {shape.num_layers} layers"
    return None


def schedule_options(shape: ModelShape, pp: int, space: Space, fixed: Fixed) -> list[tuple[str, int, tuple[int, int]]]:
    """(schedule, virtual stages, (first, last) stage layers) for pp stages. One stage runs
    gradient accumulation: no schedule to choose. 1F1B takes uneven end stages: the first
    holds the most microbatches and the last the head and the loss, so one or two layers
    fewer there than ceil(layers / pp) (Megatron-LM's first/last pipeline layers; Llama 3 405B:
    one fewer on each; where pp does not divide the layers, the even split already has one
    fewer on the last, so two fewer is the lighter choice). Interleaved 1F1B takes up to 8
    virtual stages, each split over its chunks as `_chunk_splits` says."""
    if pp == 1:
        if (fixed.virtual or 1) > 1 or fixed.first_stage_layers or fixed.last_stage_layers:
            return []  # chunks per rank or an uneven split need a pipeline
        return [(fixed.schedule or "1f1b", 1, (0, 0))]
    if space.runnable and fixed.schedule == "zero-bubble":
        return []  # `run` refuses torch's zero-bubble schedule (runtime/capabilities.py)
    schedules = [fixed.schedule] if fixed.schedule else (["1f1b"] if space.deepspeed else list(
        RUN_SCHEDULES if space.runnable else ("1f1b", "interleaved-1f1b", "zero-bubble")))
    out = []
    layers = shape.num_layers
    for schedule in schedules:
        if schedule in CHUNKED_SCHEDULES:
            if fixed.virtual == 1:
                continue
            virtuals = [fixed.virtual] if fixed.virtual else list(range(2, min(8, layers // pp) + 1))
            for v in virtuals:
                if v <= 1 or v * pp > layers:
                    continue
                out += [(schedule, v, split) for split in _chunk_splits(layers, pp * v, fixed)]
            continue
        if fixed.virtual and fixed.virtual > 1:  # chunks per rank need a chunked schedule
            continue
        firsts, lasts = _end_options(layers, pp, fixed, lighter=not space.deepspeed)  # DeepSpeed: even stages
        seen = set()  # a split reached twice (an even rest equal to a fixed last stage) is one plan
        for first, last in product(firsts, lasts):
            if (first or last) and split_problem(layers, pp, first, last):
                continue
            counts = tuple(split_layers(layers, pp, first, last))
            if counts in seen:
                continue
            seen.add(counts)
            out.append((schedule, 1, (first, last)))
    return out


def _end_options(layers: int, stages: int, fixed: Fixed, lighter: bool = True) -> tuple[list[int], list[int]]:
    """The first and the last stage's layer counts to search over `stages` stages (or chunks):
    what the job fixes, else 0 (the even split) and, `lighter`, one or two layers fewer than
    ceil(layers / stages)."""
    base = -(-layers // stages)
    ends = sorted(({0} | ({base - 1, base - 2} if lighter else set())) - {-1})
    firsts = [fixed.first_stage_layers] if fixed.first_stage_layers is not None else ends
    lasts = [fixed.last_stage_layers] if fixed.last_stage_layers is not None else ends
    return firsts, lasts


def _chunk_splits(layers: int, stages: int, fixed: Fixed) -> list[tuple[int, int]]:
    """(first, last) chunk layers of a chunked schedule over `stages` = pp x virtual chunks:
    the even split where the chunks divide the layers (its validation rule, core/checks.py),
    else, as 1F1B's ends, one or two layers fewer than ceil(layers / stages) on the first and
    the last chunk, the chunks between sharing the rest evenly (Llama 3 405B: 126 layers
    interleaved over 16 stages x 4 chunks as 1, 2 x 62, 1; Megatron-LM's rule for uneven
    stages, transformer_config.py). Ends the job fixes stay as fixed, the other end searched
    as 1F1B's is."""
    firsts, lasts = _end_options(layers, stages, fixed)
    out, seen = [], set()
    for first, last in product(firsts, lasts):
        if not (first or last):
            if layers % stages == 0:
                out.append((0, 0))
            continue
        if layers % stages == 0 and fixed.first_stage_layers is None and fixed.last_stage_layers is None:
            continue  # an even split exists: the chunks' ends are not searched
        if split_problem(layers, stages, first, last):
            continue
        counts = tuple(split_layers(layers, stages, first, last))
        if len(set(counts[1:-1])) > 1:
            continue  # the chunks between share the rest evenly (Megatron-LM's rule for its stages)
        if counts not in seen:
            seen.add(counts)
            out.append((first, last))
    return out


def microbatch_rule(pp: int, schedule: str) -> tuple[int, int]:
    """(least, multiple of) the microbatches a step takes: a pipeline at least pp (1F1B's
    warm-up), interleaved 1F1B a multiple of pp; one stage any number."""
    if pp == 1:
        return 1, 1
    return pp, pp if schedule == "interleaved-1f1b" else 1


def batch_options(dp: int, pp: int, schedule: str, space: Space, fixed: Fixed) -> list[tuple[int, int]]:
    """(micro batch, microbatches) making the global batch over dp ranks, microbatches as
    `microbatch_rule` allows."""
    if space.global_batch % dp:
        return []
    local = space.global_batch // dp
    least, step = microbatch_rule(pp, schedule)
    out = []
    for mbs in _options(fixed.micro_batch, [d for d in divisors(local) if d <= space.max_microbatch]):
        if local % mbs:
            continue
        m = local // mbs
        if fixed.num_microbatches is not None and m != fixed.num_microbatches:
            continue
        if m < least or m % step:
            continue
        out.append((mbs, m))
    return out


def next_split_batch(given: int, dp: int, pp: int, schedule: str, space: Space, fixed: Fixed) -> int | None:
    """The least global batch above `given` that dp ranks of a pp-stage `schedule` split
    (`batch_options`: dp divides it; micro batch x microbatches makes each rank's share; the
    microbatches as `microbatch_rule` allows), or None if no batch does."""
    least, step = microbatch_rule(pp, schedule)

    def up(n: int) -> int:  # the least allowed number of microbatches >= n
        return -(-max(n, least) // step) * step

    mbs, m = fixed.micro_batch, fixed.num_microbatches
    if m is not None and (m < least or m % step):
        return None
    if mbs is not None and m is not None:
        return dp * mbs * m if dp * mbs * m > given else None
    if mbs is not None:  # microbatches free
        return dp * mbs * up(given // (dp * mbs) + 1)
    if m is not None:  # micro batch free, at most the search's largest
        size = given // (dp * m) + 1
        return dp * m * size if size <= space.max_microbatch else None
    # Both free: micro batch 1 gives the most microbatches, and a micro batch > 1 splits a
    # share only when 1 does (interleaved: pp divides share / mbs, so it divides the share).
    return dp * up(given // dp + 1)


def _hybrid_even(degrees: Degrees, order: str, gpus_per_node: int) -> bool:
    """Hybrid sharding splits every shard group evenly over its nodes (core/layout.py)."""
    from .estimate import _hybrid_degree
    from ..spec.errors import PlanError

    try:
        _hybrid_degree(degrees, order, gpus_per_node)
    except PlanError:
        return False
    return True


@lru_cache(maxsize=256)
def _nf4_blocked(shape: ModelShape, tp: int, shards: int) -> bool:
    return bool(nf4_problems(shape, tp, shards))


def sharding_options(degrees: Degrees, nodes: int, space: Space, fixed: Fixed,
                     framework: str, gpus_per_node: int = 8, order: str = "tp-cp-dp-pp",
                     lora: LoraPlan | None = None, shape: ModelShape | None = None) -> list[tuple[int, bool]]:
    """(ZeRO stage, hybrid): stage 1 runs under DDP, which cannot wrap tensor-parallel
    parameters (`run`), nor LoRA; QLoRA's NF4 weights must split into torchao's whole blocks
    over the shard group; DeepSpeed's pipeline engine takes stages 0 and 1 only; hybrid
    sharding needs stage 2 or 3 and more than one node, and DeepSpeed (0.19: MiCS removed)
    has none."""
    out = []
    for stage in _options(fixed.zero_stage, [0, 1, 2, 3]):
        if space.runnable and stage == 1 and (degrees.tp > 1 or lora is not None):
            continue
        if space.runnable and lora is not None and lora.nf4 and shape is not None:
            shards = degrees.dp * degrees.cp if stage >= 2 else 1
            if _nf4_blocked(shape, degrees.tp, shards):
                continue
        if framework != "fsdp2" and degrees.pp > 1 and stage >= 2:
            continue
        # Hybrid differs from plain sharding only when the shard group (dp x cp, every tp*cp
        # ranks apart in the default order) leaves the node.
        spans = degrees.dp * degrees.cp > 1 and degrees.dp * degrees.cp * degrees.tp > gpus_per_node
        hybrids = [fixed.hybrid] if fixed.hybrid is not None else (
            [False, True] if stage >= 2 and spans and not space.deepspeed else [False])
        out += [(stage, h) for h in hybrids
                if not (h and (stage < 2 or nodes == 1 or not _hybrid_even(degrees, order, gpus_per_node)))]
    return out


def _states(inputs: EstimateInputs, stage: int) -> int:
    """Parameters and optimizer states a stage's fullest rank holds on its GPU through the step."""
    return rank_states_bytes(inputs, Coordinates(pp_rank=stage))


def states_bound(inputs: EstimateInputs) -> int:
    """The larger of stage 0's and the last stage's GPU model states: part of every moment of
    that stage, so a lower bound of the plan's peak."""
    return max(_states(inputs, 0), _states(inputs, inputs.degrees.pp - 1))


def forward_bound(inputs: EstimateInputs, states: int | None = None) -> int:
    """Stage 0's states and the saved activations of its first chunk's layers at the least it
    holds them (1F1B-like schedules: min(pp, microbatches) microbatches; otherwise one): both
    are in stage 0's `forward` moment, so a lower bound of the plan's peak. `states`: stage
    0's, when known."""
    states = _states(inputs, 0) if states is None else states
    if inputs.shape is None:
        return states
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    rp = _rank_params(inputs, Coordinates(pp_rank=0))
    pp = inputs.degrees.pp
    held = min(pp, inputs.num_microbatches) if pp > 1 and inputs.schedule in ("1f1b", "gpipe", "zero-bubble") else 1
    first_chunk = rp.chunk_layers[0] if rp.chunk_layers else 0
    act = _activation_shape(inputs, eb)
    saved = first_chunk * _layer_bytes(act)
    if first_chunk and act.lora is not None:  # LoRA's first layer keeps less (core/lora_activations.py)
        saved += _first_layer_bytes(act) - _layer_bytes(act)
    return states + held * saved


class Group(Sequence):
    """The plans of one structure, sharding, recomputation and sequence parallel that differ
    only in the micro batch (ascending, the accumulation making the global batch), each built
    when first read: a search reaches a small part of its space. Groups with the same `key`
    (the structure, recomputation and sequence parallel: all but the sharding) share their
    time bounds."""

    __slots__ = ("bare", "recompute", "sequence_parallel", "batches", "key", "_plans")

    def __init__(self, bare: EstimateInputs, recompute: str, sequence_parallel: bool,
                 batches: list[tuple[int, int]], key: tuple):
        self.bare, self.recompute, self.sequence_parallel = bare, recompute, sequence_parallel
        self.batches, self.key = batches, key
        self._plans: list[EstimateInputs | None] = [None] * len(batches)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> EstimateInputs:
        plan = self._plans[index]
        if plan is None:
            mbs, m = self.batches[index]
            plan = self._plans[index] = self.bare.with_(recompute=self.recompute,
                                                        sequence_parallel=self.sequence_parallel,
                                                        micro_batch=mbs, num_microbatches=m)
        return plan

    def single_last(self) -> bool:
        """The last plan runs one microbatch (frees its gradients in forward: tried alone)."""
        return self.batches[-1][1] == 1


def candidates(base: EstimateInputs, space: Space, fixed: Fixed, rejected: Counter) -> Iterator[Group]:
    """Every structurally valid plan of the space, cheapest checks first, rejections counted:
    in groups that differ only in the micro batch (`Group`). The groups of one structure and
    sharding share their `bare` plan, on which the search checks the model states
    (`_Walk.admit`)."""
    shape = base.shape
    assert shape is not None
    gpn = base.gpus_per_node
    nodes = -(-space.world // gpn)
    recomputes = _options(fixed.recompute, list(RECOMPUTE))
    structure = 0
    for degrees in degree_options(shape, space, fixed, base.seq_len, base.lora):
        sps = [fixed.sequence_parallel] if fixed.sequence_parallel is not None else (
            [False, True] if degrees.tp > 1 and not space.deepspeed else [False])
        if space.runnable and base.lora is not None:  # `run` executes LoRA without sequence parallel
            sps = [sp for sp in sps if not sp]
        if degrees.tp > 1 and any(sp for sp in sps) and (base.seq_len // degrees.cp) % degrees.tp:
            sps = [sp for sp in sps if not sp]
        if space.runnable and shape.position_embedding == "learned":
            sps = [sp for sp in sps if not sp]
        for schedule, virtual, split in schedule_options(shape, degrees.pp, space, fixed):
            batches = batch_options(degrees.dp, degrees.pp, schedule, space, fixed)
            if not batches:
                rejected[BATCH] += 1
                continue
            structure += 1
            for stage, hybrid in sharding_options(degrees, nodes, space, fixed, base.framework, gpn, base.order,
                                                  lora=base.lora, shape=shape):
                keep = fixed.offload is not None  # the job's own offload stays as written
                bare = base.with_(degrees=degrees, schedule=schedule, virtual=virtual, stage_split=split,
                                  zero_stage=stage, hybrid=hybrid, micro_batch=1, num_microbatches=batches[0][1],
                                  sequence_parallel=False, recompute="full",
                                  offload_params=base.offload_params and keep, offload_grads=base.offload_grads and keep,
                                  offload_optimizer=base.offload_optimizer and keep, strategy="conservative")
                for recompute, sp in product(recomputes, sps):
                    yield Group(bare, recompute, sp, batches, (structure, recompute, sp))


def offload_floor(inputs: EstimateInputs) -> int:
    """A lower bound of the plan's peak under any offload the strategy may add: its model
    states with the optimizer, gradients and (stage 3) every layer's parameters on the host,
    which only lowers the states a stage keeps on the GPU, plus stage 0's saved activations,
    which offload does not move."""
    most = inputs.with_(offload_optimizer=True, offload_grads=True, offload_params=inputs.zero_stage == 3,
                        resident_layers=0 if inputs.zero_stage == 3 else inputs.resident_layers)
    return with_allowances(max(forward_bound(most), states_bound(most)), inputs.on_gpu)


def with_allowances(tensors: int, on_gpu: bool) -> int:
    """Every moment adds the CUDA context and the allocator's allowance to its tensors
    (core/figures.py, rank_figures), and both grow with them: a lower bound of tensors is one
    of the moment with them added."""
    return tensors + (CUDA_CONTEXT_BYTES + int(tensors * FRAGMENTATION) if on_gpu else 0)


def _with_offload(inputs: EstimateInputs, strategy: str) -> EstimateInputs:
    """The plan left to the offload strategy (core/memory.py), which adds the offload modes
    the runtime executes, cheapest first, only as far as the plan needs to fit."""
    return inputs.with_(strategy=strategy)


BATCH = "the global batch does not divide into microbatches"
PRUNED = "slower than the plans found (lower bound of the step time)"
SMALLER = "GPU memory (a smaller micro batch already does not fit)"
STATES = "model states exceed the GPU memory"
FORWARD = "GPU memory (states and stage 0's activations)"
OFFLOAD_FLOOR = "GPU memory even with every offload (activations and what stays on the GPU)"
TORCH_SP = "GPU memory with sequence parallel as torch keeps it (the gathered linear inputs)"
NF4_OFFLOAD = "it would offload NF4 weights, which `run` does not"
TWIN = "the same plan and step at another ZeRO stage with less memory (one rank per shard group shards nothing)"
SPLIT_TWIN = "the same peak and step at another layer split (the one with fewer keys kept)"


def unrunnable_offload(plan: EstimateInputs, nf4_offload: bool = False) -> str | None:
    """Why `run` would refuse the offload the strategy decided for `plan`, or None
    (runtime/capabilities.py refuses the same before any process starts); `nf4_offload`
    lets NF4 weights go to the CPU."""
    if plan.lora is not None and plan.lora.nf4 and plan.offload_params and not nf4_offload:
        return NF4_OFFLOAD
    if (plan.offload_optimizer or plan.offload_params) and plan.optimizer not in ENGINE_OPTIMIZERS:
        return f"it would offload {plan.optimizer} states, which the offload engine does not step"
    return None


class _Walk:
    """The search's state: the best plans so far, rejections, near misses, each group's
    largest fitting micro batch. Every plan the walk reaches counts once in `evaluated` and
    once either under a rejection reason or in `fitting` (tests/test_plan_cli.py)."""

    def __init__(self, base: EstimateInputs, top_k: int, timer, progress, refine=None, torch_sp: bool = False):
        self.torch_sp = torch_sp  # sequence-parallel plans must also fit as torch keeps them (`memory`)
        self.gpu_memory = base.gpu_memory
        self.capacity = strategy_capacity(base)  # the job's strategy keeps its headroom
        self.limit = cpu_limit(base)
        self.top_k, self.timer, self.progress, self.refine = top_k, timer, progress, refine
        self.result = SearchResult(plans=[], evaluated=0)
        self.best: list[tuple] = []  # min-heap of (-seconds, -peak, -order, inputs, peak, host, asked)
        self.misses: list[Miss] = []
        self.order = 0
        self.pending: list[tuple] = []  # min-heap of (sharper bound, queued, inputs, asked, figures): `rank`
        self.queued = 0
        self.fitted = False  # a plan fits (then misses are no longer kept)
        self.fits: dict[int, int] = {}  # group -> index of its largest fitting micro batch (-1: none)
        self.checked: dict[tuple[int, int], tuple[bool, int, int, str]] = {}  # (group, index) -> memory()
        self.state_cache: dict[tuple, tuple[int, int]] = {}
        self.twins: dict[tuple, tuple] = {}  # twin_key -> the ranked item of least memory
        self.admitted: dict[int, bool] = {}  # id of a group's bare plan -> its states fit (`admit`)

    def kth(self) -> float | None:
        return -self.best[0][0] if len(self.best) == self.top_k else None

    def miss(self, inputs: EstimateInputs, peak: int, host: int, short: int, reason: str) -> None:
        self.misses.append(Miss(inputs, peak, host, short, reason))
        if len(self.misses) > 4 * self.top_k:
            self.misses.sort(key=lambda m: m.short_bytes)
            del self.misses[2 * self.top_k:]

    def admit(self, group: Group) -> bool:
        """False for a group whose model states alone (stage 0's or the last stage's, with the
        allowances every moment adds) exceed the GPU, its plans rejected; checked once per
        structure and sharding (the groups' shared `bare` plan), where a miss by at least that
        much is kept."""
        verdict = self.admitted.get(id(group.bare))
        if verdict is None:
            bare = group.bare
            states = with_allowances(max(self.states(bare)), bare.on_gpu)
            verdict = self.admitted[id(bare)] = states <= self.gpu_memory
            if not verdict:
                self.misses.append(Miss(bare, states, 0, states - (self.capacity or 0), "GPU memory", at_least=True))
        if not verdict:
            self.reject(STATES, len(group))
            self.tick(len(group))
        return verdict

    def states(self, inputs: EstimateInputs) -> tuple[int, int]:
        """Stage 0's and the last stage's GPU model states, shared by the plans that differ
        only in what the states do not depend on (micro batch, recomputation, sequence
        parallel; accumulation only as one microbatch or more)."""
        key = (inputs.degrees, inputs.zero_stage, inputs.hybrid, inputs.schedule, inputs.virtual, inputs.stage_split,
               inputs.num_microbatches == 1, inputs.strategy, inputs.offload_params, inputs.offload_grads,
               inputs.offload_optimizer, inputs.resident_layers)
        found = self.state_cache.get(key)
        if found is None:
            found = self.state_cache[key] = (_states(inputs, 0), _states(inputs, inputs.degrees.pp - 1))
        return found

    def memory(self, inputs: EstimateInputs) -> tuple[bool, int, int, str]:
        """(fits, peak, host, why not) of a plan; near misses are kept."""
        if self.capacity is not None:
            first, last = self.states(inputs)
            if with_allowances(max(forward_bound(inputs, first), first, last), inputs.on_gpu) > self.capacity:
                return False, 0, 0, FORWARD
        # Misses are shown only when nothing fits: once a plan fits none is kept, and the
        # first stage over the GPU is enough to reject a plan.
        peak, host = plan_figures(inputs, self.capacity if self.fitted else None)
        over_gpu = peak - self.capacity if self.capacity is not None else 0
        over_host = host - self.limit
        if over_gpu > 0 or over_host > 0:
            reason = "GPU memory" if over_gpu > 0 else "host memory"
            if not self.fitted:
                self.miss(inputs, peak, host, max(over_gpu, over_host), reason)
            return False, peak, host, reason
        if self.torch_sp and inputs.sequence_parallel and inputs.degrees.tp > 1 and self.capacity is not None:
            # `run` executes sequence parallel as torch's DTensor plan does, which keeps the
            # gathered inputs of the QKV and MLP linears beyond the paper's accounting that the
            # figures (and `estimate`) follow: the plan must also fit as torch keeps them.
            held = plan_figures(inputs.with_(sp_keeps_gathered=True), self.capacity)[0]
            if held > self.capacity:
                if not self.fitted:
                    self.miss(inputs, peak, host, held - self.capacity, TORCH_SP)
                return False, peak, host, TORCH_SP
        self.fitted = True
        return True, peak, host, ""

    def checked_memory(self, group: int, index: int, inputs: EstimateInputs) -> tuple[bool, int, int, str]:
        key = (group, index)
        if key not in self.checked:
            self.checked[key] = self.memory(inputs)
        return self.checked[key]

    def largest_fitting(self, group: int, plans: Sequence[EstimateInputs], count: int, check=None) -> int:
        """Memory grows with the micro batch at a fixed accumulation rule (activations and the
        loss's transients scale with it, the rest does not change; tests/test_plan.py): the
        fitting micro batches are a prefix, found by a galloping search from the smallest. A
        list's last plan with a single microbatch is left out: it frees its gradients in forward
        and is tried alone.
        `count`: how many of `plans` to consider. `check(group, index, plan)` -> (fits, ...):
        `checked_memory` unless given."""
        check = check or self.checked_memory
        if group not in self.fits:
            # Most groups a search reaches fit nothing or only their smallest micro batches:
            # probe from the smallest, at 0, 1, 3, 7, ... while they fit, then halve the gap
            # left. A group that fits nothing costs one check.
            best, probe, step = -1, 0, 1
            while probe < count and check(group, probe, plans[probe])[0]:
                best, probe, step = probe, probe + step, step * 2
            low, high = best + 1, min(probe, count) - 1
            while low <= high:
                middle = (low + high) // 2
                if check(group, middle, plans[middle])[0]:
                    best, low = middle, middle + 1
                else:
                    high = middle - 1
            self.fits[group] = best
        return self.fits[group]

    def reject(self, reason: str, count: int = 1) -> None:
        self.result.rejected[reason] += count

    def rank(self, inputs: EstimateInputs, asked: EstimateInputs | None = None, figures=None) -> None:
        """A plan that fits. With `refine`, it waits at its sharper bound (`settle`): pruned
        if that exceeds the k-th best time already, else timed once the walk reaches that
        bound, so the fits with the least bounds are timed first and the k-th best time falls
        soonest. Without, it is timed now."""
        if self.refine is None:
            self._time(inputs, asked, figures)
            return
        lower = self.refine(inputs)
        kth = self.kth()
        if kth is not None and lower > kth:
            self.reject(PRUNED)
            return
        self.queued += 1
        heapq.heappush(self.pending, (lower, self.queued, inputs, asked, figures))

    def settle(self, up_to: float = float("inf")) -> None:
        """Times the waiting fits whose sharper bound is at most `up_to` (the walk's next
        bound: every plan not yet reached takes at least that), least bound first; those
        above the k-th best time by then are pruned."""
        pending = self.pending
        while pending and pending[0][0] <= up_to:
            lower, _, inputs, asked, figures = heapq.heappop(pending)
            kth = self.kth()
            if kth is not None and lower > kth:
                self.reject(PRUNED, len(pending) + 1)  # the rest wait at larger bounds still
                pending.clear()
                return
            self._time(inputs, asked, figures)

    def _time(self, inputs: EstimateInputs, asked: EstimateInputs | None, figures) -> None:
        peak, host = figures if figures is not None else plan_figures(inputs)
        seconds = self.timer(inputs)
        self.order += 1
        self.result.fitting += 1
        item = (-seconds, -peak, -self.order, inputs, peak, host, asked or inputs)
        # (key, reason, preference: the least is kept) of the lists a plan is listed once in
        twins = [(key, reason, prefer) for key, reason, prefer in (
            (twin_key(inputs, asked or inputs, seconds, peak, host), TWIN, _stage_preference),
            (split_twin_key(inputs, asked or inputs, seconds, peak, host), SPLIT_TWIN, _split_preference))
            if key is not None]
        # A kept twin with a lesser preference rejects the plan before it displaces any other.
        for key, reason, prefer in twins:
            twin = self.twins.get(key)
            if twin is not None and prefer(twin) <= prefer(item):
                self.result.fitting -= 1
                self.reject(reason)
                return
        for key, reason, prefer in twins:
            twin = self.twins.get(key)
            if twin is not None:
                self.result.fitting -= 1  # the twin it is preferred to leaves the ranking
                self.result.rejected[reason] += 1
                if twin in self.best:
                    self.best.remove(twin)
                    heapq.heapify(self.best)
            self.twins[key] = item
        if len(self.best) < self.top_k:
            heapq.heappush(self.best, item)
        elif item > self.best[0]:
            heapq.heapreplace(self.best, item)

    def in_bound_order(self, groups: list[Group], bound, group_bound=None,
                       admit: Callable[[Group], bool] | None = None) -> Iterator[tuple[int, int, EstimateInputs]]:
        """(group, index, plan) in increasing order of the time bound (ties: group, index),
        each counted evaluated; stops, counting the rest as pruned, once the next bound exceeds
        the k-th best time.

        With `group_bound` (a lower bound of `bound` over a group's micro batches, shared by
        the groups of one key), the plans' own bounds are computed only for the keys the walk
        reaches: one heap holds the keys at their group bound and the plans of the keys taken
        out of it at theirs; a key leaves before plans of the same value, so the plans come out
        in the order of sorting every plan's bound (`_keyed`), and the walk stops at the same
        plan. `admit(group)`, when given, is asked once per group: False leaves the group out
        (it counts its plans itself). It is asked when the group's first plan comes out, or,
        before any plan is ranked (when nothing stops the walk), as its key is taken, which
        spares the bounds of groups left out."""
        if bound is None or group_bound is None:
            admitted = [g for g, plans in enumerate(groups) if admit is None or admit(plans)]
            keyed = [(lower, admitted[a], i) for lower, a, i in _keyed([groups[g] for g in admitted], bound)]
            for position, (lower, g, i) in enumerate(keyed):
                self.settle(lower)
                kth = self.kth()
                if bound is not None and kth is not None and lower > kth:
                    self.reject(PRUNED, len(keyed) - position)
                    self.tick(len(keyed) - position)
                    return
                self.tick()
                yield g, i, groups[g][i]
            return
        members: dict[tuple, list[int]] = {}
        for g, plans in enumerate(groups):
            members.setdefault(plans.key, []).append(g)
        keys = list(members.values())
        # The keys of one structure and sequence parallel differ only in recomputation, which
        # only adds time (none, then selective, then full: core/layer_time.py): a key's group
        # bound is at least the previous one's, so each key is bounded and enters the heap
        # only once the previous one is taken (tests/test_plan.py holds the order).
        after: dict[int, int] = {}  # key -> the next key of its chain
        chains: dict[tuple, list[tuple[int, int]]] = {}
        for n, gs in enumerate(keys):
            first = groups[gs[0]]
            if first.recompute in RECOMPUTE:
                chains.setdefault((first.key[0], first.sequence_parallel), []).append(
                    (RECOMPUTE.index(first.recompute), n))
        for chain in chains.values():
            chain.sort()
            after.update((n, m) for (_, n), (_, m) in zip(chain, chain[1:]))
        later = set(after.values())
        heap: list[tuple] = [(group_bound(groups[gs[0]]), 0, n) for n, gs in enumerate(keys) if n not in later]
        heapq.heapify(heap)
        left = sum(len(plans) for plans in groups)  # plans not yet yielded nor left out
        verdicts: dict[int, bool] = {}  # group -> admitted

        def verdict_of(g: int) -> bool:
            nonlocal left
            verdict = verdicts.get(g)
            if verdict is None:
                verdict = verdicts[g] = admit(groups[g])
                if not verdict:
                    left -= len(groups[g])
            return verdict

        while heap:
            entry = heapq.heappop(heap)
            self.settle(entry[0])
            kth = self.kth()
            if kth is not None and entry[0] > kth:
                self.reject(PRUNED, left)
                self.tick(left)
                return
            if entry[1] == 0:
                follows = after.get(entry[2])
                if follows is not None:
                    heapq.heappush(heap, (group_bound(groups[keys[follows][0]]), 0, follows))
                known: dict[int, float] = {}  # index -> bound: the key's groups share them
                for g in keys[entry[2]]:
                    plans = groups[g]
                    if admit is not None and kth is None:  # until K plans are ranked, no bound stops the walk
                        if not verdict_of(g):
                            continue
                    for i in range(len(plans)):
                        lower = known.get(i)
                        if lower is None:
                            lower = known[i] = bound(plans[i])
                        heapq.heappush(heap, (lower, 1, g, i))
                continue
            _, _, g, i = entry
            if admit is not None and not verdict_of(g):
                continue
            left -= 1
            self.tick()
            yield g, i, groups[g][i]

    def tick(self, count: int = 1) -> None:
        before = self.result.evaluated
        self.result.evaluated += count
        if self.progress and before // 256 != self.result.evaluated // 256:
            self.progress(self.result.evaluated)


def closest_misses(misses: list[Miss], top_k: int) -> list[Miss]:
    """The `top_k` misses closest to fitting, each plan once: with one rank per shard group
    (`stage_blind`) the ZeRO stages shard nothing, and a miss at several stages is shown at the
    stage it misses by least (`twin_key`'s rule for plans that fit)."""
    shown, seen = [], set()
    for miss in sorted(misses, key=lambda m: (m.short_bytes, m.inputs.zero_stage)):
        key = stage_blind(miss.inputs) or miss.inputs
        if key in seen:
            continue
        seen.add(key)
        shown.append(miss)
    return shown[:top_k]


def twin_key(inputs: EstimateInputs, asked: EstimateInputs, seconds: float, peak: int, host: int) -> tuple | None:
    """With one rank per shard group (`stage_blind`) the ZeRO stages shard nothing: they change
    only how the runtime wraps the model (stage 1: DDP; 2 and 3: fully_shard over one rank),
    so a plan with the same step time at several stages is listed once, at its least peak
    (then host memory, then stage). None where the stage shards something."""
    blind = stage_blind(inputs)
    return None if blind is None else (blind, asked.with_(zero_stage=0, hybrid=False), seconds)


def _stage_preference(item: tuple) -> tuple:
    """Of ZeRO-stage twins the least peak, then host memory, then stage is kept."""
    return item[4], item[5], item[3].zero_stage


def split_twin_key(inputs: EstimateInputs, asked: EstimateInputs, seconds: float, peak: int,
                   host: int) -> tuple | None:
    """Plans that differ only in their layer split and have the same peak, host memory and
    step time are listed once: an uneven split that changes none of the stages that decide
    them (the first stage's memory, the slowest stage's time) is only a key more to write.
    None without a pipeline."""
    if inputs.degrees.pp == 1:
        return None
    return asked.with_(stage_split=(0, 0)), seconds, peak, host


def _split_preference(item: tuple) -> tuple:
    """Of split twins the one with the fewest split keys is kept (the even split has none),
    then the one with the least (first, last)."""
    split = item[3].stage_split
    return sum(1 for layers in split if layers), split


def stage_blind(inputs: EstimateInputs) -> EstimateInputs | None:
    """The plan at stage 0 without hybrid sharding where its ZeRO stage shards nothing (stage 0
    itself; one rank per shard group: dp = cp = 1, or hybrid sharding inside nodes that hold
    one rank of the group, as tp 8 on 8-GPU nodes leaves), else None."""
    nothing = inputs.zero_stage == 0 and not inputs.hybrid or shard_degree(inputs) == 1
    return inputs.with_(zero_stage=0, hybrid=False) if nothing else None


def _keyed(groups: list[Group], bound) -> list[tuple[float, int, int]]:
    """(bound, group, index) of every plan, sorted. Groups with the same key share the bound
    (`search`: it does not read the sharding), computed once on the first one's plan."""
    keyed = []
    known: dict[tuple, float] = {}
    for g, plans in enumerate(groups):
        for i in range(len(plans)):
            if bound is None:
                keyed.append((0.0, g, i))
                continue
            key = (plans.key, i)
            lower = known.get(key)
            if lower is None:
                lower = known[key] = bound(plans[i])
            keyed.append((lower, g, i))
    keyed.sort()
    return keyed


def search(base: EstimateInputs, space: Space, fixed: Fixed, timer: Callable[[EstimateInputs], float],
           top_k: int = 5, progress: Callable[[int], None] | None = None,
           resolve: Callable[[EstimateInputs], EstimateInputs] | None = None,
           bound: Callable[[EstimateInputs], float] | None = None,
           refine: Callable[[EstimateInputs], float] | None = None,
           group_bound: Callable[[Group], float] | None = None) -> SearchResult:
    """The `top_k` fastest plans that fit, best first. `timer` predicts a plan's step seconds;
    `resolve` turns an offload candidate into the plan the offload strategy decides
    (core.memory.estimate_memory's inputs), so its figures are the estimate's.

    `bound` (branch and bound): a lower bound of `timer`, cheap to compute. Candidates are
    taken in increasing order of it, and the walk stops when the bound of the next one exceeds
    the `top_k`-th best time found: no later candidate can enter the ranking, so the result is
    the exhaustive search's (tests/test_plan.py compares them). It must not read the sharding
    (ZeRO stage, hybrid): plans that differ only in it share one value (core/step_time.py's
    bound reads neither). `refine`: a sharper lower bound, dearer, checked before `timer` on
    the plans the walk reaches. `group_bound(group)`: a lower bound of `bound` over a group's
    micro batches (core/step_time.py `step_time_group_bound`), with which the plans' own bounds
    are computed only for the groups the walk reaches (`_Walk.in_bound_order`)."""
    start = time.perf_counter()
    walk = _Walk(base, top_k, timer, progress, refine, torch_sp=space.runnable)
    result = walk.result
    groups = list(candidates(base, space, fixed, result.rejected))
    result.evaluated = sum(result.rejected.values())  # the plans the structure rejected
    admit = walk.admit if base.gpu_memory is not None else None
    for g, i, inputs in walk.in_bound_order(groups, bound, group_bound, admit):
        plans = groups[g]
        if i == len(plans) - 1 and plans.single_last():  # the single-microbatch plan, alone
            fits, peak, host, reason = walk.checked_memory(g, i, inputs)
            if fits:
                walk.rank(inputs, figures=(peak, host))
            else:
                walk.reject(reason)
            continue
        limit = walk.largest_fitting(g, plans, len(plans) - plans.single_last())
        if i > limit:
            walk.reject(walk.checked[(g, i)][3] if (g, i) in walk.checked else SMALLER)
            continue
        known = walk.checked.get((g, i))  # the galloping search's figures, when it checked this one
        walk.rank(inputs, figures=known[1:3] if known is not None else None)
    walk.settle()
    if not walk.best and fixed.offload is None and space.offload and base.strategy != "conservative":
        # Nothing fits as it is: the offload strategy adds the offload the runtime executes,
        # cheapest first, only as far as each plan needs. Offload adds time, so the same bound
        # still holds.
        result.offloaded = True
        groups = list(candidates(base, space, fixed, Counter()))
        walk.fits.clear()
        offloaded: dict[tuple[int, int], tuple] = {}  # (group, index) -> (fits, peak, host, why, plan, asked)

        def with_offload(group: int, index: int, inputs: EstimateInputs) -> tuple:
            """The plan after the strategy's offload and its memory; the same rule of growth
            with the micro batch holds after offload (tests/test_plan.py)."""
            key = (group, index)
            if key not in offloaded:
                if walk.capacity is not None and offload_floor(inputs) > walk.capacity:
                    offloaded[key] = (False, 0, 0, OFFLOAD_FLOOR, inputs, inputs)
                else:
                    asked = _with_offload(inputs, base.strategy)
                    plan = resolve(asked) if resolve is not None else asked
                    refused = unrunnable_offload(plan, space.nf4_offload) if space.runnable else None
                    if refused:
                        offloaded[key] = (False, 0, 0, refused, plan, asked)
                    else:
                        offloaded[key] = (*walk.memory(plan), plan, asked)
            return offloaded[key]

        for g, i, inputs in walk.in_bound_order(groups, bound, group_bound):
            plans = groups[g]
            if not (i == len(plans) - 1 and plans.single_last()):
                limit = walk.largest_fitting(g, plans, len(plans) - plans.single_last(), with_offload)
                if i > limit:
                    walk.reject(offloaded[(g, i)][3] if (g, i) in offloaded else SMALLER)
                    continue
            fits, peak, host, reason, plan, asked = with_offload(g, i, inputs)
            if fits:
                walk.rank(plan, asked, figures=(peak, host))
            else:
                walk.reject(reason)
        walk.settle()
    ranked = sorted(walk.best, reverse=True)
    result.plans = [Found(inputs, peak, host, -neg, asked) for neg, _, _, inputs, peak, host, asked in ranked]
    result.misses = closest_misses(walk.misses, top_k)
    result.seconds = time.perf_counter() - start
    return result
