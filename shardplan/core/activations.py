"""Activation memory: the tensors saved for backward, per layer and microbatch.

Korthikanti et al. 2022, "Reducing Activation Recomputation in Large Transformer Models",
section 4: with s tokens, b sequences, hidden h, a heads, 16-bit activations and 1-byte
dropout masks, one GPT layer saves

    attention  11sbh + 5as^2b   (QKV input 2sbh, Q and K 4sbh, softmax 2as^2b, its dropout
                                 mask as^2b and output 2as^2b, V 2sbh, projection input 2sbh,
                                 dropout mask sbh)
    MLP        19sbh            (input 2sbh, GeLU input 8sbh and output 8sbh, mask sbh)
    norms       4sbh            (the two LayerNorm inputs)

= sbh(34 + 5as/h). Tensor parallel (t) splits all but 10sbh (norm inputs, QKV and MLP
inputs, dropout masks): sbh(10 + 24/t + 5as/(ht)); sequence parallel splits those too:
(sbh/t)(34 + 5as/h). Selective recomputation drops the 5as^2b term; full recomputation keeps
only the layer input, 2sbh.

The model's own shape replaces the paper's GPT assumptions term by term: K and V have
num_kv_heads * head_dim columns (GQA), a gated MLP (SwiGLU/GeGLU) saves four ffn-wide tensors
(gate output, activation output, up output, their product), an MoE layer routes each token to
k experts, `dropout = 0` keeps no masks, flash attention keeps no score matrix (only a fp32
log-sum-exp per head and token), and context parallel (cp) divides the tokens of a rank.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..spec.model import ModelShape, cached_hash
from .lora import LoraPlan
from .params import POST_NORM_FAMILIES
from .terms import Term

MASK_BYTES = 1  # dropout masks are bool tensors (Korthikanti et al. count 1 byte)
LSE_BYTES = 4  # flash attention keeps an fp32 log-sum-exp per head and query
INDEX_BYTES = 8  # token ids and routing indices are int64
LOSS_BYTES = 4  # the loss is computed in fp32: log-softmax output saved for backward


@dataclass(frozen=True)
class ActivationShape:
    """What decides activation sizes: the model and how the step is cut."""

    shape: ModelShape
    micro_batch: int
    seq_len: int
    tp: int = 1
    cp: int = 1
    sequence_parallel: bool = False
    recompute: str = "none"  # none | selective | full
    attention: str = "flash"  # flash | eager
    dropout: bool = False
    act_bytes: int = 2  # 2 for 16-bit activations, 4 for fp32
    # Mixed precision by autocast (DDP, fp32 parameters): the residual stream stays fp32, so
    # the norms keep fp32 inputs (and the full-recompute checkpoints are fp32), and every
    # linear layer keeps its own 16-bit cast of its input (autocast caches weight casts only).
    autocast: bool = False
    # Sequence parallel as torch's DTensor plan runs it (torchtitan: PrepareModuleInput gathers
    # the norm output before attention, the MLP and the head, and those linears keep the
    # gathered tensor). The estimate follows the paper (Megatron-LM keeps the sequence-sharded
    # tensor and gathers again in backward, Korthikanti et al. 2022, section 4.2.2; CONTRACT);
    # this variant quantifies what `shardplan run` keeps beyond it (docs/estimate.md).
    keeps_gathered: bool = False
    # The cross-entropy kernel: fp32 (torch's cross_entropy on logits upcast to fp32, which
    # transformers, torchtitan and `shardplan run` use) or fused (Megatron-LM's
    # vocab_parallel_cross_entropy, megatron/core/tensor_parallel/cross_entropy.py: the fp32
    # softmax is its only saved tensor and backward turns it into the gradient in place).
    loss: str = "fp32"
    # LoRA: the base is frozen, adapters train (core/lora_activations.py)
    lora: LoraPlan | None = None

    __hash__ = cached_hash  # planner caches key on this frozen value

    @property
    def residual_bytes(self) -> int:
        return 4 if self.autocast else self.act_bytes

    @property
    def tokens(self) -> int:
        """sb/cp: tokens of one microbatch on this rank (before sequence parallel)."""
        return self.micro_batch * self.seq_len // self.cp

    @property
    def replicated_div(self) -> int:
        """Divisor of the terms tensor parallel replicates: t with sequence parallel, else 1."""
        return self.tp if self.sequence_parallel else 1

    @property
    def gathered_div(self) -> int:
        """Divisor of the linear layers' inputs (norm outputs): 1 when the gathered tensor is kept."""
        return 1 if self.keeps_gathered else self.replicated_div


def _kv_width(act: ActivationShape) -> int:
    shape = act.shape
    kv_heads_local = max(1, shape.num_kv_heads // act.tp)
    return kv_heads_local * shape.head_dim


def layer_terms(act: ActivationShape, grad_in: bool = True) -> list[Term]:
    """Saved activations of one transformer layer for one microbatch, term by term (`grad_in`:
    its input carries a gradient, which matters only under LoRA)."""
    if act.lora is not None:
        from .lora_activations import lora_layer_terms

        return lora_layer_terms(act, grad_in)
    shape, e, t = act.shape, act.act_bytes, act.tp
    sb = act.tokens
    h = shape.hidden_size
    rep = act.replicated_div
    q_width = shape.num_heads * shape.head_dim // t
    kv_width = _kv_width(act)
    heads = shape.num_heads // t
    masks = act.dropout
    terms: list[Term] = []

    def add(label: str, elements: int, unit: int, formula: str) -> None:
        if elements:
            terms.append(Term(label, elements * unit, lambda: f"{formula} = {elements:,} * {unit} B"))

    parallel_block = shape.family == "falcon"
    sp = f"/{rep}" if rep > 1 else ""
    add("norm inputs", (1 if parallel_block else 2) * sb * h // rep, act.residual_bytes,
        f"{1 if parallel_block else 2} * sbh{sp}")
    if shape.family in POST_NORM_FAMILIES:  # Gemma-2's norms of the attention and MLP outputs
        add("post-norm inputs (attention and MLP outputs)", 2 * sb * h // rep, act.residual_bytes, f"2 * sbh{sp}")
    # Under autocast q, k and v each keep their own cast of the norm output.
    qkv_copies = 3 if act.autocast else 1
    gdiv = act.gathered_div
    gsp = f"/{gdiv}" if gdiv > 1 else ""
    add("QKV input (norm output)", qkv_copies * sb * h // gdiv, e,
        f"{qkv_copies} * sbh{gsp}" if act.autocast else f"sbh{gsp}")
    add("Q, K", sb * (q_width + kv_width), e, "sb(h_q + h_kv)/t")
    add("V", sb * kv_width, e, "sb*h_kv/t")
    if act.attention == "eager" and act.recompute == "none":
        scores = act.micro_batch * heads * (act.seq_len // act.cp) * act.seq_len
        add("softmax output", scores, e, "(a/t)*s*s*b")
        if masks:
            add("attention dropout mask", scores, MASK_BYTES, "(a/t)*s*s*b")
            add("attention dropout output", scores, e, "(a/t)*s*s*b")
    elif act.attention == "flash" and act.recompute == "none":
        add("flash log-sum-exp", heads * sb, LSE_BYTES, "(a/t)*sb")
    add("attention projection input", sb * q_width, e, "sb*h_q/t")
    if masks:
        add("attention dropout mask (residual)", sb * h // rep, MASK_BYTES, f"sbh{sp}")
    mlp_copies = 2 if act.autocast and shape.gated else 1  # gate and up each cast it
    if not parallel_block:
        add("MLP input (norm output)", mlp_copies * sb * h // gdiv, e, f"{mlp_copies} * sbh{gsp}")
    elif shape.shared_layer_norm is False:
        add("MLP input (second norm output)", sb * h // gdiv, e, f"sbh{gsp}")
    terms += _mlp_terms(act, sb, rep)
    if masks:
        add("MLP dropout mask (residual)", sb * h // rep, MASK_BYTES, f"sbh{sp}")
    return terms


def _mlp_terms(act: ActivationShape, sb: int, rep: int) -> list[Term]:
    shape, e, t = act.shape, act.act_bytes, act.tp
    h, f = shape.hidden_size, shape.ffn_hidden_size // t
    tensors = 4 if shape.gated else 2
    why = "gate, activation, up, product" if shape.gated else "activation input and output"
    if not shape.moe:
        return [Term(f"MLP ({why})", tensors * sb * f * e, lambda: f"{tensors} * sb*f/t = {tensors * sb * f:,} * {e} B")]
    k, experts = shape.experts_per_token, shape.num_experts
    routed = sb * k
    return [
        Term("router probabilities", sb * experts * 4, lambda: f"sb*E fp32 = {sb * experts:,} * 4 B"),
        Term("routing indices and weights", routed * (INDEX_BYTES + 4), lambda: f"sb*k * (8 + 4) B = {routed:,} * 12 B"),
        Term("expert inputs and outputs", 2 * routed * h * e, lambda: f"2 * sb*k*h = {2 * routed * h:,} * {e} B"),
        Term(f"expert MLPs ({why})", tensors * routed * f * e, lambda: f"{tensors} * sb*k*f/t = {tensors * routed * f:,} * {e} B"),
    ]


def _matmuls(act: ActivationShape) -> list[tuple[str, int]]:
    """A layer's matmuls in the order a Llama-style block runs them (q, k, v, o; gate, up,
    down), with the elements of each local output (row-parallel outputs are full-width
    partial sums before their reduction)."""
    shape, t, sb = act.shape, act.tp, act.tokens
    h, f = shape.hidden_size, shape.ffn_hidden_size // t
    q = shape.num_heads * shape.head_dim // t
    kv = _kv_width(act)
    out = [("q", sb * q), ("k", sb * kv), ("v", sb * kv), ("o", sb * h)]
    routed = sb * shape.experts_per_token if shape.moe else sb
    if shape.moe:
        out.append(("router", sb * shape.num_experts))
    if shape.gated:
        out += [("gate", routed * f), ("up", routed * f)]
    else:
        out.append(("up", routed * f))
    return out + [("down", routed * h)]


def op_saved_terms(act: ActivationShape) -> list[Term]:
    """What torchtitan's operator-level selective checkpointing keeps of a layer
    (torchtitan/models/llama3/parallelize.py, 2024-12: `_save_list` and
    `_get_custom_policy`): the checkpointed layer's input, the flash attention output with its
    log-sum-exp, and the output of every other matmul: the 1st, 3rd, 5th, ... of the block.
    Its counter restarts at every checkpointed forward: torchtitan builds it (`meta =
    defaultdict(int)`) inside the context_fn that torch's non-reentrant checkpoint calls each
    time (torch/utils/checkpoint.py), and saves a matmul unless its count is even."""
    shape, e = act.shape, act.act_bytes
    rep = act.replicated_div
    sb, h = act.tokens, shape.hidden_size
    terms = [Term("layer input (checkpointed)", sb * h // rep * act.residual_bytes,
                  lambda: f"sbh/{rep} = {sb * h // rep:,} * {act.residual_bytes} B")]
    mms = _matmuls(act)
    kept = [mm for i, mm in enumerate(mms) if i % 2 == 0]  # counts 1, 3, 5, ...: saved
    names = ", ".join(name for name, _ in kept)
    elements = sum(n for _, n in kept)
    terms.append(Term(f"every other matmul's output ({names})", elements * e,
                      lambda: f"{elements:,} * {e} B"))
    if act.attention == "flash":
        q_width = shape.num_heads * shape.head_dim // act.tp
        terms.append(Term("flash attention output", sb * q_width * e, lambda: f"sb*h_q/t = {sb * q_width:,} * {e} B"))
        heads = shape.num_heads // act.tp
        terms.append(Term("flash log-sum-exp", heads * sb * LSE_BYTES, lambda: f"(a/t)*sb = {heads * sb:,} * {LSE_BYTES} B"))
    return terms


def recompute_working_terms(act: ActivationShape) -> list[Term]:
    """Recomputation needs one layer's activations again during its backward: all of them
    under full recomputation, all but the kept operators' outputs under the operator policy,
    the score matrices under selective recomputation of eager attention."""
    if act.recompute == "op":
        full = sum(t.bytes for t in layer_terms(replace(act, recompute="none")))
        kept = sum(t.bytes for t in op_saved_terms(act))
        working = max(0, full - kept)
        return [Term("recomputed layer, less the kept outputs (one at a time)", working,
                     lambda: f"{full:,} B of one layer - {kept:,} B kept")]
    if act.recompute == "full":
        full = layer_terms(replace(act, recompute="none"))
        return [Term("recomputed layer (one at a time)", sum(t.bytes for t in full), "one layer, no recomputation")]
    if act.recompute == "selective" and act.attention == "eager":
        eager = layer_terms(replace(act, recompute="none"))
        scores = [t for t in eager if "softmax" in t.label or "attention dropout" in t.label and "residual" not in t.label]
        return [Term("recomputed attention scores (one layer)", sum(t.bytes for t in scores), "score terms of one layer")]
    return []


def stored_layer_terms(act: ActivationShape, grad_in: bool = True) -> list[Term]:
    """What one layer keeps between its forward and backward under the recompute policy."""
    if act.recompute == "op":
        return op_saved_terms(act)
    if act.recompute == "full":
        rep = act.replicated_div
        elements = act.tokens * act.shape.hidden_size // rep
        sp = f"/{rep}" if rep > 1 else ""
        return [Term("layer input (full recomputation)", elements * act.residual_bytes,
                     lambda: f"sbh{sp} = {elements:,} * {act.residual_bytes} B")]
    return layer_terms(act, grad_in)


def embedding_terms(act: ActivationShape) -> list[Term]:
    """First stage: token ids (the embedding backward's indices) and the embedding dropout mask.
    A frozen embedding (LoRA) keeps neither: nothing before it needs a gradient."""
    if act.lora is not None:
        return []
    terms = [Term("token ids", act.tokens * INDEX_BYTES, lambda: f"sb = {act.tokens:,} * {INDEX_BYTES} B")]
    if act.dropout:
        elements = act.tokens * act.shape.hidden_size // act.replicated_div
        terms.append(Term("embedding dropout mask", elements * MASK_BYTES, lambda: f"sbh = {elements:,} * 1 B"))
    return terms


def head_terms(act: ActivationShape) -> list[Term]:
    """Last stage: final norm input, head input, and the fp32 log-probabilities the loss keeps
    (vocabulary-parallel over tp), plus the targets."""
    sb, h, e = act.tokens, act.shape.hidden_size, act.act_bytes
    rep = act.replicated_div
    vocab_local = -(-act.shape.vocab_size // act.tp)
    # A frozen head (LoRA) keeps no input: only its weight is needed for the input's gradient.
    head_input = [] if act.lora is not None else [
        Term("output head input", sb * h // act.gathered_div * e,
             lambda: f"sbh = {sb * h // act.gathered_div:,} * {e} B")]
    return [
        Term("final norm input", sb * h // rep * act.residual_bytes,
             lambda: f"sbh = {sb * h // rep:,} * {act.residual_bytes} B"),
        *head_input,
        Term("log-probabilities (loss)" if act.loss == "fp32" else "softmax (fused cross entropy)",
             sb * vocab_local * LOSS_BYTES, lambda: f"sb*V/t fp32 = {sb * vocab_local:,} * {LOSS_BYTES} B"),
        Term("targets", sb * INDEX_BYTES, lambda: f"sb = {sb:,} * {INDEX_BYTES} B"),
    ]


def logit_elements(act: ActivationShape) -> int:
    """sb*V/t: the logits of one microbatch on this rank (vocabulary-parallel over tp)."""
    return act.tokens * -(-act.shape.vocab_size // act.tp)


def loss_backward_terms(act: ActivationShape) -> list[Term]:
    """Transient at the start of backward on the last stage, at its largest.

    fp32: log_softmax's backward holds the incoming fp32 gradient of the log-probabilities
    (nll_loss's backward writes a full sb*V/t tensor) and its fp32 result at once
    (aten log_softmax_backward_data); the cast back to the logits' dtype comes after the first
    is freed. fused: the gradient is computed in the saved softmax's place; only its cast to
    the logits' dtype is new."""
    elements = logit_elements(act)
    if act.loss == "fused":
        e = act.act_bytes
        return [Term("loss gradient (logits' dtype; fp32 part computed in place)", elements * e,
                     lambda: f"sb*V/t = {elements:,} * {e} B")]
    return [Term("loss gradient (fp32 input and output of log_softmax's backward)", elements * 2 * LOSS_BYTES,
                 lambda: f"sb*V/t * (4 + 4) B = {elements:,} * {2 * LOSS_BYTES} B")]


def kept_logits_terms(act: ActivationShape) -> list[Term]:
    """fp32 loss: the logits (the model's output, in the compute dtype) when something keeps
    them until backward ends (transformers returns them in the model output; torch's pipeline
    stages cache each stage's output for its backward). Not saved for backward: the upcast
    needs no input to differentiate."""
    if act.loss != "fp32":
        return []
    elements, e = logit_elements(act), act.act_bytes
    return [Term("logits, held by the training loop until backward", elements * e,
                 lambda: f"sb*V/t = {elements:,} * {e} B")]
