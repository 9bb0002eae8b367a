"""`shardplan estimate` against closed forms nobody here wrote, and its monotonicity."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import run_cli
from shardplan.core.activations import ActivationShape, stored_layer_terms
from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.memory import estimate_memory
from shardplan.spec.model import resolve_shape

GPT = dict(family="gpt2", num_layers=4, hidden_size=1024, num_heads=16, vocab_size=1000, max_seq_len=4096)


def gpt_shape(**changes):
    shape, problems = resolve_shape({**GPT, **changes})
    assert not problems
    return shape


# Korthikanti et al. 2022, section 4 (Table 2): activation bytes per layer with 16-bit
# activations, 1-byte dropout masks, eager attention.
def korthikanti(s, b, h, a, t, sp, recompute):
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":
        return 34 * s * b * h // t if sp else s * b * h * (10 + 24 // t) if 24 % t == 0 else None
    if sp:
        return s * b * h * (34 + 5 * a * s // h) // t
    return s * b * h * 10 + (24 * s * b * h + 5 * a * s * s * b) // t


# Sequence parallel needs tp > 1, and the paper gives full recomputation without it.
@pytest.mark.parametrize("t, sp, recompute", [(t, sp, recompute) for t in (1, 2, 4, 8) for sp in (False, True)
                                              for recompute in ("none", "selective", "full")
                                              if not (sp and t == 1) and not (sp and recompute == "full")])
@pytest.mark.parametrize("s, b", [(2048, 1), (4096, 2)])
def test_per_layer_activations_equal_korthikanti(t, sp, recompute, s, b):
    h, a = 1024, 16
    act = ActivationShape(gpt_shape(), micro_batch=b, seq_len=s, tp=t, sequence_parallel=sp,
                          recompute=recompute, attention="eager", dropout=True, act_bytes=2)
    expected = korthikanti(s, b, h, a, t, sp, recompute)
    assert sum(term.bytes for term in stored_layer_terms(act)) == expected


def test_flash_and_no_dropout_drop_their_terms():
    base = dict(micro_batch=1, seq_len=2048, attention="eager", dropout=True, act_bytes=2)
    eager = sum(t.bytes for t in stored_layer_terms(ActivationShape(gpt_shape(), **base)))
    s, b, h, a = 2048, 1, 1024, 16
    no_dropout = sum(t.bytes for t in stored_layer_terms(ActivationShape(gpt_shape(), **{**base, "dropout": False})))
    # Without dropout: no masks (2sbh + as^2b) and no separate dropout output (2as^2b).
    assert eager - no_dropout == 2 * s * b * h + 3 * a * s * s * b
    flash = sum(t.bytes for t in stored_layer_terms(ActivationShape(gpt_shape(), **{**base, "attention": "flash"})))
    # Flash keeps no score matrix (5as^2b) but an fp32 log-sum-exp per head and token.
    assert eager - flash == 5 * a * s * s * b - 4 * a * s * b


# A GPT model in a job file, tp 4, eager attention, 2048 tokens; `{zero}` fills [zero].
GPT_JOB = """
[model]
family = "gpt2"
num_layers = 4
hidden_size = 1024
num_heads = 16
vocab_size = 1000
max_seq_len = 4096
dropout = 0.1
[parallel]
tp = 4
sequence_parallel = {sp}
[zero]
{zero}
[train]
seq_len = 2048
attention = "eager"
"""


def _layer_bytes(write, sp: bool, zero: str) -> int:
    job = write("gpt.toml", GPT_JOB.format(sp=str(sp).lower(), zero=zero))
    result = run_cli("estimate", job, "--explain", "--json")
    assert result.code == 0, result.err
    terms = result.json["devices"][0]["terms"]["gpu.activations"]
    return next(t for t in terms if t["label"] == "layers of stage 0")["bytes"]


def test_cli_layer_term_is_korthikanti(write):
    # FSDP2 mixed precision at stage 3: 16-bit activations throughout, as the paper assumes.
    s, b, h, a, t = 2048, 1, 1024, 16, 4
    assert _layer_bytes(write, False, "stage = 3") == 4 * korthikanti(s, b, h, a, t, False, "none")


@pytest.mark.parametrize("framework", ["deepspeed", "fsdp2"])
def test_cli_sequence_parallel_layer_term(framework, write):
    # Both accountings give the paper's (sbh/t)(34 + 5as/h) (CONTRACT). Under fsdp2 a warning
    # adds what torch's DTensor plan keeps beyond it: the QKV and MLP inputs gathered,
    # 2 * (sbh - sbh/t) * 2 B per layer and microbatch.
    zero = f'framework = "{framework}"\nstage = {3 if framework == "fsdp2" else 1}'
    s, b, h, a, t = 2048, 1, 1024, 16, 4
    assert _layer_bytes(write, True, zero) == 4 * korthikanti(s, b, h, a, t, True, "none")
    warnings = run_cli("estimate", str(write("gpt.toml", GPT_JOB.format(sp="true", zero=zero))), "--json").json["warnings"]
    gathered = 2 * (s * b * h - s * b * h // t) * 2
    said = [w for w in warnings if "gathered QKV and MLP inputs" in w]
    if framework == "fsdp2":
        assert len(said) == 1 and f"{gathered // 2**20:.1f} MiB more per layer" in said[0], warnings
    else:
        assert said == []


@pytest.mark.parametrize("threshold, persistent", [(4096, True), (4095, False)])
def test_deepspeed_stage3_keeps_tensors_up_to_the_threshold_whole(threshold, persistent):
    """DeepSpeed marks a parameter persistent when `param.ds_numel <=
    Init.param_persistence_threshold` (deepspeed/runtime/zero/partition_parameters.py line
    1292; parameter_offload.py `mark_persistent_parameters`): kept whole after its first
    gather, besides its partition. llama-3-8b's 65 RMSNorm weights have 4,096 elements each
    (transformers LlamaRMSNorm over hidden_size 4096); every other tensor is far larger."""
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--dp", "8", "--zero", "3",
                     "--framework", "deepspeed", "--set", f"zero.param_persistence_threshold={threshold}",
                     "--json", "--explain")
    assert result.code == 0, result.err
    terms = result.json["devices"][0]["terms"]["gpu.params"]
    whole = [t["bytes"] for t in terms if t["label"].startswith("persistent parameters")]
    partitions = [t["bytes"] for t in terms if t["label"].startswith("16-bit parameter partitions")]
    assert whole == ([65 * 4096 * 2] if persistent else [])
    # Llama-3 8B's 8,030,261,248 parameters (transformers' count, tests/test_params.py) divide by
    # 8: no padding.
    assert partitions == [2 * 8_030_261_248 // 8]


def _inputs(**changes):
    base = dict(shape=gpt_shape(num_layers=8), params=None, degrees=Degrees(dp=2), seq_len=1024,
                micro_batch=2, zero_stage=3, gpus_per_node=8)
    base.update(changes)
    return EstimateInputs(**base)


def _peak(inputs):
    """Model states held through the step (GPU and host) and the saved activations."""
    device = estimate_memory(inputs).devices[0]
    states = {kind: device.states[kind] + device.cpu[kind] for kind in ("params", "grads", "optimizer")}
    return {**states, "activations": device.saved_activations}


@settings(max_examples=60, deadline=None)
@given(stage=st.integers(1, 3), framework=st.sampled_from(["fsdp2", "deepspeed", "zero-paper"]),
       dp=st.sampled_from([1, 2, 3, 4, 8, 16]), precision=st.sampled_from(["bf16-mixed", "fp32"]))
def test_model_states_never_grow_with_dp(stage, framework, dp, precision):
    small = _peak(_inputs(degrees=Degrees(dp=dp), zero_stage=stage, framework=framework, precision=precision))
    large = _peak(_inputs(degrees=Degrees(dp=2 * dp), zero_stage=stage, framework=framework, precision=precision))
    # DeepSpeed pads each flat group (two: matrices and vectors) to a multiple of 2*dp
    # elements (stage_1_and_2.py, nccl_start_alignment_factor = 2): its replicated 16-bit
    # buffer may grow by that padding when dp doubles, and nothing else may grow.
    padding = 2 * 2 * (2 * dp) * 4 if framework == "deepspeed" and stage < 3 else 0
    for kind in ("params", "grads", "optimizer"):
        assert large[kind] <= small[kind] + (padding if kind == "params" else 0), kind


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), stage=st.integers(0, 3), sp=st.booleans(),
       recompute=st.sampled_from(["none", "selective", "full"]))
def test_memory_never_grows_with_tp(tp, stage, sp, recompute):
    one = _peak(_inputs(degrees=Degrees(dp=2, tp=tp), zero_stage=stage, sequence_parallel=sp, recompute=recompute))
    two = _peak(_inputs(degrees=Degrees(dp=2, tp=2 * tp), zero_stage=stage, sequence_parallel=sp, recompute=recompute))
    for kind in ("params", "grads", "optimizer", "activations"):
        assert two[kind] <= one[kind], kind


@settings(max_examples=40, deadline=None)
@given(tp=st.sampled_from([1, 2, 4]), attention=st.sampled_from(["flash", "eager"]), dropout=st.booleans(),
       pp=st.sampled_from([1, 2, 4]))
def test_recomputation_never_adds_memory(tp, attention, dropout, pp):
    peaks = [
        _peak(_inputs(degrees=Degrees(dp=2, tp=tp, pp=pp), recompute=r, attention=attention, dropout=dropout,
                      num_microbatches=8))["activations"]
        for r in ("none", "selective", "full")
    ]
    assert peaks[0] >= peaks[1] >= peaks[2]


def test_exit_1_when_it_does_not_fit(write):
    job = write("big.toml", '[model]\npreset = "llama-3-70b"\n[cluster]\npreset = "a100-40gb"\nnodes = 1\n'
                            '[parallel]\ndp = 8\n[offload]\nstrategy = "conservative"\n')
    result = run_cli("estimate", job, "--json")
    assert result.code == 1, result.err
    assert result.json["fits"] is False
    assert "does not fit" not in result.err and "more than its" in result.err


def test_unknown_limits_give_null_fit():
    result = run_cli("estimate", "--set", "model.preset=gpt2", "--json")
    assert result.code == 0 and result.json["fits"] is None


def test_params_only_has_no_activations():
    result = run_cli("estimate", "--params", "7.5B", "--dp", "4", "--zero", "1", "--framework", "zero-paper", "--json")
    device = result.json["devices"][0]
    assert device["gpu"]["activations"] == 0
    # ZeRO-1 (Rajbhandari et al. 2020, section 5.1 and Figure 1: P_os, (2 + 2 + K/N_d) psi with
    # K = 12): 16-bit parameters and gradients whole, the 12 bytes of optimizer states / N_d.
    assert device["gpu"]["params"] + device["gpu"]["grads"] + device["gpu"]["optimizer"] == \
        (2 + 2) * 7_500_000_000 + 12 * 7_500_000_000 // 4


@pytest.mark.parametrize("flags, path", [(("--framework", "deepspeed", "--zero", "2"), "zero.framework"),
                                         (("--framework", "deepspeed", "--zero", "0"), "zero.framework"),
                                         (("--zero", "1"), "zero.stage")])
def test_a_bare_count_is_refused_where_the_tensors_decide(flags, path):
    """DeepSpeed's partitions and buckets follow the tensors (stage_1_and_2.py
    `copy_grads_in_partition`: each parameter's whole gradient where it overlaps the partition),
    and so does ZeroRedundancyOptimizer (whole parameters to ranks): a bare count has none.
    Counted as one tensor, ZeRO-2 sharded no gradient; the refusal names the way on, and the
    ZeRO paper's formulas answer the same question (stage 2: 2 + 2/N_d + 12/N_d bytes per
    parameter, Rajbhandari et al. 2020, section 5.2)."""
    result = run_cli("estimate", "--params", "6738415616", "--dp", "8", *flags, "--json")
    assert result.code == 2
    (problem,) = result.json["error"]["problems"]
    assert problem["path"] == path and 'zero.framework = "zero-paper"' in problem["message"]
    paper = run_cli("estimate", "--params", "6738415616", "--dp", "8", "--zero", "2", "--framework", "zero-paper",
                    "--json").json["devices"][0]["gpu"]
    numel = 6738415616
    # The flat buffer padded to nccl_start_alignment_factor (2) x N_d elements, as DeepSpeed
    # aligns it (stage_1_and_2.py, flatten_dense_tensors_aligned).
    padded = -(-numel // 16) * 16
    assert paper["params"] + paper["grads"] + paper["optimizer"] == 2 * numel + (2 + 12) * padded // 8


def test_a_bare_count_under_fsdp2_builds_nothing_at_start_up():
    """`run` builds a model a layer at a time before sharding it; a bare count has no layers
    to build, and the host figure is the runtime allowance alone (it was the whole model in
    fp32 on every rank: 200 GiB a node for 6.7B parameters on 8 GPUs)."""
    result = run_cli("estimate", "--params", "6738415616", "--dp", "8", "--zero", "3", "--json")
    assert result.code == 0
    assert result.json["host"]["breakdown"] == {"runtime per process (allowance)": 8 * 2 * 2**30}
    assert "the model `run` builds at start-up" in result.err
    # With the GPU known, the missing time is said (docs/time.md: a bare count has no
    # architecture to time); without it, nothing is (there is no time to miss).
    timed = run_cli("estimate", "--params", "6738415616", "--dp", "8", "--zero", "3", "--set",
                    "cluster.preset=h100-80gb", "--json")
    assert "time" not in timed.json and "no architecture: no step time" in timed.err
    assert "no step time" not in result.err


@pytest.mark.parametrize("schedule, virtual", [("1f1b", 1), ("zero-bubble", 1), ("interleaved-1f1b", 1),
                                               ("interleaved-1f1b", 2), ("interleaved-1f1b", 3)])
@pytest.mark.parametrize("pp", [2, 3, 4, 6, 8])
def test_capped_walk_finds_the_same_peak(schedule, pp, virtual):
    # The estimate walks at most pp * (virtual + 2) microbatches of a 1F1B-like order; walking
    # every microbatch must give the same held counts at the peak.
    from shardplan.core.estimate import held_peak, walked_microbatches
    from shardplan.core.schedule import rank_order

    from shardplan.core.schedule import interleaved_problem

    # interleaved-1f1b also every count torch's rounds take that is not a multiple of pp
    # (torch 2.13 ScheduleInterleaved1F1B: max(1, m // pp) rounds that must divide m).
    counts = range(pp, 6 * pp * (virtual + 2) + 1, pp)
    if schedule == "interleaved-1f1b":
        counts = [m for m in range(1, pp * pp + 6 * pp * (virtual + 2)) if not interleaved_problem(pp, m)]
        flex = [m for m in counts if m % pp]
        assert flex or pp == 2
        # with more than virtual + 2 such rounds the walk is capped (the case it must get right)
        assert pp < virtual + 4 or any(walked_microbatches(schedule, pp, m, virtual) < m for m in flex)
    for microbatches in counts:
        walked = walked_microbatches(schedule, pp, microbatches, virtual)
        for rank in range(pp):
            stages = range(rank, pp * virtual, pp)
            weights = {s: 1000 + 7 * s for s in stages}
            release = "W" if schedule == "zero-bubble" else "B"
            full = held_peak(tuple(rank_order(schedule, pp, microbatches, virtual, rank)), weights, release)
            capped = held_peak(tuple(rank_order(schedule, pp, walked, virtual, rank)), weights, release)
            assert capped == full, (microbatches, rank)


@pytest.mark.parametrize("pp", [2, 3, 4, 5, 8, 16])
def test_one_f_one_b_holds_pp_minus_rank_at_its_peak(pp):
    # held_at_peak answers 1F1B with one stage per rank in closed form, min(pp - r, m)
    # (Narayanan et al. 2021, section 2.2); walking torch's order (core/schedule.py, the
    # shape of `_get_1f1b_rank_ops`) with the walk's single-stage weight must find the same
    # count, whatever the stage's bytes, and fewer microbatches than stages stay refused.
    from shardplan.core.estimate import held_at_peak
    from shardplan.core.schedule import ScheduleInputError, held_peak, rank_order

    for microbatches in list(range(pp, 3 * pp + 2)) + [64, 97]:
        for rank in range(pp):
            walked = held_peak(tuple(rank_order("1f1b", pp, microbatches, 1, rank)), {rank: 1}, "B")[1]
            for amount in (0, 1, 4096):
                assert held_at_peak("1f1b", pp, microbatches, 1, rank, {rank: amount}) == walked, (microbatches, rank)
            assert walked == {rank: min(pp - rank, microbatches)}
    with pytest.raises(ScheduleInputError):
        held_at_peak("1f1b", pp, pp - 1, 1, 0, {0: 4096})


def test_plans_beyond_the_drawing_limits_are_estimated():
    # `schedule` refuses to draw these (too many cells); the estimate still answers.
    result = run_cli("estimate", "--set", "model.preset=llama-3-8b", "--pp", "1",
                     "--set", "parallel.num_microbatches=16000000", "--json")
    assert result.code == 0, result.err
    result = run_cli("estimate", "--set", "model.preset=llama-3.1-405b", "--pp", "126",
                     "--set", "parallel.num_microbatches=100000", "--json")
    assert result.code == 0, result.err


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit", "sgd"])
def test_stage_1_device_row_is_the_rank_holding_the_most(optimizer):
    """Under fsdp2's stage 1 ZeroRedundancyOptimizer gives whole tensors to ranks (balancing
    elements, torch's `_partition_parameters`), so rank 0 is not always the fullest and bytes
    do not follow elements (AdamW's step per tensor, AdamW8bit's plain small tensors): the
    device row is the rank whose optimizer states take the most bytes, found by estimating
    every rank at its own coordinates."""
    from shardplan.core.estimate import Coordinates, rank_parts

    for name in ("tiny-gpt2", "gpt2"):
        shape, problems = resolve_shape(_preset(name))
        assert not problems
        for dp in range(2, 10):
            inputs = _inputs(shape=shape, degrees=Degrees(dp=dp), zero_stage=1, optimizer=optimizer)
            every = [sum(t.bytes for t in rank_parts(inputs, Coordinates(shard_index=i)).gpu["optimizer"])
                     for i in range(dp)]
            shown = estimate_memory(inputs).devices[0].states["optimizer"]
            assert shown == max(every), (name, optimizer, dp, every)


def _preset(name):
    from shardplan.io.presets import find_preset
    from shardplan.io.files import read_document

    return read_document(find_preset(name, "models", "model.preset").path).data["model"]


@pytest.mark.parametrize("args, kept", [
    (("llama-3-8b-h100",), False),  # `run` at pp = 1 frees the logits (docs/estimate.md, "Embedding, head and loss")
    (("llama-2-70b-3d",), True),  # a pipeline stage keeps its output for its backward
    (("llama-3-8b-h100", "--framework", "deepspeed"), True),  # transformers' output, held by the loop
])
def test_logits_assumption_says_what_the_estimate_counts(args, kept):
    """`assumptions.logits_and_loss` says the 16-bit logits are kept exactly when the
    estimate counts them (the term `logits, held by the training loop until backward`)."""
    doc = run_cli("estimate", *args, "--json").json
    counted = "logits, held by the training loop" in run_cli("estimate", *args, "--explain").out
    assert counted == kept
    assert ("freed before backward" in doc["assumptions"]["logits_and_loss"]) == (not kept)
