"""Per-stage costs of one microbatch: forward, backward and weight-gradient seconds of every
global pipeline stage, split by what they are spent on.

A stage's forward is its layers (layer_time.py), the embedding on the first stage, the final
norm, output head and loss on the last, and the send of its output to the next stage; its
backward is the layers' backward and recomputation and the send of the input gradient back.
Point-to-point sends use Megatron-LM's scatter/gather (Narayanan et al. 2021, section 4.1):
with tensor parallelism each rank sends 1/tp of the activation and the next stage all-gathers
it over NVLink. Sharded data parallelism gathers and reduces parameters inside every
microbatch (ZeRO stage 2/3, FSDP); where the framework prefetches, that traffic overlaps the
compute it runs beside (`overlapped`), as do parameters streamed from the host under
offload.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from .collectives import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, Link, collective_seconds, point_to_point_seconds
from .hardware import Hardware, TimeConstants
from .kernels import NONE, Work, matmul, streaming
from .layer_time import LayerCosts

# Where seconds go (the JSON `time.breakdown` keys).
FORWARD, BACKWARD, RECOMPUTE = "forward", "backward", "recompute"
TENSOR_PARALLEL, CONTEXT_PARALLEL = "tensor_parallel", "context_parallel"
PIPELINE_P2P, PIPELINE_BUBBLE = "pipeline_p2p", "pipeline_bubble"
DATA_PARALLEL, OFFLOAD, OPTIMIZER = "data_parallel", "offload", "optimizer"
CATEGORIES = (FORWARD, BACKWARD, RECOMPUTE, TENSOR_PARALLEL, CONTEXT_PARALLEL, PIPELINE_P2P,
              PIPELINE_BUBBLE, DATA_PARALLEL, OFFLOAD, OPTIMIZER)


def overlapped(compute: float, comm: float, c: TimeConstants) -> float:
    """Seconds that `comm` adds to `compute` when they run side by side: the longer one, plus
    the share of the shorter one that does not hide (TimeConstants.overlap_efficiency)."""
    if comm <= 0:
        return 0.0
    total = max(compute, comm) + (1 - c.overlap_efficiency) * min(compute, comm)
    return total - compute


@dataclass(frozen=True)
class EdgeCosts:
    """The embedding (first stage) and the final norm, head and loss (last stage)."""

    embed_forward: Work
    embed_backward: Work
    embed_tp: float
    head_forward: Work
    head_backward: Work
    head_weight: Work
    head_tp_forward: float
    head_tp_backward: float


@lru_cache(maxsize=1024)
def edge_costs(shape, tokens: int, tp: int, sp: bool, e: int, frozen: bool, loss: str, peak: float,
               hw: Hardware, c: TimeConstants, tp_link: Link) -> EdgeCosts:
    """Embedding lookup (gather, write; backward: scatter-add of the gradient), vocabulary-
    parallel head (Megatron-LM: logits T x V/tp) and the cross-entropy over its logits
    (`loss`: fp32 on upcast logits, or Megatron-LM's fused kernel)."""
    h = shape.hidden_size
    local = tokens // tp if sp else tokens
    vocab = -(-shape.vocab_size // tp)
    positions = 3 * e * tokens * h if shape.position_embedding == "learned" else 0
    embed_forward = streaming(2 * e * tokens * h + positions, hw)
    embed_backward = streaming(3 * e * tokens * h, hw)
    message = float(tokens * h * e)
    # Vocabulary-parallel embedding: an all-reduce of its output (a reduce-scatter under SP).
    embed_tp = collective_seconds(REDUCE_SCATTER if sp else ALL_REDUCE, message, tp, tp_link)
    logits = matmul(tokens, vocab, h, e, peak, hw, c)
    norm = streaming(2 * e * local * h, hw)
    forward_bytes, backward_bytes = c.cross_entropy_fused_bytes if loss == "fused" else c.cross_entropy_fp32_bytes
    head_forward = norm + logits + streaming(forward_bytes * tokens * vocab, hw)
    head_weight = NONE if frozen else logits
    head_backward = (streaming(c.elementwise_backward_ratio * norm.bytes + backward_bytes * tokens * vocab, hw)
                     + logits + head_weight)
    # SP gathers the sequence before the head (reduce-scatter back); without SP the head's
    # input gradient is all-reduced (Megatron-LM's `f` operator).
    head_tp_forward = collective_seconds(ALL_GATHER, message, tp, tp_link) if sp else 0.0
    head_tp_backward = collective_seconds(REDUCE_SCATTER if sp else ALL_REDUCE, message, tp, tp_link)
    return EdgeCosts(embed_forward, embed_backward, embed_tp if tp > 1 else 0.0, head_forward, head_backward,
                     head_weight, head_tp_forward, head_tp_backward)


@dataclass(frozen=True)
class ShardedTraffic:
    """Sharded data parallelism's per-microbatch collectives of one stage, seconds."""

    forward: float  # parameter all-gather before the forward
    backward: float  # all-gathers in backward (and recompute) and the gradient reduce-scatter
    overlap: bool  # the framework prefetches / reduces during compute


@dataclass(frozen=True)
class StageCost:
    """One global stage, one microbatch: seconds by category for F, B and W."""

    forward: dict[str, float]
    backward: dict[str, float]
    weight: dict[str, float]

    def totals(self) -> tuple[float, float, float]:
        return sum(self.forward.values()), sum(self.backward.values()), sum(self.weight.values())


def stage_cost(layers: int, layer: LayerCosts, first: bool, last: bool, edges: EdgeCosts,
               p2p_seconds: float, sharded: ShardedTraffic, streamed: tuple[float, float],
               split_backward: bool, c: TimeConstants) -> StageCost:
    """Assemble one stage from its layers, edges, sends and data-parallel / host traffic.
    `streamed` = host-to-device seconds of offloaded parameters (forward, backward)."""
    forward = {
        FORWARD: layers * layer.forward + (edges.embed_forward.seconds if first else 0.0)
        + (edges.head_forward.seconds if last else 0.0),
        TENSOR_PARALLEL: layers * layer.tp_forward + (edges.embed_tp if first else 0.0)
        + (edges.head_tp_forward if last else 0.0),
        CONTEXT_PARALLEL: layers * layer.cp_forward,
        PIPELINE_P2P: 0.0 if last else p2p_seconds,
    }
    weight_seconds = layers * layer.weight_matmul.seconds + (edges.head_weight.seconds if last else 0.0)
    backward_compute = layers * layer.backward + (edges.embed_backward.seconds if first else 0.0) \
        + (edges.head_backward.seconds if last else 0.0)
    backward = {
        BACKWARD: backward_compute - (weight_seconds if split_backward else 0.0),
        RECOMPUTE: layers * layer.recompute.seconds,
        TENSOR_PARALLEL: layers * (layer.tp_backward + layer.tp_recompute) + (edges.head_tp_backward if last else 0.0),
        CONTEXT_PARALLEL: layers * layer.cp_backward,
        PIPELINE_P2P: 0.0 if first else p2p_seconds,
    }
    weight = {BACKWARD: weight_seconds} if split_backward else {}
    compute_f = forward[FORWARD]
    # The backward's traffic hides behind the backward action's own compute: a split
    # backward's weight part runs later, in a separate action, so counting it in the window
    # while charging the exposure to the backward action moved time onto the pipeline's
    # dependency chain as the GPU got faster (a faster GPU made a zero-bubble step slower).
    compute_b = backward[BACKWARD] + backward[RECOMPUTE]
    # Offloaded parameters come from the host before they are gathered, and gradients go to
    # the host once reduced: per tensor the host copy and the collective run one after the
    # other, both prefetched behind the compute. Together they hide as one stream of their
    # summed seconds; the host traffic is charged what it adds to the collectives' exposure,
    # so a faster GPU never makes the action longer (tests/test_time_model.py).
    for side, compute, dp_seconds, host_seconds in ((forward, compute_f, sharded.forward, streamed[0]),
                                                    (backward, compute_b, sharded.backward, streamed[1])):
        if sharded.overlap:
            side[DATA_PARALLEL] = overlapped(compute, dp_seconds, c)
            side[OFFLOAD] = overlapped(compute, dp_seconds + host_seconds, c) - side[DATA_PARALLEL]
        else:
            side[DATA_PARALLEL] = dp_seconds
            side[OFFLOAD] = overlapped(compute, host_seconds, c)
    return StageCost(forward, backward, weight)


def p2p_seconds(tokens: int, hidden: int, e: int, tp: int, sp: bool, pp_link: Link, tp_link: Link) -> float:
    """One activation (or its gradient) to the neighbouring stage: 1/tp of it per rank, then
    an all-gather inside the tensor-parallel group (scatter/gather), unless sequence parallel
    already keeps it split."""
    size = float(tokens * hidden * e)
    if tp == 1:
        return point_to_point_seconds(size, pp_link)
    send = point_to_point_seconds(size / tp, pp_link)
    return send if sp else send + collective_seconds(ALL_GATHER, size, tp, tp_link)
