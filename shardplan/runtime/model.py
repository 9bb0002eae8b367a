"""The transformer `shardplan run` trains, built from the same `ModelShape` the estimate reads.

Module and parameter names are those of `shardplan.core.params` (q/k/v projections kept
separate so tensor parallelism can cut them by heads), so the planner's per-parameter view,
the estimate and the measured model describe the same tensors. Layers live in an
`nn.ModuleDict` keyed by their global index and the embedding/norm/head can be `None`, so a
pipeline stage is the full model with the other stages' parts removed and names unchanged.
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor, Partial
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..spec.model import ModelShape, RopeScaling
from .capabilities import unbuildable

# Weight initialisation of GPT-2 / Megatron-LM: normal(0, 0.02), biases zero, norms one.
INIT_STD = 0.02
# Tensors above this many elements are drawn a chunk at a time, in parallel (`_drawn_in_chunks`);
# every tensor of the tiny CPU models is below it.
DRAW_CHUNK = 1 << 22
ROPE_THETA = 10000.0  # RoPE base frequency (Su et al. 2021) when the model gives none; no parameter depends on it
NORM_EPS = 1e-5


class RotaryEmbedding(nn.Module):
    """cos/sin tables of rotary position embeddings (non-persistent buffers, not parameters)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = ROPE_THETA,
                 scaling: RopeScaling | None = None):
        super().__init__()
        # Real tables even when the model is built on the meta device (they are small and no
        # parameter depends on them).
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu") / head_dim))
        if scaling is not None:
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32, device="cpu"), inv_freq)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate (batch, seq, heads, head_dim) pairs of channels by position. Applied before
        the heads are moved forward, so attention's output needs no copy (as torchtitan)."""
        seq = x.shape[1]
        cos, sin = self.cos[:seq, None].to(x.dtype), self.sin[:seq, None].to(x.dtype)
        first, second = x[..., 0::2], x[..., 1::2]
        rotated = torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1)
        return rotated.flatten(-2)


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: RopeScaling) -> torch.Tensor:
    """Llama 3.1's scaled inverse frequencies (radians per position), as transformers'
    `_compute_llama3_parameters` (modeling_rope_utils.py) computes them, step for step: a
    frequency whose wavelength 2*pi/f exceeds original_max_position_embeddings /
    low_freq_factor is divided by `factor`, one whose wavelength is below
    original_max_position_embeddings / high_freq_factor is kept, and one in between is
    blended, with weight s = (original_max_position_embeddings / wavelength - low_freq_factor)
    / (high_freq_factor - low_freq_factor) on the kept frequency."""
    factor, low, high = scaling.factor, scaling.low_freq_factor, scaling.high_freq_factor
    old_context_len = scaling.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_context_len / low, old_context_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


class Attention(nn.Module):
    def __init__(self, shape: ModelShape, dropout: float, attention: str):
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.head_dim, self.dropout, self.eager = d, dropout, attention == "eager"
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=shape.qkv_bias)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=shape.qkv_bias)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=shape.out_bias)
        self.resid_dropout = nn.Dropout(dropout)
        self.rope = (RotaryEmbedding(d, shape.max_seq_len or 8192, shape.rope_theta or ROPE_THETA, shape.rope_scaling)
                     if shape.position_embedding == "rope" else None)
        self.core = AttentionCore(d, dropout, self.eager)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds num_heads / tp of them.
        q = self.q_proj(x).view(batch, seq, -1, self.head_dim)
        k = self.k_proj(x).view(batch, seq, -1, self.head_dim)
        v = self.v_proj(x).view(batch, seq, -1, self.head_dim)
        if self.rope is not None:
            q, k = self.rope(q), self.rope(k)
        y = self.core(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(batch, seq, -1)
        return self.resid_dropout(self.o_proj(y))


class AttentionCore(nn.Module):
    """Causal attention over (batch, heads, seq, head_dim): its own module so selective
    activation checkpointing can recompute exactly this part (Korthikanti et al. 2022)."""

    def __init__(self, head_dim: int, dropout: float, eager: bool):
        super().__init__()
        self.scale, self.dropout, self.eager = 1.0 / math.sqrt(head_dim), dropout, eager

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        p = self.dropout if self.training else 0.0
        gqa = q.shape[1] != k.shape[1]
        if not self.eager:
            # enable_gqa shares each key/value head among its query heads without copying.
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, enable_gqa=gqa)
        batch, heads, seq, dim = q.shape
        groups = heads // k.shape[1]
        # Grouped-query attention by broadcasting: (b, kv, g, s, d) against (b, kv, 1, s, d).
        q = q.view(batch, k.shape[1], groups, seq, dim)
        k, v = k.unsqueeze(2), v.unsqueeze(2)
        scores = (q @ k.transpose(-2, -1)) * self.scale
        mask = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        probs = F.dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1), p)
        return (probs @ v).view(batch, heads, seq, dim)


class MLP(nn.Module):
    def __init__(self, shape: ModelShape, dropout: float):
        super().__init__()
        h, f, bias = shape.hidden_size, shape.ffn_hidden_size, shape.mlp_bias
        self.gated = shape.gated
        self.act = F.silu if shape.activation == "swiglu" else (lambda x: F.gelu(x, approximate="tanh"))
        if self.gated:
            self.gate_proj = nn.Linear(h, f, bias=bias)
        self.up_proj = nn.Linear(h, f, bias=bias)
        self.down_proj = nn.Linear(f, h, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            hidden = self.act(self.gate_proj(x)) * self.up_proj(x)
        else:
            hidden = self.act(self.up_proj(x))
        return self.dropout(self.down_proj(hidden))


class _RMSNormFunction(torch.autograd.Function):
    """RMSNorm that keeps only its input and the per-token 1/rms for backward, as fused GPU
    kernels do (torch's CPU composite would also keep the normalised input)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (x.float() * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        grad_weight = (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        g = grad.float() * weight.float()
        grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_weight, None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = NORM_EPS):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(x, DTensor):
            # Sequence parallel: normalise the local tokens; the replicated weight's gradient
            # is a partial sum over the tp ranks' tokens, which DTensor then reduces.
            weight = self.weight
            if isinstance(weight, DTensor):
                weight = weight.to_local(grad_placements=[Partial()] * len(weight.placements))
            local = _RMSNormFunction.apply(x.to_local(), weight, self.eps)
            return DTensor.from_local(local, x.device_mesh, x.placements)
        return _RMSNormFunction.apply(x, self.weight, self.eps)


def _norm(shape: ModelShape) -> nn.Module:
    if shape.norm == "layernorm":
        return nn.LayerNorm(shape.hidden_size, eps=NORM_EPS)
    return RMSNorm(shape.hidden_size)


class Block(nn.Module):
    """Pre-norm transformer layer: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, shape: ModelShape, dropout: float, attention: str):
        super().__init__()
        self.attn_norm = _norm(shape)
        self.attn = Attention(shape, dropout, attention)
        self.mlp_norm = _norm(shape)
        self.mlp = MLP(shape, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class Transformer(nn.Module):
    """A decoder-only language model; `forward` maps token ids (or a previous stage's hidden
    states) to logits (or hidden states for the next stage)."""

    def __init__(self, shape: ModelShape, dropout: float = 0.0, attention: str = "flash"):
        super().__init__()
        missing = unbuildable(shape)  # `run` refuses these jobs before starting (capabilities)
        if missing:
            raise ValueError(f"`shardplan run` does not build {missing} (model {shape.name or shape.family})")
        self.embed: nn.Embedding | None = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.pos_embed: nn.Embedding | None = None
        if shape.position_embedding == "learned":
            self.pos_embed = nn.Embedding(shape.max_seq_len, shape.hidden_size)
        self.embed_dropout = nn.Dropout(dropout)
        self.layers = nn.ModuleDict({str(i): Block(shape, dropout, attention) for i in range(shape.num_layers)})
        self.final_norm: nn.Module | None = _norm(shape)
        self.lm_head: nn.Linear | None = None
        if not shape.tie_embeddings:
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.has_head = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            tokens = x
            x = self.embed(tokens)
            if self.pos_embed is not None:
                positions = torch.arange(tokens.shape[1], device=tokens.device)
                x = x + self.pos_embed(positions)
            x = self.embed_dropout(x)
        for layer in self.layers.values():
            x = layer(x)
        if not self.has_head:
            return x
        x = self.final_norm(x)
        if self.lm_head is not None:
            return self.lm_head(x)
        return F.linear(x, self.embed.weight)


@torch.no_grad()
def init_weights(model: nn.Module, seed: int) -> None:
    """Deterministic weights: each parameter from its own generator seeded by (seed, name),
    so every rank and every layout builds the same full model."""
    for name, param in model.named_parameters():
        init_parameter(param, name, seed)


# checkpoint_wrapper inserts this into the names of the parameters it wraps.
CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."


@torch.no_grad()
def init_parameter(param: torch.Tensor, name: str, seed: int) -> None:
    """Fill `param` with the values `init_weights` gives the whole model's parameter `name`:
    a tensor-parallel DTensor gets its own piece of that full tensor (the piece
    `compute_local_shape_and_global_offset` places on this rank)."""
    # peft's names: a wrapped linear's weight is `<linear>.base_layer.weight`, the same tensor
    # as without adapters; B starts at zero and A as peft initializes it (kaiming-uniform,
    # a = sqrt(5), as nn.Linear), from the name's own generator so every rank agrees.
    name = name.replace(CHECKPOINT_PREFIX, "").replace(".base_layer.", ".")
    local = param.to_local() if isinstance(param, DTensor) else param
    if ".lora_B." in name:
        local.zero_()
        return
    if name.endswith("norm.weight"):
        local.fill_(1.0)
        return
    if name.endswith(".bias"):
        local.zero_()
        return
    generator = torch.Generator().manual_seed(_name_seed(seed, name))
    if ".lora_A." in name:
        full = nn.init.kaiming_uniform_(torch.empty(tuple(param.shape)), a=math.sqrt(5), generator=generator)
    elif math.prod(param.shape) <= DRAW_CHUNK:
        full = torch.randn(tuple(param.shape), generator=generator) * INIT_STD
    else:
        full = _drawn_in_chunks(tuple(param.shape), _name_seed(seed, name))
    if isinstance(param, DTensor):
        shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
        full = full[tuple(slice(start, start + size) for start, size in zip(offset, shape))]
    local.copy_(full)


@torch.no_grad()
def materialize(module: nn.Module, seed: int, prefix: str = "", tied_head: bool = False) -> None:
    """Give `module`'s meta-device parameters CPU storage and their deterministic values
    (`init_weights` of the whole model, named `prefix` + their name). The model is built on the
    meta device and materialized a block at a time just before `fully_shard` shards it
    (torchtitan's pattern), so a rank's host memory holds one block and the root in fp32 at
    start-up, not the whole model. A pipeline's last stage with tied embeddings takes its head
    copy's values from the embedding (`tied_head`)."""
    pending = [name for name, param in module.named_parameters() if param.is_meta]
    if not pending:
        return
    # Tensor-parallel pieces go to their mesh's device (their block is 1/tp of a layer); the
    # rest to the CPU, from where fully_shard moves each rank's shard.
    module._apply(lambda t: torch.empty_like(t, device=t.device_mesh.device_type if isinstance(t, DTensor) else "cpu")
                  if t.is_meta else t)
    params = dict(module.named_parameters())
    for name in pending:
        full_name = prefix + name
        if tied_head and full_name.replace(CHECKPOINT_PREFIX, "") == "lm_head.weight":
            full_name = "embed.weight"
        init_parameter(params[name], full_name, seed)


def _drawn_in_chunks(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """A large tensor's normal draws, each `DRAW_CHUNK` elements from its own generator (seeded
    by the tensor's seed and the chunk's index), drawn by the process's torch threads at once:
    a CPU generator is one serial stream (about 110M values a second), so one generator per
    tensor took minutes for a model of tens of billions of parameters. The values depend on
    the tensor's name and shape alone, as before, so every rank and layout agrees."""
    full = torch.empty(shape)
    flat = full.view(-1)

    def draw(index: int) -> None:
        part = flat[index * DRAW_CHUNK:(index + 1) * DRAW_CHUNK]
        generator = torch.Generator().manual_seed((seed * 1_000_003 + index) % (2**61 - 1))
        torch.randn(part.shape, generator=generator, out=part)
        part.mul_(INIT_STD)

    chunks = -(-flat.numel() // DRAW_CHUNK)
    with ThreadPoolExecutor(max_workers=max(1, min(torch.get_num_threads(), chunks))) as pool:
        list(pool.map(draw, range(chunks)))
    return full


def _name_seed(seed: int, name: str) -> int:
    value = seed
    for ch in name.encode():
        value = (value * 1_000_003 + ch) % (2**61 - 1)
    return value


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy, computed in fp32 (the estimate counts its fp32
    log-probabilities)."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
