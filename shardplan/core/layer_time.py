"""One transformer layer on one rank for one microbatch: forward, backward and recompute time.

The layer is the one core/params.py describes, cut by tensor parallelism as Megatron-LM cuts
it (Shoeybi et al. 2019): q/k/v and MLP up/gate column-parallel, the output projection and
MLP down row-parallel. Its work, for T = b*s/cp tokens on the rank (s/cp queries against s keys
under context parallelism):

- matmuls: every linear forward once; backward twice (input and weight gradient; frozen
  weights, as under LoRA, only the input gradient), each on the roofline (kernels.py);
- attention: flash, one fused kernel (causal: half the score matrix); eager, the batched
  score and value matmuls over the full s x s matrix plus the softmax (and dropout) over it;
- memory-bound kernels: norms, the activation, rotary embedding, bias-dropout-residual adds;
  with sequence parallelism the norms and dropouts run on T/tp tokens; under QLoRA the
  dequantization of every linear's NF4 weight, forward and again backward (torchao's
  `get_original_weight`, about a dozen kernels: each byte of its working set, core/quantized.py
  `nf4_dequant_bytes`, written once and read once);
- tensor parallel communication (Korthikanti et al. 2022, Figure 5): 2 all-reduces of T*h
  forward and 2 backward, or with sequence parallelism 2 all-gathers and 2 reduce-scatters
  each way (Megatron-LM gathers the two linear inputs once more in backward); not overlapped
  with compute (Megatron-LM's default, torch's DTensor plan);
- context parallel: the ring attention passes K and V around the cp ranks (cp - 1 steps,
  twice as much backward: K, V and their gradients), overlapped with the attention blocks;
- recomputation: full reruns the forward (its communication included) in backward;
  selective reruns the attention core (Korthikanti et al. 2022, section 5); torchtitan's
  operator policy ("op") reruns the elementwise work and the matmuls it does not keep.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ..spec.model import ModelShape
from .collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Link, collective_seconds, point_to_point_seconds
from .flops import op_recomputed
from .hardware import Hardware, TimeConstants
from .kernels import NONE, Work, fused_attention, matmul, streaming
from .quantized import nf4_dequant_bytes

MASK_BYTES = 1  # a dropout mask element (bool)


@dataclass(frozen=True)
class LayerWork:
    """What decides one layer's cost on a rank (narrow and hashable: results are cached)."""

    shape: ModelShape
    micro_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    attention: str = "flash"
    dropout: bool = False
    recompute: str = "none"
    act_bytes: int = 2
    frozen: bool = False  # base weights get no gradient (LoRA)
    lora_rank: int = 0
    lora_targets: tuple[str, ...] = ()
    nf4: bool = False  # QLoRA: every linear's NF4 weight is dequantized for its matmuls
    # Sequence parallel as Megatron-LM runs it: the linears keep their sequence-sharded input
    # and all-gather it again in backward for the weight gradient (Korthikanti et al. 2022,
    # section 4.2.2); torch's DTensor plan keeps the gathered input instead.
    sp_regather: bool = False

    @property
    def tokens(self) -> int:
        return self.micro_batch * self.seq_len // self.cp

    @property
    def sp(self) -> bool:
        return self.sequence_parallel and self.tp > 1


@dataclass(frozen=True)
class LayerCosts:
    """Seconds of one layer, one microbatch, one rank, and the pieces they add up from."""

    forward_matmul: Work
    forward_attention: Work
    forward_memory: Work
    backward_matmul: Work  # input and weight gradients
    weight_matmul: Work  # the weight-gradient part of backward_matmul
    backward_attention: Work
    backward_memory: Work
    recompute: Work  # forward work rerun in backward
    tp_forward: float
    tp_backward: float
    tp_recompute: float
    tp_count: int  # collectives per direction
    tp_message_bytes: float
    cp_forward: float  # exposed part of the K/V ring
    cp_backward: float
    cp_step_bytes: float
    dequant_bytes: float = 0.0  # QLoRA: the NF4 dequantization's bytes, in forward and once in backward

    @property
    def forward(self) -> float:
        return self.forward_matmul.seconds + self.forward_attention.seconds + self.forward_memory.seconds

    @property
    def backward(self) -> float:
        return self.backward_matmul.seconds + self.backward_attention.seconds + self.backward_memory.seconds


def local_linears(shape: ModelShape, tp: int) -> list[tuple[str, int, int, int]]:
    """(name, in features, out features, how many) of the layer's matmuls on one tp rank;
    experts count those one token meets (k of E)."""
    h, d = shape.hidden_size, shape.head_dim
    q = shape.num_heads * d // tp
    kv = (max(1, shape.num_kv_heads // tp) if tp <= shape.num_kv_heads else 1) * d
    f = -(-shape.ffn_hidden_size // tp)
    mlp = [("up_proj", h, f), ("down_proj", f, h)]
    if shape.gated:
        mlp.insert(0, ("gate_proj", h, f))
    return [("q_proj", h, q, 1), ("k_proj", h, kv, 1), ("v_proj", h, kv, 1), ("o_proj", q, h, 1)] + \
        [(name, i, o, 0) for name, i, o in mlp]


def _matmuls(w: LayerWork, peak: float, hw: Hardware, c: TimeConstants) -> tuple[Work, Work, Work]:
    """Forward matmuls, their weight-gradient counterparts (the input gradient costs as much
    as the forward: same m, n, k), and the forward of those torchtitan's operator policy
    recomputes (flops.op_recomputed)."""
    shape, e, tokens = w.shape, w.act_bytes, w.tokens
    again = op_recomputed(shape, w.tp) if w.recompute == "op" else ()
    forward = weight = rerun = NONE
    for name, fan_in, fan_out, dense in local_linears(shape, w.tp):
        if dense or not shape.moe:
            one = matmul(tokens, fan_out, fan_in, e, peak, hw, c)
        else:
            # Each expert multiplies the tokens routed to it: T*k/E on average, E kernels.
            rows = tokens * shape.experts_per_token / shape.num_experts
            one = matmul(rows, fan_out, fan_in, e, peak, hw, c).times(shape.num_experts)
        forward += one
        weight += NONE if w.frozen else one
        rerun += one if name.removesuffix("_proj") in again else NONE
        if w.lora_rank and name in w.lora_targets:
            # A (r x in) then B (out x r): trained, so they get weight gradients.
            adapter = matmul(tokens, w.lora_rank, fan_in, e, peak, hw, c) + matmul(tokens, fan_out, w.lora_rank, e, peak, hw, c)
            forward += adapter
            weight += adapter
    if shape.moe:  # the router: T x h by h x E, replicated over tp
        router = matmul(tokens, shape.num_experts, shape.hidden_size, e, peak, hw, c)
        forward += router
        weight += NONE if w.frozen else router
        rerun += router if "router" in again else NONE
    return forward, weight, rerun


def _attention(w: LayerWork, peak: float, hw: Hardware, c: TimeConstants) -> tuple[Work, Work]:
    """Forward and backward of the attention core (scores, softmax, weighted values)."""
    shape, e = w.shape, w.act_bytes
    heads = max(1, shape.num_heads // w.tp)
    queries, keys, d = w.seq_len // w.cp, w.seq_len, shape.head_dim
    batch = w.micro_batch * heads
    if w.attention == "flash":
        # Causal: half the score matrix; ring attention balances the causal halves over cp.
        flops = 4.0 * batch * queries * keys * d / 2
        return (fused_attention(flops, c.flash_forward_efficiency, peak),
                fused_attention(c.flash_backward_ratio * flops, c.flash_backward_efficiency, peak))
    scores = float(batch * queries * keys)
    qk = matmul(queries, keys, d, e, peak, hw, c, batch)
    pv = matmul(queries, d, keys, e, peak, hw, c, batch)
    softmax = streaming(2 * e * scores, hw)  # fused scale, mask and softmax: read, write
    dropout = streaming((2 * e + MASK_BYTES) * scores, hw) if w.dropout else NONE
    forward = qk + softmax + dropout + pv
    # Backward: dP = dO V^T and dV = P^T dO, the dropout and softmax gradients (read the
    # saved probabilities and the incoming gradient, write one), dQ = dS K and dK = dS^T Q.
    softmax_back = streaming(3 * e * scores, hw)
    dropout_back = streaming((2 * e + MASK_BYTES) * scores, hw) if w.dropout else NONE
    backward = pv.times(2) + dropout_back + softmax_back + qk.times(2)
    return forward, backward


def _memory_bound(w: LayerWork, hw: Hardware) -> Work:
    """Forward bytes of the layer's elementwise kernels."""
    shape, e, tokens = w.shape, w.act_bytes, w.tokens
    h = shape.hidden_size
    local = tokens // w.tp if w.sp else tokens  # norms and residual dropouts under SP
    ffn = -(-shape.ffn_hidden_size // w.tp) * (shape.experts_per_token if shape.moe else 1)
    norms = 1 if shape.shared_layer_norm else 2
    moved = norms * 2 * e * local * h  # read, write
    # Two bias-dropout-residual adds: read the output and the residual, write the sum (and
    # the dropout mask).
    moved += 2 * (3 * e + (MASK_BYTES if w.dropout else 0)) * local * h
    moved += (3 if shape.gated else 2) * e * tokens * ffn  # activation: read (gate, up), write
    if shape.position_embedding == "rope":
        heads = shape.num_heads // w.tp + max(1, shape.num_kv_heads // w.tp)
        moved += 2 * e * tokens * heads * shape.head_dim  # rotate q and k: read, write
    return streaming(moved, hw, kernels=norms + 3 + (1 if shape.position_embedding == "rope" else 0))


DEQUANT_KERNELS = 12  # torchao's get_original_weight: shifts, casts, lookups, scalers, scales, stack


def _dequantization(w: LayerWork, hw: Hardware) -> Work:
    """QLoRA: bytes torchao moves to dequantize the layer's NF4 weights once."""
    if not w.nf4:
        return NONE
    shape = w.shape
    moved = 0
    count = 0
    for _, fan_in, fan_out, dense in local_linears(shape, w.tp):
        copies = 1 if dense or not shape.moe else shape.num_experts
        moved += copies * 2 * nf4_dequant_bytes(fan_in * fan_out)
        count += copies
    return streaming(moved, hw, kernels=DEQUANT_KERNELS * count)


def _tensor_parallel(w: LayerWork, link: Link) -> tuple[float, int, float]:
    """Seconds of one direction's collectives, their count and message size (T*h*e)."""
    if w.tp == 1:
        return 0.0, 0, 0.0
    message = float(w.tokens * w.shape.hidden_size * w.act_bytes)
    if w.sp:
        one = collective_seconds(ALL_GATHER, message, w.tp, link) + collective_seconds(REDUCE_SCATTER, message, w.tp, link)
        return 2 * one, 4, message
    return 2 * collective_seconds(ALL_REDUCE, message, w.tp, link), 2, message


def _context_parallel(w: LayerWork, attention: tuple[Work, Work], link: Link) -> tuple[float, float, float]:
    """Exposed seconds of the K/V ring forward and backward, and the bytes of one step."""
    if w.cp == 1:
        return 0.0, 0.0, 0.0
    shape = w.shape
    kv_heads = max(1, shape.num_kv_heads // w.tp)
    step = 2.0 * w.micro_batch * (w.seq_len // w.cp) * kv_heads * shape.head_dim * w.act_bytes
    forward = (w.cp - 1) * point_to_point_seconds(step, link)
    backward = 2 * forward  # K, V and their gradients travel back
    return (max(0.0, forward - attention[0].seconds), max(0.0, backward - attention[1].seconds), step)


@lru_cache(maxsize=4096)
def layer_costs(w: LayerWork, peak: float, hw: Hardware, c: TimeConstants, tp_link: Link, cp_link: Link) -> LayerCosts:
    """The cost of one layer (module docstring), cached: the planner asks for few shapes."""
    forward_mm, weight_mm, op_rerun = _matmuls(w, peak, hw, c)
    attention = _attention(w, peak, hw, c)
    dequant = _dequantization(w, hw)
    memory = _memory_bound(w, hw) + dequant
    backward_memory = streaming((memory.bytes - dequant.bytes) * c.elementwise_backward_ratio, hw,
                                memory.kernels - dequant.kernels) + dequant
    tp_seconds, tp_count, message = _tensor_parallel(w, tp_link)
    tp_backward = tp_seconds
    if w.sp and w.sp_regather and not w.frozen:
        tp_backward += 2 * collective_seconds(ALL_GATHER, message, w.tp, tp_link)
    cp_forward, cp_backward, cp_step = _context_parallel(w, attention, cp_link)
    if w.recompute == "full":
        recompute = forward_mm + attention[0] + memory
        tp_recompute = tp_seconds
    elif w.recompute == "selective":
        recompute, tp_recompute = attention[0], 0.0
    elif w.recompute == "op":
        # The attention output and every other matmul's output are kept: the rest of the
        # forward runs again. Of its collectives the reduce-scatters' outputs are kept too
        # (torchtitan/distributed/activation_checkpoint.py, `comm_ops`); the all-gathers and
        # all-reduces run again.
        rerun_tp = tp_seconds / 2 if w.sp else tp_seconds
        recompute, tp_recompute = op_rerun + memory, rerun_tp
    else:
        recompute, tp_recompute = NONE, 0.0
    # The input gradient of every matmul (adapters included) costs what its forward does.
    backward_mm = forward_mm + weight_mm
    return LayerCosts(
        forward_matmul=forward_mm, forward_attention=attention[0], forward_memory=memory,
        backward_matmul=backward_mm, weight_matmul=weight_mm, backward_attention=attention[1],
        backward_memory=backward_memory, recompute=recompute,
        tp_forward=tp_seconds, tp_backward=tp_backward, tp_recompute=tp_recompute, tp_count=tp_count,
        tp_message_bytes=message, cp_forward=cp_forward, cp_backward=cp_backward, cp_step_bytes=cp_step,
        dequant_bytes=dequant.bytes,
    )
