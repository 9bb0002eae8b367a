"""Bytes of quantized tensors as the libraries `shardplan run` uses allocate them.

4-bit NormalFloat base weights (QLoRA, Dettmers et al. 2023, section 3: "4-bit NormalFloat
Quantization" and "Double Quantization"), as torchao's `NF4Tensor` stores them (torchao 0.18,
quantization/quantize_/workflows/nf4/nf4_tensor.py, `to_nf4(tensor, block_size=64,
scaler_block_size=256)` and `NF4Tensor.from_tensor`), for a weight of N elements in a dtype of
e bytes:

    quantized_data       N/2 bytes        two 4-bit codes per uint8
    quantized_scalers    N/64 bytes       one int8 absmax per block of 64 (double-quantized)
    quantization_factor  N/(64*256) * e   one factor per 256 block scalers
    scaler_mean          e                the mean subtracted before quantizing the scalers
    nf4                  16 * e           the code book, one per tensor

`to_nf4` takes the factors as a column of a (factors, 256) tensor made contiguous: a single
factor is contiguous already, so it keeps the whole 256-entry storage. FSDP2 shards the first three along dim 0 (torchao's `aten.split` and `new_zeros` for NF4Tensor);
each shard keeps a reference to the tensor's own mean and code book.

8-bit AdamW (Dettmers et al. 2022, "8-bit Optimizers via Block-wise Quantization", section 2:
block-wise quantization, dynamic quantization map), as torchao's `AdamW8bit` stores it
(torchao 0.18, optim/adam.py `_AdamBase._new_buffer`, optim/subclass_8bit.py
`OptimState8bit.zeros`): each moment of a tensor of N local elements is, when N >= 4096 and N
is a multiple of the block size 256, an `OptimState8bit` of N uint8 codes, N/256 fp32 block
scales and its own 256-entry fp32 quantization map; otherwise a plain `zeros_like` of the
parameter. Each tensor also has an fp32 `step`.
"""

from __future__ import annotations

NF4_BLOCK = 64  # elements per absmax block (to_nf4 block_size)
NF4_SCALER_BLOCK = 256  # block scalers per quantization factor (to_nf4 scaler_block_size)
NF4_CODES = 16  # entries of the NormalFloat code book
NF4_SOURCE_BYTES = 2  # NF4 weights are quantized from bf16 (torchtune's QLoRA recipes)
INDEX_BYTES = 8  # torch's int64 indices (dequantization looks codes up with them)

STATE8_BLOCK = 256  # elements per block scale (AdamW8bit block_size)
STATE8_MIN_NUMEL = 4096  # smaller tensors keep plain states (`_new_buffer`)
STATE8_QMAP = 256 * 4  # one fp32 quantization map per state tensor (`OptimState8bit.zeros`)
STATE8_SCALE_BYTES = 4  # fp32 block scales
STEP_BYTES = 4  # the fp32 `step` of every tensor


def nf4_quantizable(numel: int, shards: int = 1) -> bool:
    """Whether torchao can quantize a weight of `numel` elements and FSDP2 split it into
    `shards` equal dim-0 pieces: every piece a whole number of scaler blocks (64 * 256)."""
    return numel % (NF4_BLOCK * NF4_SCALER_BLOCK * shards) == 0


def nf4_shared_bytes(e: int = NF4_SOURCE_BYTES) -> int:
    """The mean and code book every NF4 tensor (and each of its shards) references."""
    return e + NF4_CODES * e


def nf4_sharded_bytes(numel: int, e: int = NF4_SOURCE_BYTES) -> int:
    """The codes, block scalers and factors of `numel` elements (a whole tensor or a shard)."""
    blocks = numel // NF4_BLOCK
    return numel // 2 + blocks + blocks // NF4_SCALER_BLOCK * e


def nf4_bytes(numel: int, e: int = NF4_SOURCE_BYTES) -> int:
    """Bytes of one NF4 tensor of `numel` elements as `to_nf4` builds it (all five inner
    tensors). A tensor FSDP2 has sharded (any shard group, one rank included) holds fresh
    copies instead: `nf4_sharded_bytes` of its shard plus `nf4_shared_bytes`."""
    factors = numel // (NF4_BLOCK * NF4_SCALER_BLOCK)
    one_factor = NF4_SCALER_BLOCK * e - e if factors == 1 else 0  # the column's whole storage
    return nf4_sharded_bytes(numel, e) + nf4_shared_bytes(e) + one_factor


def nf4_dequant_bytes(numel: int, e: int = NF4_SOURCE_BYTES) -> int:
    """Peak bytes `NF4Tensor.get_original_weight` allocates to dequantize `numel` elements
    (what `F.linear` on an NF4 weight does in forward and again in backward): the codes as two
    int64 index tensors (8 bytes per element in all), the looked-up values and their scaled
    copies (e bytes per element each), the interleaved result (e per element) and the
    dequantized block scalers (e per block of 64), all alive when the result is stacked.
    Checked against the allocations torchao makes (tests/test_quantized.py)."""
    return INDEX_BYTES * numel + 3 * e * numel + numel // NF4_BLOCK * e


def adamw8bit_quantized(local_numel: int) -> bool:
    """Whether AdamW8bit keeps this tensor's moments in 8 bits (else plain, like AdamW)."""
    return local_numel >= STATE8_MIN_NUMEL and local_numel % STATE8_BLOCK == 0


def adamw8bit_bytes(local_numel: int, param_bytes: int) -> int:
    """Both moments and the step of one tensor of `local_numel` elements on this rank."""
    if adamw8bit_quantized(local_numel):
        moment = local_numel + local_numel // STATE8_BLOCK * STATE8_SCALE_BYTES + STATE8_QMAP
    else:
        moment = local_numel * param_bytes
    return 2 * moment + STEP_BYTES
