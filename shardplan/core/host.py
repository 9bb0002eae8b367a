"""Host (CPU) memory a node really needs: two moments, start-up and training, per rank; a
node adds its ranks up and needs the larger moment.

- Start-up: the copy of the model a framework builds on the CPU before sharding it. `shardplan
  run` (the fsdp2 accounting) builds the model on the meta device and materializes it a block
  at a time just before `fully_shard` shards it, then the root (runtime/model.py
  `materialize`, torchtitan's pattern): a rank holds one layer or the root in full at once;
  code driving DeepSpeed at ZeRO stage 0-2
  builds the rank's part in fp32 (Megatron-LM, transformers' `from_pretrained` without a
  dtype) before `deepspeed.initialize` moves it; ZeRO-3 partitions while constructing
  (`deepspeed.zero.Init`, which transformers enables under ZeRO-3), so nothing whole is built.
- Training: offloaded model states as allocated (pinned buffers rounded up to a power of two
  by torch's caching host allocator, core/deepspeed.py `pinned_bytes`), the CPU optimizer
  step's temporaries, checkpoint staging, DeepSpeed's own host buffers (core/deepspeed.py).
- Both: a per-process allowance for the runtime itself.
"""

from __future__ import annotations

from ..spec.units import counted
from .deepspeed import flat_groups, pinned_bytes, stage3_sub_groups, steps_with_bf16_optimizer
from .estimate_inputs import EstimateInputs
from .offload import (CODE_BYTES, CODEC_CHUNK, INT8_BLOCK, MOMENTS, ROUNDING_CHUNKS, frees_device_grads,
                      rounding_elements)
from .precision import FP32, ElementBytes
from .stages import RankParams, chunk_size
from .states import HOST_GRADS, MASTER, HostGroup
from .terms import Term

# Bytes per element the int8 codec holds at once for the chunk it codes (runtime/offload_codec.py:
# the fp32 scaled input and torchao's absolute values for the block maxima (4 + 4), the code
# table's int32 buckets (4), the gathered codes and cuts (1 + 4), the comparison (1), and on
# decoding the fp32 chunk (4)), rounded up to a stated allowance.
INT8_TEMPORARY = 32
# Bytes per element the fp16 codec holds at once for the chunk it codes: its three chunk
# buffers (absolute values, scaled values, carries: 4 + 4 + 4) and, where a chunk has fp16
# subnormals, their exact rounding's mask, indices, values, units, integer parts and draws
# (1 + 8 + 4 * 4 at most) (runtime/offload_codec.py `fp16_stochastic`), rounded up; decoding
# holds less (the widened chunk and its product, 4 + 4).
FP16_TEMPORARY = 40

# Host memory of one training process beside its tensors: Python, torch and the CUDA, cuDNN,
# cuBLAS and NCCL libraries mapped into it, the CUDA driver's host-side state, NCCL's host
# buffers and the data loader. A stated allowance, not a measurement of a job. Without an
# accelerator the process is torch and gloo alone: 266 MiB resident after
# `init_process_group("gloo")` and an all-reduce (torch 2.13 CPU build, measured with
# /proc/self/status VmHWM), rounded up.
PROCESS_HOST_BYTES = 2 * 2**30
PROCESS_HOST_BYTES_CPU = 512 * 2**20

STARTUP, TRAINING = "start-up", "training"


def process_allowance(on_gpu: bool = True) -> Term:
    if on_gpu:
        return Term("runtime per process (allowance)", PROCESS_HOST_BYTES,
                    "Python, torch, CUDA/NCCL libraries and driver state: 2 GiB per process")
    return Term("runtime per process (allowance)", PROCESS_HOST_BYTES_CPU,
                "Python, torch and gloo without an accelerator: 512 MiB per process")


def startup_host(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes) -> list[Term]:
    """The model copy built on this rank's CPU before sharding."""
    if inputs.framework == "fsdp2":
        if inputs.shape is None:
            return []  # `run` builds a model layer by layer; a bare count has none to build
        largest = max(rp.layer_numel if rp.num_layers else 0, rp.root_numel)
        unit = eb.params
        return [Term("one layer or the root, materialized before fully_shard (`run`)", largest * unit,
                     lambda: f"max(layer {rp.layer_numel:,}, root {rp.root_numel:,}) parameters * {unit} B")] if largest else []
    if inputs.zero_stage == 3:
        return []  # deepspeed.zero.Init partitions while the model is built
    numel = rp.numel
    return [Term("the rank's model part built in fp32 before deepspeed.initialize", numel * FP32,
                 lambda: f"{numel:,} parameters * {FP32} B")] if numel else []


def rank_host(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int, resident: int,
              cpu: dict[str, list[Term]], groups: list[HostGroup] | None = None) -> list[Term]:
    """Host memory of one rank's offloaded states while training, under fsdp2 or the paper.

    fsdp2: each parameter of an offloaded layer (`CPUOffloadPolicy`) is pinned on its own
    (`FSDPParam`: `pin_memory()` per parameter) and so is each gradient it receives (copied
    device-to-host with `non_blocking=True`, which allocates pinned memory): each takes the
    power of two above its size. The offload engine (runtime/offload.py) pins one buffer per
    group for the fp32 master weights and one for the gradient copies; its optimizer states
    are not pinned (never copied); its staging and working buffers follow (`engine_buffers`)."""
    if inputs.framework != "fsdp2":
        return [Term(t.label, t.bytes, t.source) for kind in ("params", "grads", "optimizer") for t in cpu[kind]]
    groups = groups or []
    pin = inputs.pin_memory and inputs.on_gpu
    offloaded = rp.num_layers - resident if inputs.offload_params else 0
    flat = inputs.shape is None and inputs.offload_params  # a bare count offloads as one block
    terms = []
    if offloaded or flat:
        tensors = rp.root if flat else rp.layer
        count = 1 if flat else offloaded
        for kind, unit in (("params", eb.params), ("grads", eb.grads)):
            sizes = [p.padded_shard_numel(degree) * unit for p in tensors]
            held = count * sum(pinned_bytes(size) if pin else size for size in sizes)
            label = f"offloaded {kind}" + (" (pinned, each rounded up to a power of two)" if pin else "")
            terms.append(Term(label, held, lambda sizes=sizes, count=count: f"{counted(count, 'block')} * sum over {counted(len(sizes), 'tensor')}"))
    for g in groups:
        if g.offloaded:
            continue
        for what, unit in ((MASTER, FP32), (HOST_GRADS, eb.grads)):
            size = g.elements * unit
            held = g.count * (pinned_bytes(size) if pin else size)
            note = " (pinned, rounded up to a power of two)" if pin else ""
            terms.append(Term(f"{g.label} {what}{note}", held, lambda g=g, size=size: _pinned_formula(g.count, size, pin)))
    engine_terms = {f"{g.label} {what}" for g in groups if not g.offloaded for what in (MASTER, HOST_GRADS)}
    terms += [t for t in cpu["optimizer"] if t.label not in engine_terms]
    return terms + engine_buffers(inputs, rp, eb, degree, groups)


def _pinned_formula(count: int, size: int, pin: bool) -> str:
    """`8 groups * 122,963,200 B, pinned as 134,217,728 B`: the rounding shown, so the product is the figure."""
    each = f"{size:,} B" + (f", pinned as {pinned_bytes(size):,} B" if pin and pinned_bytes(size) != size else "")
    return f"{count} groups * {each}" if count > 1 else each


def engine_buffers(inputs: EstimateInputs, rp: RankParams, eb: ElementBytes, degree: int,
                   groups: list[HostGroup]) -> list[Term]:
    """The offload engine's transient host buffers (runtime/offload.py), each allocated once:

    - gradient staging, `1 + prefetch_layers` slots of the largest tensor, pinned: when
      the device gradient is freed after its copy and a later microbatch's gradient must be
      added on the host (FSDP2 reduces every microbatch; pipelines and DDP reduce once);
    - cast staging, as many slots, when the device parameters are not fp32: the updated fp32
      master is cast on the host, then copied;
    - decompression: the fp32 moments of the largest group while it steps (compression);
    - the codec's temporaries, for one chunk of `CODEC_CHUNK` elements at a time: int8's
      (`INT8_TEMPORARY` bytes per element, an allowance), bf16's random bits (4 bytes per
      element of a round of `ROUNDING_CHUNKS` chunks), fp16's (`FP16_TEMPORARY`, an
      allowance, and its random words drawn ahead: 2 bytes per element of up to
      `ROUNDING_CHUNKS` chunks);
    - an fp32 copy of a group's gradients when they are 16-bit (the fused CPU AdamW kernel
      steps one dtype)."""
    on_device = [g for g in groups if not g.offloaded]
    if not groups:
        return []
    pin = inputs.pin_memory and inputs.on_gpu
    ring = 1 + inputs.prefetch_layers
    shard = degree if inputs.zero_stage >= 2 else 1
    largest = max(chunk_size(p.rows, shard, 0) * p.row_numel for p in (*rp.layer, *rp.root))
    biggest = max(g.elements for g in groups)
    padded = max(g.blocks * INT8_BLOCK if inputs.compression in CODE_BYTES else g.elements for g in groups)
    terms = []

    def slots(label: str, unit: int) -> Term:
        size = largest * unit
        held = pinned_bytes(size) if pin else size
        return Term(label, ring * held, lambda: f"(1 + prefetch {inputs.prefetch_layers}) * {held:,} B "
                                                f"({largest:,} elements * {unit} B{', pinned' if pin else ''})")

    accumulating = inputs.num_microbatches > 1 and inputs.degrees.pp == 1
    if on_device and accumulating and frees_device_grads(inputs.offload_grads, inputs.offload_optimizer, inputs.zero_stage):
        terms.append(slots("gradient staging (accumulation on the host)", eb.grads))
    if on_device and eb.params != FP32:
        terms.append(slots("cast staging (fp32 master to device dtype)", eb.params))
    moments = MOMENTS.get(inputs.optimizer, 2)
    if inputs.compression != "none" and moments:
        terms.append(Term("decompressed moments of the group stepping", moments * padded * FP32,
                          lambda: f"{moments} * {padded:,} elements * {FP32} B"))
    if inputs.compression == "int8" and moments:
        chunk = min(padded, CODEC_CHUNK)
        terms.append(Term("int8 quantisation temporaries (allowance)", chunk * INT8_TEMPORARY,
                          lambda: f"{chunk:,} elements of a chunk * {INT8_TEMPORARY} B"))
    if inputs.compression == "bf16" and moments:
        drawn = rounding_elements(padded)
        terms.append(Term("bf16 rounding's random bits", drawn * 4,
                          lambda: f"{drawn:,} elements of a round * 4 B (int32)"))
    if inputs.compression == "fp16" and moments:
        chunk = min(padded, CODEC_CHUNK)
        ahead = min(-(-padded // CODEC_CHUNK), ROUNDING_CHUNKS)
        terms.append(Term("fp16 rounding temporaries (allowance)", chunk * FP16_TEMPORARY + ahead * chunk * 2,
                          lambda: f"{chunk:,} elements of a chunk * ({FP16_TEMPORARY} B + {ahead} chunks drawn "
                                  f"ahead * 2 B)"))
    if eb.grads != FP32:
        terms.append(Term("fp32 copy of a group's gradients", biggest * FP32, lambda: f"{biggest:,} elements * {FP32} B"))
    return terms


def checkpoint_staging(inputs: EstimateInputs, rp: RankParams, degree: int) -> list[Term]:
    """Writing a checkpoint copies each tensor of the rank's state to the host as it is
    written (torch.save; torch.distributed.checkpoint's FileSystemWriter), one at a time:
    the largest single fp32 state tensor bounds it."""
    if not inputs.checkpointing or rp.numel == 0:
        return []
    if (inputs.framework == "deepspeed" and inputs.zero_stage in (1, 2)) or steps_with_bf16_optimizer(inputs):
        # One flat fp32 partition per group: ZeRO-1/2's single_partition_of_fp32_groups, or
        # BF16_Optimizer's fp32_groups_flat_partition (bf16_optimizer.py lines 181-183).
        largest = max(g.partition for g in flat_groups(rp, degree, 0))
    elif inputs.framework == "deepspeed" and inputs.zero_stage == 0 and inputs.precision != "fp32":
        # FP16_Optimizer: one whole fp32 flat copy per group (`fp32_groups_flat`,
        # runtime/fp16/fused_optimizer.py lines 94-103).
        largest = max(g.numel for g in flat_groups(rp, 1, 0))
    elif inputs.framework == "deepspeed" and inputs.zero_stage == 3:
        # One fp32 master tensor per sub-group (stage3.py lines 1110-1176), the largest of
        # which bounds it; zero.sub_group_size cuts them (core/deepspeed.py `sub_groups_of`).
        largest = max(stage3_sub_groups(rp, degree, inputs.sub_group_size))
    else:
        shard = degree if inputs.zero_stage >= 2 or inputs.framework != "fsdp2" else 1
        largest = max(p.padded_shard_numel(shard) for p in (*rp.layer, *rp.root))
    return [Term("checkpoint staging (the largest state tensor while written)", largest * FP32,
                 lambda: f"{largest:,} elements * {FP32} B")]


def node_host(per_rank: list[tuple[list[Term], list[Term]]], on_gpu: bool = True) -> tuple[int, str, dict[str, int]]:
    """A node's host need from its ranks' (training, start-up) terms: (bytes at the larger
    moment, its name, bytes by label)."""
    best = (0, TRAINING, {})
    for moment, index in ((TRAINING, 0), (STARTUP, 1)):
        breakdown: dict[str, int] = {}
        for terms in per_rank:
            for term in terms[index] + [process_allowance(on_gpu)]:
                breakdown[term.label] = breakdown.get(term.label, 0) + term.bytes
        total = sum(breakdown.values())
        if total > best[0] or (total == best[0] and not best[2]):
            best = (total, moment, breakdown)
    return best
