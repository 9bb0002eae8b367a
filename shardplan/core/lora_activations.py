"""Saved activations of a layer under LoRA: what autograd keeps when the base is frozen.

A linear y = x W^T saves its input x only to compute W's gradient; autograd's generated code
saves a tensor only for the gradients it will compute (`mm`'s derivative in
tools/autograd/derivatives.yaml: `self` is saved for `mat2`'s gradient, `mat2` for `self`'s),
so a frozen linear keeps nothing but its weight, a parameter. What a layer keeps then:

- the element-wise and attention operators on the path of the gradient keep what they always
  keep (norm inputs, Q, K, V and the attention output with flash's log-sum-exp, the gated
  MLP's gate and up outputs and the activation's output, dropout masks), since the gradient
  must flow back through them to the earlier layers' adapters;
- the linears' inputs are kept only where an adapter reads them: A (r x in) keeps its input,
  B keeps A's output (the rank-r intermediate, r * sb elements); without LoRA dropout the
  targets that read the same tensor (q/k/v: the norm output; gate/up: the second norm output)
  share it; with LoRA dropout each target has its own dropout (peft's `lora_dropout` module per
  layer), which keeps a 1-byte mask, and A keeps the dropout's output instead;
- the first layer's input comes from the frozen embedding and carries no gradient: its norm
  keeps nothing, and the operators before its first adapter keep nothing either. The frozen
  embedding keeps no token ids; the frozen head keeps no input (tests/test_lora_activations.py
  measures all of this with torch's saved-tensor hooks).

Widths follow tensor parallel as in core/activations.py: column-parallel targets read the whole
hidden state, row-parallel ones (o_proj, down_proj) their 1/t slice.
"""

from __future__ import annotations

from .activations import LSE_BYTES, MASK_BYTES, ActivationShape, _kv_width
from .params import POST_NORM_FAMILIES
from .terms import Term


def lora_layer_terms(act: ActivationShape, grad_in: bool = True) -> list[Term]:
    """Saved activations of one layer and microbatch under LoRA (`act.lora`); `grad_in`: the
    layer's input carries a gradient (every layer after the first)."""
    lora = act.lora
    assert lora is not None
    shape, e, t = act.shape, act.act_bytes, act.tp
    sb, h = act.tokens, shape.hidden_size
    rep, gdiv = act.replicated_div, act.gathered_div
    q_width = shape.num_heads * shape.head_dim // t
    kv_width = _kv_width(act)
    ffn = shape.ffn_hidden_size // t
    heads = shape.num_heads // t
    targets = set(lora.targets)
    terms: list[Term] = []

    def add(label: str, elements: int, unit: int, formula: str) -> None:
        if elements:
            terms.append(Term(label, elements * unit, lambda: f"{formula} = {elements:,} * {unit} B"))

    def adapter_inputs(names: list[str], width: int, what: str, formula: str, grad: bool) -> None:
        """A's input for the targets among `names`, reading one tensor of `width` per token
        (`grad`: that tensor carries a gradient, so a dropout on it keeps its mask)."""
        chosen = [n for n in names if n in targets]
        if not chosen:
            return
        if lora.dropout:
            for name in chosen:
                add(f"{name} LoRA dropout output", sb * width, e, f"sb*{formula}")
                if grad:
                    add(f"{name} LoRA dropout mask", sb * width, MASK_BYTES, f"sb*{formula}")
        else:
            add(f"{what} (read by the {'/'.join(chosen)} adapters)", sb * width, e, f"sb*{formula}")

    # Attention.
    if grad_in:
        add("attention norm input", sb * h // rep, act.residual_bytes, "sbh" + (f"/{rep}" if rep > 1 else ""))
    adapter_inputs(["q_proj", "k_proj", "v_proj"], h // gdiv, "QKV input (norm output)", "h", grad_in)
    attention = grad_in or bool(targets & {"q_proj", "k_proj", "v_proj"})
    if attention:
        add("Q, K", sb * (q_width + kv_width), e, "sb(h_q + h_kv)/t")
        add("V", sb * kv_width, e, "sb*h_kv/t")
        if act.attention == "eager" and act.recompute == "none":
            scores = act.micro_batch * heads * (act.seq_len // act.cp) * act.seq_len
            add("softmax output", scores, e, "(a/t)*s*s*b")
            if act.dropout:
                add("attention dropout mask", scores, MASK_BYTES, "(a/t)*s*s*b")
                add("attention dropout output", scores, e, "(a/t)*s*s*b")
        elif act.attention == "flash" and act.recompute == "none":
            add("flash log-sum-exp", heads * sb, LSE_BYTES, "(a/t)*sb")
    # The attention output: flash attention keeps it for its own backward; otherwise only the
    # o_proj adapter (without dropout) keeps it.
    if (attention and act.attention == "flash") or ("o_proj" in targets and not lora.dropout):
        add("attention projection input", sb * q_width, e, "sb*h_q/t")
    if "o_proj" in targets and lora.dropout:
        adapter_inputs(["o_proj"], q_width, "", "h_q/t", attention)
    attention_grad = attention or "o_proj" in targets
    post_norm = shape.family in POST_NORM_FAMILIES  # Gemma-2: a norm on each branch's output
    if post_norm and attention_grad:
        add("attention post-norm input", sb * h // rep, act.residual_bytes, "sbh" + (f"/{rep}" if rep > 1 else ""))
    if act.dropout and attention_grad:
        add("attention dropout mask (residual)", sb * h // rep, MASK_BYTES, "sbh")
    # MLP.
    mlp_in = grad_in or attention_grad
    if mlp_in:
        add("MLP norm input", sb * h // rep, act.residual_bytes, "sbh" + (f"/{rep}" if rep > 1 else ""))
    up_names = ["gate_proj", "up_proj"] if shape.gated else ["up_proj"]
    adapter_inputs(up_names, h // gdiv, "MLP input (norm output)", "h", mlp_in)
    up_grad = mlp_in or "up_proj" in targets
    if shape.gated:
        gate_grad = mlp_in or "gate_proj" in targets
        if gate_grad:
            add("MLP gate output (activation input)", sb * ffn, e, "sb*f/t")
            add("MLP up output", sb * ffn, e, "sb*f/t")
        if up_grad:
            add("MLP activation output", sb * ffn, e, "sb*f/t")
        hidden_grad = gate_grad or up_grad
    else:
        if up_grad:
            add("MLP activation input", sb * ffn, e, "sb*f/t")
        hidden_grad = up_grad
    adapter_inputs(["down_proj"], ffn, "MLP down input", "f/t", hidden_grad)
    if post_norm and (hidden_grad or "down_proj" in targets):
        add("MLP post-norm input", sb * h // rep, act.residual_bytes, "sbh" + (f"/{rep}" if rep > 1 else ""))
    if act.dropout and (hidden_grad or "down_proj" in targets):
        add("MLP dropout mask (residual)", sb * h // rep, MASK_BYTES, "sbh")
    # B's inputs: the rank-r intermediates.
    adapted = [name for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
               if name in targets]
    r = lora.rank
    add(f"LoRA intermediates (A x, rank {r}) of {len(adapted)} targets", len(adapted) * sb * r, e,
        f"{len(adapted)} * sb*r")
    return terms
