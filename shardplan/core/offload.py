"""What the offload engine of `shardplan run` keeps in host memory, in exact bytes (fsdp2).

Modes, on each rank's local shards (docs/estimate.md, "Offload"):

- `optimizer`: optimizer states on the CPU with an fp32 master copy of every parameter
  whose optimizer runs there; parameters and gradients stay on the device, and each gradient
  is also copied into a host buffer as backward produces it (ZeRO-Offload, Ren et al. 2021;
  torchao's CPUOffloadOptimizer);
- `grads` + `optimizer`: the same, and the device gradient is freed once copied (torchao's
  `offload_gradients`); under DDP (zero.stage 1) the gradients are views of DDP's buckets,
  which stay allocated, so the device keeps them;
- `params` (zero.stage 3): layers beyond the GPU budget keep parameters, gradients and
  optimizer states on the CPU (FSDP2's CPUOffloadPolicy); their optimizer steps on the CPU
  in place, without a master copy when the parameters are fp32.

Host optimizer states are fp32 (exp_avg, exp_avg_sq for AdamW; none for SGD), plus AdamW's
4-byte `step` per tensor, or compressed (`offload.cpu_compression`): bf16 takes 2 bytes per
element; int8 one byte and fp16 two per element, padded to whole blocks of `INT8_BLOCK` per
tensor, plus one fp32 scale per block (fp16 needs the scale for its range: runtime/offload_codec.py).
"""

from __future__ import annotations

from .precision import FP32, HALF

# Elements per int8 block: torchao's AdamW8bit default (torchao/optim/adam.py, block_size=256),
# the layout the 8-bit optimizers of bitsandbytes and torchao store.
INT8_BLOCK = 256
# Elements the host-state codec (runtime/offload_codec.py) transforms at a time: whole blocks,
# so a chunk's temporaries are a few MiB, reused from one chunk to the next.
CODEC_CHUNK = 1 << 20
# Chunks whose random bits bf16 stochastic rounding draws in one round (one generator each).
ROUNDING_CHUNKS = 16

SCALE_BYTES = FP32  # one fp32 absmax per block
CODE_BYTES = {"int8": 1, "fp16": HALF}  # block-wise stores: bytes per element

MOMENTS = {"adamw": 2, "adamw8bit": 2, "sgd": 0}  # state tensors per parameter tensor
ENGINE_OPTIMIZERS = ("adamw", "sgd")  # what the engine steps on the CPU (runtime/offload.py)


def rounding_elements(numel: int) -> int:
    """Elements of one round of bf16 rounding's random bits for tensors of up to `numel`
    elements: `ROUNDING_CHUNKS` chunks, or fewer when the tensors are smaller (the buffer the
    offload engine keeps, runtime/offload_codec.py `rounding_bits`, and core/host.py counts)."""
    return min(numel, ROUNDING_CHUNKS * CODEC_CHUNK)


def blocks(numel: int) -> int:
    """int8 blocks of one tensor of `numel` elements (its codes padded to whole blocks)."""
    return -(-numel // INT8_BLOCK)


def moment_bytes(elements: int, num_blocks: int, compression: str, optimizer: str) -> int:
    """Bytes of the optimizer moments of `elements` elements (`num_blocks` int8 blocks over
    their tensors) as the engine stores them on the host."""
    count = MOMENTS.get(optimizer, 2)
    if compression in CODE_BYTES:
        return count * num_blocks * (INT8_BLOCK * CODE_BYTES[compression] + SCALE_BYTES)
    if compression == "bf16":
        return count * elements * HALF
    return count * elements * FP32


def describe_moments(elements: int, num_blocks: int, compression: str, optimizer: str) -> str:
    count = MOMENTS.get(optimizer, 2)
    if compression in CODE_BYTES:
        return (f"{count} moments * {num_blocks:,} blocks * ({INT8_BLOCK} * {CODE_BYTES[compression]} B codes + "
                f"{SCALE_BYTES} B scale), {compression} block-wise")
    unit = HALF if compression == "bf16" else FP32
    what = " (bf16, stochastic rounding)" if unit == HALF else " (fp32)"
    return f"{count} moments * {elements:,} elements * {unit} B{what}"


def mode_name(params: bool, grads: bool, optimizer: bool) -> str:
    """The offload mode in words (decisions, docs)."""
    parts = [name for name, on in (("parameters", params), ("gradients", grads), ("optimizer states", optimizer)) if on]
    return " + ".join(parts) if parts else "none"


def frees_device_grads(grads: bool, optimizer: bool, zero_stage: int) -> bool:
    """Whether the engine frees the device gradient once it is copied to the host: only with
    both flags, and not under DDP (zero.stage 1), whose buckets hold the gradients."""
    return grads and optimizer and zero_stage != 1
