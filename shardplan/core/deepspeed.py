"""`framework = "deepspeed"`: GPU and host memory as DeepSpeed's code allocates it (v0.19).

Sources, DeepSpeed 0.19.8, the release the `interop` extra installs (deepspeed/runtime/...):

- ZeRO stage 1 and 2, zero/stage_1_and_2.py. Each optimizer parameter group is flattened into
  one 16-bit buffer padded to a multiple of 2*dp elements (`flatten_dense_tensors_aligned`,
  nccl_start_alignment_factor = 2; lines 387-526) that the model's parameters view; the rank's
  1/dp of it gets an fp32 master copy (`single_partition_of_fp32_groups`, line 560) whose Adam
  moments the optimizer keeps. With contiguous gradients (the default) backward copies each
  gradient into an IPG bucket of `reduce_bucket_size` elements (`setup_buckets`, lines
  3256-3280; two buckets with `overlap_comm`), reduces it, and keeps this rank's part in
  `grads_in_partition`, sized by the full numel of every parameter that overlaps the
  partition (`copy_grads_in_partition`, lines 2142-2203). The buckets are released at the
  end of every backward (`_release_ipg_buffers`, lines 924-932). Stage 1 without overlap_comm
  keeps every parameter's full gradient until the accumulation boundary (`process_gradients`
  reduces only under partition_gradients or overlap_comm). The step flattens the partition's
  gradients and casts them to fp32 (`step`, lines 3108-3119).
- ZeRO-Offload (stage 1/2 with offload_optimizer): the fp32 master partition, a 16-bit staging
  copy of it (lines 560-575) and the fp32 gradient partition (`initialize_optimizer_states`,
  lines 934-942) live in host memory, pinned when `pin_memory`; DeepSpeedCPUAdam's moments in
  plain host memory; one gradient-sized staging buffer of the largest parameter on each side
  (`temp_grad_buffer_for_cpu_offload` / `_for_gpu_offload`, lines 653-661); with gradient
  accumulation at stage 2 one pinned 16-bit buffer per parameter of the partition (lines 1822-1826).
- ZeRO stage 3, zero/stage3.py and zero/partitioned_param_coordinator.py: each parameter is
  partitioned to ceil(numel/dp) elements, except those under
  `stage3_param_persistence_threshold`, which stay whole; the gradient partitions live in one
  flat buffer allocated at start (lines 786-801; pinned on the host with offload_optimizer);
  one IPG bucket of `reduce_bucket_size` (lines 780-784); each optimizer parameter group is
  cut into sub-groups of about `sub_group_size` elements (1e9 by default, zero/config.py line
  182; `_create_fp16_sub_groups`, lines 1210-1233), and the step casts one sub-group of
  gradients to fp32 at a time (`_prepare_fp32_grad_for_sub_group`, lines 2683-2694); ZeRO-1/2
  never read `sub_group_size` (runtime/engine.py line 2775 hands it to stage 3 alone). A
  module's parameters are gathered whole when it runs (`fetch_sub_module`, lines 310-491):
  `stage3_max_live_parameters` only bounds the prefetch, which fetches up to
  `stage3_prefetch_bucket_size` more elements of whole parameters at every module's call
  while fewer than `stage3_max_live_parameters` are available (lines 451-481), so what is in
  flight piles up to the latter.
- Stage 0 with 16-bit training, runtime/fp16/fused_optimizer.py (FP16_Optimizer, used for fp16
  and, as DDP_BFLOAT16, for bf16 at pp 1; engine.py lines 2294-2326, 2555-2631): a flat 16-bit copy the
  parameters view, an fp32 master copy and its Adam moments; the step casts every gradient to
  fp32 and concatenates them (lines 283-296), two fp32 copies at once.
- Stage 0 with bf16 and pipeline parallelism, and stage 1 with bf16 and fp32 gradient
  accumulation, runtime/bf16_optimizer.py (BF16_Optimizer: `_do_optimizer_sanity_check`, engine.py
  lines 2294-2323, takes it without ZeRO when the model dtype bf16 equals grad_accum_dtype, which
  defaults to it, lines 1806-1807, under a PipelineModule; at stage 1 when grad_accum_dtype is
  fp32 and the optimizer is not offloaded, pipeline or not). Per group,
  a flat bf16 copy padded to 2*dp that the parameters view (`bf16_groups_flat`, lines 165-171),
  an fp32 partition of 1/dp of it that the optimizer steps (`fp32_groups_flat_partition`, lines
  181-183, 225), so its moments are 1/dp too, and a gradient-accumulation buffer of the whole
  flat size in grad_acc_dtype, bf16 or fp32 (`fp32_groups_gradients_flat`, line 191), allocated at
  start. Each backward adds the parameters' own bf16 gradients into it (`update_hp_grads`, lines
  508-539; pipe/engine.py lines 838-862; engine.py `_backward_epilogue`, lines 3153-3161), and the
  step's `zero_grad` frees them (lines 625-627, engine.py line 3526). The engine all-reduces the
  buffers (`_bf16_reduce_grads`, pipe/engine.py line 297; `allreduce_gradients`, engine.py line
  3095), the step casts this rank's part of a bf16 buffer to fp32 (`grad_partition.to`, lines
  414-418; an fp32 one is used as it is) and drops the casts after it (lines 424-426), and the
  updated bf16 partitions are all-gathered in place (`all_gather_into_tensor_dp_groups`,
  runtime/utils.py lines 1008-1016).

Pinned host memory comes from torch's caching host allocator, which rounds every allocation up
to the next power of two (torch 2.13, ATen/core/CachingHostAllocator.h, `allocate`: "Round up
the allocation to the nearest power of two"; the threshold defaults to no limit).

Optimizer parameter groups follow the weight-decay split that Megatron-LM
(`get_params_for_weight_decay_optimization`) and transformers' Trainer both make: matrices in
one group, biases and norm weights in another; each group is a flat buffer of its own.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from typing import TYPE_CHECKING

from .precision import FP32, HALF
from .stages import LocalParam, RankParams
from .terms import Term
from .timeline import BACKWARD, BACKWARD_END, FORWARD, LOSS, STEP

if TYPE_CHECKING:
    from .estimate_inputs import EstimateInputs

ALIGNMENT_FACTOR = 2  # nccl_start_alignment_factor (stage_1_and_2.py): flat buffers pad to 2*dp
BACKWARD_MOMENTS = (LOSS, BACKWARD)


def pinned_bytes(size: int) -> int:
    """Bytes torch's caching host allocator reserves for a pinned allocation of `size` bytes:
    the next power of two (CachingHostAllocator.h, `allocate`)."""
    return 1 << (size - 1).bit_length() if size > 1 else size


@dataclass(frozen=True)
class DeepSpeedPlan:
    """The narrow inputs of one rank under DeepSpeed."""

    stage: int
    degree: int  # ranks in the data-parallel (ZeRO) group
    index: int  # this rank's place in it
    precision: str
    optimizer: str
    offload_optimizer: bool = False
    offload_params: bool = False  # stage 3 only (ZeRO-Infinity)
    pin: bool = True  # pin_memory, on a machine with an accelerator
    reduce_bucket_size: int = 500_000_000
    prefetch_bucket_size: int = 50_000_000
    max_live_parameters: int = 1_000_000_000
    persistence_threshold: int = 100_000
    sub_group_size: int = 1_000_000_000  # zero/config.py line 182 (stage 3 only)
    overlap_comm: bool | None = None  # None: DeepSpeed's default, true at stage 3 only
    accumulating: bool = False  # gradient accumulation or pipeline microbatches
    pipeline: bool = False  # pp > 1: the model is a PipelineModule (engine.py line 582)
    grad_accum_dtype: str | None = None  # data_types.grad_accum_dtype; None: the model's dtype

    @property
    def overlap(self) -> bool:
        """overlap_comm as DeepSpeed runs it: its default is on at stage 3 only, and the pipeline
        engine turns it off at stages 0-2 (engine.py lines 2663-2666)."""
        return deepspeed_overlap(self.stage, self.overlap_comm, self.pipeline)

    @property
    def bf16_optimizer(self) -> bool:
        """DeepSpeed steps with BF16_Optimizer (`uses_bf16_optimizer`)."""
        return uses_bf16_optimizer(self.stage, self.precision, self.pipeline, self.grad_accum_dtype,
                                   self.offload_optimizer)

    @property
    def grad_accum_bytes(self) -> int:
        """Bytes per element of BF16_Optimizer's gradient-accumulation buffer: grad_accum_dtype,
        the model's dtype by default (engine.py lines 1806-1807)."""
        return accumulation_bytes(self.precision, self.grad_accum_dtype)

    @property
    def model_bytes(self) -> int:
        """The model's dtype: 16-bit under mixed precision (pure bf16 runs as bf16 mixed
        precision), fp32 otherwise."""
        return FP32 if self.precision == "fp32" else HALF

    @property
    def master(self) -> bool:
        """An fp32 master copy exists: 16-bit training, and ZeRO 1/2 even in fp32 (its
        `single_partition_of_fp32_groups` is a clone of the partition, line 560)."""
        return self.precision != "fp32" or self.stage in (1, 2)

    @property
    def moments(self) -> int:
        """Bytes of optimizer moments per master element: Adam's two fp32 ones (8), two 8-bit
        ones for adamw8bit (2: Dettmers et al. 2022; DeepSpeed steps a client 8-bit optimizer,
        whose block scales, under 2% at block size 256, are left out here), SGD none."""
        return {"adamw": 2 * FP32, "adamw8bit": 2}.get(self.optimizer, 0)


def deepspeed_overlap(stage: int, overlap_comm: bool | None, pipeline: bool) -> bool:
    """See `DeepSpeedPlan.overlap`."""
    if pipeline and stage <= 2:
        return False
    return stage == 3 if overlap_comm is None else overlap_comm


def model_dtype(precision: str) -> str:
    """DeepSpeed's model dtype (engine.py `get_data_types`, lines 1799-1804): fp16 when fp16 is
    enabled, bf16 when bf16 is (pure bf16 runs as bf16 mixed precision), else fp32."""
    return {"fp16-mixed": "fp16", "bf16-mixed": "bf16", "bf16": "bf16"}.get(precision, "fp32")


def accumulation_dtype(precision: str, grad_accum_dtype: str | None) -> str:
    """The dtype DeepSpeed accumulates gradients in: data_types.grad_accum_dtype, the model's
    dtype when not given (engine.py lines 1806-1809)."""
    return grad_accum_dtype or model_dtype(precision)


def accumulation_bytes(precision: str, grad_accum_dtype: str | None) -> int:
    """Bytes per element of BF16_Optimizer's accumulation buffer (`accumulation_dtype`)."""
    return FP32 if accumulation_dtype(precision, grad_accum_dtype) == "fp32" else HALF


def grad_accum_refused(stage: int, precision: str, grad_accum_dtype: str | None) -> bool:
    """DeepSpeed raises NotImplementedError("unsupported mix of model_dtype and grad_accum_dtype")
    without ZeRO when the two differ (`_do_optimizer_sanity_check`, engine.py lines 2313-2323)."""
    return stage == 0 and accumulation_dtype(precision, grad_accum_dtype) != model_dtype(precision)


def uses_bf16_optimizer(stage: int, precision: str, pipeline: bool, grad_accum_dtype: str | None = None,
                        offload_optimizer: bool = False) -> bool:
    """DeepSpeed steps with BF16_Optimizer (`_do_optimizer_sanity_check`, engine.py lines
    2294-2323): at ZeRO stage 1 with a bf16 model, gradients accumulated in fp32 and no
    offload_optimizer (lines 2305-2310); without ZeRO with a bf16 model under a PipelineModule,
    gradients accumulated in bf16 (lines 2313-2320; the default, grad_accum_dtype being the model
    dtype, lines 1806-1807). Pure bf16 runs as bf16 mixed precision."""
    if model_dtype(precision) != "bf16":
        return False
    accumulated = accumulation_dtype(precision, grad_accum_dtype)
    if stage == 1:
        return accumulated == "fp32" and not offload_optimizer
    return stage == 0 and pipeline and accumulated == "bf16"


def steps_with_bf16_optimizer(inputs: EstimateInputs) -> bool:
    """`uses_bf16_optimizer` of an estimate's plan under `framework = "deepspeed"`."""
    return inputs.framework == "deepspeed" and uses_bf16_optimizer(
        inputs.zero_stage, inputs.precision, inputs.degrees.pp > 1, inputs.grad_accum_dtype, inputs.offload_optimizer)


@dataclass
class DeepSpeedMemory:
    """One rank's memory under DeepSpeed: persistent GPU and host terms by kind, the GPU
    buffers of each moment, gradients alive at each moment, and the host's own terms."""

    gpu: dict[str, list[Term]]  # params, grads, optimizer held through the step
    cpu: dict[str, list[Term]]  # the same kinds in host memory (exact bytes)
    grads_at: dict[str, list[Term]]  # GPU gradient terms alive at each moment
    buffers_at: dict[str, list[Term]]  # GPU buffers of each moment
    host: list[Term]  # host memory as allocated (pinned rounding, staging buffers)


def ordered_params(rp: RankParams) -> list[LocalParam]:
    """The rank's parameters in module order: embeddings, the layers, final norm and head."""
    first = [p for p in rp.root if p.info.part in ("embedding", "position")]
    last = [p for p in rp.root if p.info.part not in ("embedding", "position")]
    return first + list(rp.layer) * rp.num_layers + last


def decays(p: LocalParam) -> bool:
    """A matrix, which takes weight decay; biases and norm weights (vectors) do not."""
    return len(p.shape) >= 2


def weight_decay_groups(params: list[LocalParam]) -> list[list[LocalParam]]:
    """Matrices (weight decay) and vectors (biases, norms: no decay), each in module order."""
    groups = [[p for p in params if decays(p)], [p for p in params if not decays(p)]]
    return [g for g in groups if g]


@dataclass(frozen=True)
class FlatGroup:
    """One flattened parameter group under ZeRO 1/2 on this rank."""

    numel: int  # real elements
    padded: int  # the flat buffer, padded to a multiple of 2*dp
    partition: int  # this rank's part of it
    in_partition: int  # full numel of every parameter overlapping this rank's part
    largest: int  # the group's largest parameter


@lru_cache(maxsize=1024)
def flat_groups(rp: RankParams, degree: int, index: int) -> tuple[FlatGroup, ...]:
    groups = []
    for group in weight_decay_groups(ordered_params(rp)):
        numel = sum(p.numel for p in group)
        align = ALIGNMENT_FACTOR * degree
        padded = -(-numel // align) * align
        partition = padded // degree
        start, end = index * partition, (index + 1) * partition
        offset = overlapping = 0
        for p in group:
            if offset < end and offset + p.numel > start:
                overlapping += p.numel
            offset += p.numel
        groups.append(FlatGroup(numel, padded, partition, overlapping, max(p.numel for p in group)))
    return tuple(groups)


@lru_cache(maxsize=1024)
def fullest_flat_index(rp: RankParams, degree: int) -> int:
    """The rank of a ZeRO-1/2 group whose `grads_in_partition` is largest: it holds the full
    numel of every parameter overlapping its part of each flat group (`flat_groups`), so a
    rank whose part cuts into a large tensor holds more than rank 0 (ties: the lowest rank).
    One pass over the tensors with a difference array over the ranks."""
    if degree <= 1:
        return 0
    held = [0] * (degree + 1)
    for group, flat in zip(weight_decay_groups(ordered_params(rp)), flat_groups(rp, degree, 0)):
        partition, offset = flat.partition, 0
        for p in group:
            if p.numel:
                first, last = offset // partition, min((offset + p.numel - 1) // partition, degree - 1)
                held[first] += p.numel
                held[last + 1] -= p.numel
            offset += p.numel
    best, running, most = 0, 0, -1
    for index in range(degree):
        running += held[index]
        if running > most:
            best, most = index, running
    return best


ENGINE_ALLREDUCE_SIZE = 500_000_000  # engine.py line 151, MEMORY_OPT_ALLREDUCE_SIZE: stage 0's chunk


def _bucketed(sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `sizes` as DeepSpeed fills an IPG bucket: a gradient that would take the
    bucket past `limit` elements first reduces what it holds (stage_1_and_2.py line 1422,
    stage3.py line 1583), so a tensor larger than the bucket is reduced alone."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, size in enumerate(sizes):
        if held + size > limit and current:
            buckets.append(current)
            current, held = [], 0
        current.append(index)
        held += size
    return buckets + ([current] if current else [])


@lru_cache(maxsize=1024)
def reduction_copy(rp: RankParams, stage: int, degree: int, limit: int, in_backward: bool) -> int:
    """Elements of the largest copy that reducing one bucket of gradients makes (0: none).

    - Stage 1/2: `average_tensor` cuts the bucket into one slice per destination rank, merging
      neighbours bound for the same rank (stage_1_and_2.py lines 1635-1685), and with
      `use_multi_rank_bucket_allreduce` (default true, zero/config.py line 119; line 1695)
      hands every slice to one `allreduce_bucket`, whose `flatten` (line 2367) copies them into a new
      tensor unless there is only one, which it views. A bucket whose gradients all belong to
      one rank's partition costs nothing; one that crosses a partition boundary is copied
      whole. Hooks reduce in backward order; stage 1 without overlap_comm reduces after
      backward, group by group in module order (`reduce_gradients`, lines 958-978).
    - Stage 3: `reduce_scatter_coalesced` concatenates every gradient of the bucket, each
      padded to a multiple of dp (comm/coalesced_collectives.py lines 102-122), unless the
      bucket is one tensor that needs no padding.
    - Stage 0: the engine all-reduces the gradients in module order, `allreduce_no_retain`
      taking them until they pass 5e8 elements and flattening each such list of two or more
      (engine.py lines 3796, 3828-3838).
    Backward order here is the reverse of module order, autograd's up to the order inside a
    layer (a tied embedding's gradient is complete, and hooked, last); where that inner order
    decides which bucket is copied (stage 1/2 in backward), the largest bucket of two or more
    gradients is taken.
    Measured on real DeepSpeed 0.19.8 by tests/test_deepspeed_real.py."""
    params = ordered_params(rp)
    sizes = [p.numel for p in params]
    if stage == 0:
        return _allreduce_copy(sizes)
    if stage == 3:
        order = sizes[::-1]
        largest = 0
        for bucket in _bucketed(order, limit):
            if len(bucket) > 1 or order[bucket[0]] % degree:
                largest = max(largest, sum(-(-order[i] // degree) * degree for i in bucket))
        return largest
    # Stage 1/2: the ranks each tensor's elements belong to, from its offset in its group.
    matrix = [decays(p) for p in params]
    partitions = {decays(group[0]): flat.partition
                  for group, flat in zip(weight_decay_groups(params), flat_groups(rp, degree, 0))}
    offsets = {True: 0, False: 0}
    ranks = []
    for size, flag in zip(sizes, matrix):
        part, start = partitions[flag], offsets[flag]
        ranks.append((start // part, (start + size - 1) // part) if size else None)
        offsets[flag] += size
    if in_backward:
        order = list(range(len(params)))[::-1]
    else:
        order = [i for flag in (True, False) for i in range(len(params)) if matrix[i] == flag]
    copied, largest = 0, 0
    for bucket in _bucketed([sizes[i] for i in order], limit):
        slices, last = 0, None
        for position in bucket:
            span = ranks[order[position]]
            if span is None:
                continue
            slices += (span[1] - span[0]) + (span[0] != last)
            last = span[1]
        held = sum(sizes[order[position]] for position in bucket)
        if len(bucket) > 1:
            largest = max(largest, held)
        if slices > 1:
            copied = max(copied, held)
    # In backward, which bucket of several gradients crosses a boundary depends on the order
    # autograd finishes them inside a layer: the largest such bucket stands for it.
    return max(copied, largest) if copied and in_backward else copied


def _tied_embedding(rp: RankParams) -> int:
    """Elements of a token embedding that this rank also uses as its output head (0 if none)."""
    if not rp.has_head or any(p.info.part == "head" for p in rp.root):
        return 0
    return sum(p.numel for p in rp.root if p.info.part == "embedding")


def _head(rp: RankParams) -> int:
    """Elements of this rank's own output head (0 if none, or tied to the embedding)."""
    return sum(p.numel for p in rp.root if p.info.part == "head") if rp.has_head else 0


def _held_head_gradient(rp: RankParams, model: int, every_gradient_held: bool = False) -> dict[str, Term]:
    """The output head's gradient before DeepSpeed's hook takes it, by moment. Autograd
    computes it whole into `param.grad`; the hook then copies it into the IPG bucket (stage 1/2,
    stage_1_and_2.py lines 1455-1461) or reduces it from there (a tensor larger than the bucket,
    line 1449; stage 3, `__add_grad_to_ipg_bucket`): it is alive in `loss`. A tied embedding's
    hook runs only once autograd has summed both uses' gradients, at the embedding's backward
    at the end: the head's share waits in autograd's input buffer through backward.
    `every_gradient_held` (stage 1 until the boundary): an untied head's gradient is counted
    among them; a tied one's share is still a tensor of its own."""
    tied = _tied_embedding(rp)
    if tied:
        held = _term("tied embedding gradient (held until the embedding's backward)", tied, model,
                     "the head's share, in autograd's input buffer")
        return {LOSS: held, BACKWARD: held}
    if (head := _head(rp)) and not every_gradient_held:
        return {LOSS: _term("output head's gradient (before its hook takes it)", head, model,
                            "computed whole into param.grad")}
    return {}


def _module_of(name: str) -> str:
    """The module owning a parameter; a mixture-of-experts layer's experts are one module,
    as transformers' fused expert modules hold every expert's projections."""
    if ".experts." in name:
        return name.split(".experts.")[0] + ".experts"
    return name.rsplit(".", 1)[0]


@lru_cache(maxsize=1024)
def largest_modules(rp: RankParams) -> tuple[int, int, int]:
    """(largest module of a layer, largest root module (embedding / head), their max), in
    elements: what ZeRO-3 gathers whole when that module runs."""
    def largest(params: tuple[LocalParam, ...]) -> int:
        modules: dict[str, int] = {}
        for p in params:
            key = _module_of(p.info.name)
            modules[key] = modules.get(key, 0) + p.numel
        return max(modules.values(), default=0)

    layer = largest(rp.layer) if rp.num_layers else 0
    root = largest(rp.root)
    return layer, root, max(layer, root)


def _term(label: str, elements: int, unit: int, why: str) -> Term:
    return Term(label, elements * unit, lambda: f"{why} = {elements:,} elements * {unit} B")


def _pinned(label: str, size: int, pin: bool, why: str) -> Term:
    if not pin:
        return Term(label, size, why)
    held = pinned_bytes(size)
    return Term(f"{label} (pinned)", held,
                lambda: f"{why}: {size:,} B rounded up to a power of two = {held:,} B")


def _stage12(rp: RankParams, plan: DeepSpeedPlan) -> DeepSpeedMemory:
    groups = flat_groups(rp, plan.degree, plan.index)
    model = plan.model_bytes
    gpu: dict[str, list[Term]] = {"params": [], "grads": [], "optimizer": []}
    cpu: dict[str, list[Term]] = {"params": [], "grads": [], "optimizer": []}
    host: list[Term] = []
    padded = sum(g.padded for g in groups)
    partition = sum(g.partition for g in groups)
    numel = sum(g.numel for g in groups)
    in_partition = sum(g.in_partition for g in groups)
    gpu["params"].append(_term("flat 16-bit parameters" if model == HALF else "flat parameters", padded, model,
                               f"{len(groups)} groups padded to 2*dp"))
    optimizer = [_term("fp32 master partition", partition, FP32, f"1/{plan.degree} of the flat buffer")] if plan.master else []
    if plan.moments:
        optimizer.append(_term("Adam moments", partition, plan.moments, f"{plan.moments} B of moments per element of the partition"))
    grads_at: dict[str, list[Term]] = {m: [] for m in (FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP)}
    buffers_at: dict[str, list[Term]] = {m: [] for m in grads_at}
    buckets = 2 if plan.overlap else 1
    bucket = _term(f"IPG bucket{'s' if buckets > 1 else ''} (reduce_bucket_size)", buckets * plan.reduce_bucket_size,
                   model, f"{buckets} * {plan.reduce_bucket_size:,}")
    for moment in BACKWARD_MOMENTS:
        buffers_at[moment].append(bucket)
    # Stage 2, and stage 1 with overlap_comm, reduce in backward's hooks; stage 1 without it
    # after backward (`reduce_gradients`), with the bucket still allocated (released by the
    # epilogue, line 1061).
    in_backward = plan.stage == 2 or plan.overlap
    copy = reduction_copy(rp, plan.stage, plan.degree, plan.reduce_bucket_size, in_backward)
    if not in_backward:
        buffers_at[BACKWARD_END].append(bucket)
    if copy:
        buffers_at[BACKWARD if in_backward else BACKWARD_END].append(_term(
            "flattened bucket being all-reduced (allreduce_bucket)", copy, model,
            "a bucket crossing a partition boundary, copied by flatten"))
    largest = max(g.largest for g in groups)
    # Stage 1 reduces only at the accumulation boundary (`reduce_ready_partitions_and_remove_grads`,
    # line 2294: `partition_gradients or is_gradient_accumulation_boundary()`), and without
    # overlap_comm not during backward at all (`process_gradients`, line 2290): every gradient
    # is held whole until then.
    full_until_boundary = plan.stage == 1 and (not plan.overlap or plan.accumulating)
    full = _term("gradients of every parameter (stage 1: reduced at the boundary)", numel, model, "all local gradients")
    for moment, term in _held_head_gradient(rp, model, full_until_boundary).items():
        buffers_at[moment].append(term)
    if plan.offload_optimizer:
        cpu["optimizer"] = optimizer
        cpu["grads"].append(_term("fp32 gradient partition", partition, FP32, "single_partition_of_fp32_groups[i].grad"))
        for g in groups:
            host.append(_pinned("fp32 master partition", g.partition * FP32, plan.pin, f"group of {g.numel:,}"))
            host.append(_pinned("16-bit staging copy of the partition", g.partition * model, plan.pin,
                                f"group of {g.numel:,}"))
            host.append(_pinned("fp32 gradient partition", g.partition * FP32, plan.pin, f"group of {g.numel:,}"))
        if plan.moments:
            host.append(_term("Adam moments (DeepSpeedCPUAdam)", partition, plan.moments, "partition"))
        host.append(_pinned("gradient staging buffer (largest parameter)", largest * model, plan.pin,
                            "temp_grad_buffer_for_cpu_offload"))
        staging = _term("gradient staging buffer (largest parameter)", largest, model, "temp_grad_buffer_for_gpu_offload")
        for moment in grads_at:
            buffers_at[moment].append(staging)
        if full_until_boundary:
            # Stage 1 copies gradients to the host only when it reduces them, at the boundary
            # (copy_grads_in_partition, lines 2164-2176): until then every parameter's 16-bit
            # gradient stays on the GPU, as without offload.
            for moment in (LOSS, BACKWARD, BACKWARD_END) + ((FORWARD,) if plan.accumulating else ()):
                grads_at[moment].append(full)
        if plan.accumulating and plan.stage == 2:
            # One pinned buffer per parameter of the partition, each rounded on its own; the
            # parameters overlapping the partition bound them. Created only when a microbatch
            # before the boundary reduces (`micro_step_id > 0 or not boundary`, line 2166):
            # stage 1 reduces at the boundary alone, where micro_step_id is still 0.
            host.append(Term("accumulated gradients (one pinned buffer per parameter)",
                             _per_param_pinned(rp, plan, groups, model),
                             "accumulated_grads_in_cpu: each parameter in the partition, 16-bit, rounded"))
        return DeepSpeedMemory(gpu, cpu, grads_at, buffers_at, host)
    gpu["optimizer"] = optimizer
    # Gradients: the partition's part (stage 2, or stage 1 with overlap_comm at the boundary),
    # or every full gradient until the boundary (stage 1).
    held = _term("gradients overlapping the partition (grads_in_partition)", in_partition, model,
                 "full numel of the parameters in this rank's part")
    during = full if full_until_boundary else held
    gpu["grads"].append(during)
    for moment in (LOSS, BACKWARD, BACKWARD_END):
        grads_at[moment].append(during)
    if plan.accumulating:
        grads_at[FORWARD].append(during)
        if not full_until_boundary:
            # The epilogue keeps the accumulated gradients (`all_grad_tensors`, views of the
            # last grads_in_partition, lines 1036-1045) and drops its own reference
            # (`_release_ipg_buffers`, line 930): the next backward allocates a new one
            # (line 2192) and adds it in at its epilogue. Two copies during backward.
            second = _term("this microbatch's grads_in_partition (accumulating)", in_partition, model,
                           "a new buffer beside the accumulated one")
            for moment in (BACKWARD, BACKWARD_END):
                grads_at[moment].append(second)
    grads_at[STEP].append(held)
    buffers_at[STEP].append(_term("flattened gradient partition", partition, model, "flatten(averaged_gradients)"))
    buffers_at[STEP].append(_term("fp32 gradient partition", partition, FP32, "single_grad_partition"))
    return DeepSpeedMemory(gpu, cpu, grads_at, buffers_at, host)


def _per_param_pinned(rp: RankParams, plan: DeepSpeedPlan, groups: tuple[FlatGroup, ...], model: int) -> int:
    total = 0
    for group, flat in zip(weight_decay_groups(ordered_params(rp)), groups):
        start, end = plan.index * flat.partition, (plan.index + 1) * flat.partition
        offset = 0
        for p in group:
            if offset < end and offset + p.numel > start:
                total += pinned_bytes(p.numel * model) if plan.pin else p.numel * model
            offset += p.numel
    return total


def persists(numel: int, threshold: int) -> bool:
    """Stage 3 keeps a parameter of at most `threshold` elements whole after its first gather,
    besides its partition: `ds_persist` (zero/partition_parameters.py line 1292,
    `param.ds_numel <= Init.param_persistence_threshold`; zero/parameter_offload.py
    `mark_persistent_parameters`), frozen ones too. The coordinator never releases it
    (partitioned_param_coordinator.py lines 565 and 640). `stage3_model_persistence_threshold` (default
    sys.maxsize, no cap) is not modelled."""
    return numel <= threshold


def _stage3(rp: RankParams, plan: DeepSpeedPlan) -> DeepSpeedMemory:
    model = plan.model_bytes
    params = ordered_params(rp)
    persistent = [p for p in params if persists(p.numel, plan.persistence_threshold)]
    groups = [[-(-p.numel // plan.degree) for p in group] for group in weight_decay_groups(params)]
    partition = sum(map(sum, groups))
    whole = sum(p.numel for p in persistent)
    gpu: dict[str, list[Term]] = {"params": [], "grads": [], "optimizer": []}
    cpu: dict[str, list[Term]] = {"params": [], "grads": [], "optimizer": []}
    host: list[Term] = []
    moments = (FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP)
    grads_at: dict[str, list[Term]] = {m: [] for m in moments}
    buffers_at: dict[str, list[Term]] = {m: [] for m in moments}
    parts = _term("16-bit parameter partitions", partition, model, f"each parameter padded to a multiple of {plan.degree}, / dp")
    (cpu if plan.offload_params else gpu)["params"].append(parts)
    if whole:
        gpu["params"].append(_term("persistent parameters (at most stage3_param_persistence_threshold elements)", whole, model,
                                   f"{len(persistent)} small tensors kept whole"))
    grad_parts = _term("gradient partitions (grad_partitions_flat_buffer)", partition, model, "one flat buffer")
    place = cpu if plan.offload_optimizer else gpu
    place["grads"].append(grad_parts)
    if not plan.offload_optimizer:
        for moment in moments:
            grads_at[moment].append(grad_parts)
    optimizer = []
    if plan.master:
        optimizer.append(_term("fp32 master partition", partition, FP32, "fp32_partitioned_groups_flat"))
    if plan.moments:
        optimizer.append(_term("Adam moments", partition, plan.moments, f"{plan.moments} B of moments per element"))
    place["optimizer"] = optimizer
    sub_groups = [size for group in groups for size in sub_groups_of(group, plan.sub_group_size)]
    if plan.offload_optimizer:
        host.append(_pinned("gradient partitions", partition * model, plan.pin, "grad_partitions_flat_buffer"))
        if plan.master:
            # A plain clone on the host (`converted.clone().detach()`, stage3.py lines 1157-1160):
            # not pinned.
            host.append(_term("fp32 master partition", partition, FP32, "fp32_partitioned_groups_flat, unpinned"))
        for size in sub_groups:  # pinned when pin_memory (lines 1337-1340)
            host.append(_pinned("fp32 gradient sub-group", size * FP32, plan.pin, f"sub-group of {size:,}"))
        if plan.moments:
            host.append(_term("Adam moments (DeepSpeedCPUAdam)", partition, plan.moments, "partition"))
    else:
        largest = max(sub_groups, default=0)
        buffers_at[STEP].append(_term("fp32 gradients of one sub-group", largest, FP32 + model,
                                      "flatten (16-bit) then cast (fp32), the largest sub-group"))
    if plan.offload_params:
        # One buffer per optimizer parameter group, pinned whatever pin_memory says
        # (`_create_param_groups_fp16_flat_cpu_memory`, stage3.py lines 888-911).
        for group in groups:
            host.append(_pinned("16-bit parameter partitions", sum(group) * model, True,
                                f"param_groups_fp16_flat_cpu_memory, a group of {len(group):,} tensors"))
    bucket = _term("IPG bucket (reduce_bucket_size)", plan.reduce_bucket_size, model, "allocated at start")
    layer_module, root_module, _ = largest_modules(rp)
    # Each fetch_sub_module call prefetches up to min(max_live - available, prefetch_bucket)
    # more whole parameters (partitioned_param_coordinator.py lines 452-467), and every module
    # makes a call: what is in flight piles up to stage3_max_live_parameters, of the
    # parameters that are not already whole (persistent ones are). No prefetch at bucket 0.
    gatherable = sum(p.numel for p in params if not persists(p.numel, plan.persistence_threshold))
    prefetch = min(plan.max_live_parameters, gatherable) if plan.prefetch_bucket_size else 0
    for moment in moments:
        buffers_at[moment].append(bucket)
    for moment, module, what in ((FORWARD, max(layer_module, root_module), "the largest module"),
                                 (LOSS, root_module or layer_module, "the output head"),
                                 (BACKWARD, layer_module or root_module, "a layer's largest module")):
        if module:
            buffers_at[moment].append(_term(f"gathered module ({what}, whole)", module, model,
                                            "fetch_sub_module gathers every parameter of the running module"))
        if prefetch:
            buffers_at[moment].append(_term("prefetched parameters", prefetch, model,
                                            "in flight up to min(stage3_max_live_parameters, the rank's "
                                            "non-persistent parameters)"))
    if module := (layer_module or root_module):
        buffers_at[BACKWARD].append(_term("the gathered module's 16-bit gradients", module, model,
                                          "produced whole, then reduce-scattered"))
    for moment, term in _held_head_gradient(rp, model).items():
        buffers_at[moment].append(term)
    if copy := reduction_copy(rp, 3, plan.degree, plan.reduce_bucket_size, True):
        buffers_at[BACKWARD].append(_term("padded bucket being reduce-scattered (reduce_scatter_coalesced)", copy, model,
                                          "torch.cat of the largest bucket's gradients, each padded to dp"))
    return DeepSpeedMemory(gpu, cpu, grads_at, buffers_at, host)


def sub_groups_of(partitions: list[int], sub_group_size: int) -> list[int]:
    """Stage 3's optimizer sub-groups of one parameter group, in elements, given its tensors'
    partitions in order: the whole group when it is at most `sub_group_size`, else cut after
    the tensor that takes a sub-group to `sub_group_size` or past it, so a sub-group can exceed
    it by up to one tensor and 0 makes every tensor its own (`_create_fp16_sub_groups`,
    stage3.py lines 1210-1233: `sub_group_size >= params_group_numel`, then
    `local_sub_group_size >= sub_group_size`)."""
    if sum(partitions) <= sub_group_size:
        return [sum(partitions)] if partitions else []
    out, current = [], 0
    for size in partitions:
        current += size
        if current >= sub_group_size:
            out.append(current)
            current = 0
    return out + ([current] if current else [])


def stage3_sub_groups(rp: RankParams, degree: int, sub_group_size: int) -> list[int]:
    """The rank's stage-3 sub-groups, in elements: each weight-decay group's partitions
    (ceil(numel / degree) per tensor) cut by `sub_groups_of`. One fp32 master tensor each
    (`fp32_partitioned_groups_flat`, stage3.py lines 1110-1176)."""
    return [size for group in weight_decay_groups(ordered_params(rp))
            for size in sub_groups_of([-(-p.numel // degree) for p in group], sub_group_size)]


def _bf16_optimizer(rp: RankParams, plan: DeepSpeedPlan) -> DeepSpeedMemory:
    """BF16_Optimizer: stage 0 with bf16 under a PipelineModule, or stage 1 with bf16 and fp32
    gradient accumulation; runtime/bf16_optimizer.py (module docstring)."""
    groups = flat_groups(rp, plan.degree, plan.index)
    model = plan.model_bytes
    padded = sum(g.padded for g in groups)
    partition = sum(g.partition for g in groups)
    moments = (FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP)
    grads_at: dict[str, list[Term]] = {m: [] for m in moments}
    buffers_at: dict[str, list[Term]] = {m: [] for m in moments}
    # bf16_optimizer.py lines 165-171: each group flattened, padded to
    # nccl_start_alignment_factor (2) * dp, the parameters made views of it.
    gpu = {"params": [_term("flat bf16 parameters (bf16_groups_flat)", padded, model,
                            f"{len(groups)} groups padded to 2*dp")], "grads": [], "optimizer": []}
    # Lines 181-183: this rank's 1/dp of the flat copy, cloned to fp32; line 225 makes it the
    # optimizer's only parameter, so torch's Adam keeps its moments at that size.
    gpu["optimizer"].append(_term("fp32 master partition (fp32_groups_flat_partition)", partition, FP32,
                                  f"1/{plan.degree} of the flat buffer"))
    if plan.moments:
        gpu["optimizer"].append(_term("Adam moments", partition, plan.moments,
                                      f"{plan.moments} B of moments per element of the partition"))
    # Line 191: `torch.zeros_like(bf16_groups_flat[i], dtype=grad_acc_dtype)`, the whole flat
    # size, allocated at start and only zeroed after each step (`clear_hp_grads`, lines 605-610).
    # grad_acc_dtype is data_types.grad_accum_dtype, the model dtype by default (engine.py lines
    # 1806-1809): bf16, 2 B; fp32, 4 B, at stage 1.
    acc = plan.grad_accum_bytes
    accumulation = _term(f"gradient accumulation buffer (fp32_groups_gradients_flat, {'fp32' if acc == FP32 else 'bf16'})",
                         padded, acc, "the whole flat size, in grad_acc_dtype")
    gpu["grads"].append(accumulation)
    for moment in moments:
        grads_at[moment].append(accumulation)
    # The parameters' own bf16 gradients (`param.grad`): immediate_grad_update is false by
    # default (precision_config.py line 51), so no hook frees them; each backward adds them into
    # the buffer after it ends (`update_hp_grads(clear_lp_grads=False)`, pipe/engine.py lines
    # 859-862; `backward_epilogue`, engine.py line 3161) and the next one zeroes them in place
    # (`clear_lp_grads`, lines 612-623). The step's `zero_grad` sets them to None (lines
    # 625-627, called by engine.py line 3526): alive from the first backward to the step.
    lp = _term("bf16 gradients of the parameters (param.grad)", rp.numel, model, "every local gradient")
    gpu["grads"].append(lp)
    for moment in (LOSS, BACKWARD, BACKWARD_END, STEP) + ((FORWARD,) if plan.accumulating else ()):
        grads_at[moment].append(lp)
    # After the last backward the engine all-reduces the buffers (the pipeline engine's
    # `_bf16_reduce_grads`, pipe/engine.py line 297; at stage 1 `allreduce_gradients`, engine.py
    # line 3095, since BF16_Optimizer has no `reduce_gradients`): `buffered_allreduce_fallback`
    # with 5e8 elements per list (engine.py lines 3921-3929 and 3828-3838), flattening a list of
    # two or more into a new tensor (line 3796).
    if copy := _allreduce_copy([g.padded for g in groups]):
        buffers_at[BACKWARD_END].append(_term("flattened gradient buffers being all-reduced (allreduce_bucket)",
                                              copy, acc, "a list of two or more flat buffers"))
    # The step, two instants. First the global norm casts each parameter's gradient (a view of
    # the buffer) to fp32 one at a time (`get_global_norm_of_tensors`, runtime/utils.py line 950:
    # `tensor.detach().float().norm()`; bf16_optimizer.py lines 388-392); clipping multiplies in
    # place (utils.py lines 988-990). Then each group's part of the buffer is cast to fp32 as the
    # master's gradient (lines 414-418), all groups before `optimizer.step()`, dropped after it
    # when grad_acc_dtype is not fp32 (lines 424-426). The updated bf16 partitions are
    # all-gathered into the flat copy itself (`all_gather_into_tensor_dp_groups`, runtime/utils.py
    # lines 1008-1016): no further buffer. The larger of the two instants is counted. Gradients
    # accumulated in fp32 need neither cast: `.float()` of an fp32 tensor is the tensor itself,
    # and the partition becomes the master's gradient as it is (lines 414-418).
    largest = max((p.numel for p in rp.layer + rp.root), default=0)
    if acc != FP32 and partition >= largest:
        buffers_at[STEP].append(_term("fp32 gradient partition (grad_partition.to(float32))", partition, FP32,
                                      "this rank's part of the buffer, cast (more than the norm's cast of the "
                                      "largest tensor)"))
    elif acc != FP32:
        buffers_at[STEP].append(_term("fp32 copy of the largest gradient (the global norm's .float())", largest,
                                      FP32, "the largest local tensor, cast for its norm (more than the cast "
                                      "partition)"))
    return DeepSpeedMemory(gpu, {"params": [], "grads": [], "optimizer": []}, grads_at, buffers_at, [])


def _allreduce_copy(sizes: list[int]) -> int:
    """Elements of the largest list the engine flattens into a new tensor as it all-reduces
    `sizes` in order (`allreduce_no_retain`, engine.py lines 3828-3838: a list closes once it
    passes 5e8 elements; `flatten` of a single tensor is a view of it, line 3796)."""
    largest, held, count = 0, 0, 0
    for size in sizes:
        held, count = held + size, count + 1
        if held > ENGINE_ALLREDUCE_SIZE:
            largest = max(largest, held if count > 1 else 0)
            held, count = 0, 0
    return max(largest, held if count > 1 else 0)


def _stage0(rp: RankParams, plan: DeepSpeedPlan) -> DeepSpeedMemory:
    model = plan.model_bytes
    numel = rp.numel
    moments = (FORWARD, LOSS, BACKWARD, BACKWARD_END, STEP)
    grads_at: dict[str, list[Term]] = {m: [] for m in moments}
    buffers_at: dict[str, list[Term]] = {m: [] for m in moments}
    gpu = {"params": [_term("parameters (flat)", numel, model, "every local parameter")], "grads": [], "optimizer": []}
    if plan.master:
        gpu["optimizer"].append(_term("fp32 master copy", numel, FP32, "fp32_groups_flat"))
    if plan.moments:
        gpu["optimizer"].append(_term("Adam moments", numel, plan.moments, f"{plan.moments} B of moments per element"))
    grads = _term("gradients", numel, model, "every local gradient")
    gpu["grads"].append(grads)
    for moment in (LOSS, BACKWARD, BACKWARD_END, STEP):
        grads_at[moment].append(grads)
    if plan.accumulating:
        grads_at[FORWARD].append(grads)
    if copy := reduction_copy(rp, 0, plan.degree, plan.reduce_bucket_size, False):
        buffers_at[BACKWARD_END].append(_term("flattened gradients being all-reduced (allreduce_bucket)", copy, model,
                                              "the engine's largest list of gradients, 5e8 elements or past"))
    if plan.master:
        buffers_at[STEP].append(_term("fp32 gradients (each cast, then concatenated)", numel, 2 * FP32,
                                      "p.grad.to(fp32) for every parameter, then _flatten_dense_tensors"))
    return DeepSpeedMemory(gpu, {"params": [], "grads": [], "optimizer": []}, grads_at, buffers_at, [])


def deepspeed_memory(rp: RankParams, plan: DeepSpeedPlan) -> DeepSpeedMemory:
    """One rank's memory under DeepSpeed at `plan.stage`."""
    if plan.stage == 3:
        return _stage3(rp, plan)
    if plan.bf16_optimizer:
        return _bf16_optimizer(rp, plan)
    if plan.stage in (1, 2):
        return _stage12(rp, plan)
    return _stage0(rp, plan)
