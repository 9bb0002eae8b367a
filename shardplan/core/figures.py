"""The planner's numbers for one rank: every moment's GPU bytes and the rank's host bytes.

The same parts as the explained estimate (core/estimate.py `rank_parts`), added up as
integers: each part is computed once per narrow key by the functions that build the
explained terms, and only its byte total is kept here. A search evaluates tens of thousands
of plans; this is what it calls (core/memory.py `plan_figures`), and
tests/test_plan_figures.py holds it equal to the explained estimate over random plans.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from functools import lru_cache
from types import MappingProxyType

from .activations import ActivationShape, kept_logits_terms
from .buffers import CUDA_CONTEXT_BYTES, FRAGMENTATION
from .estimate import (
    PRESENT,
    Coordinates,
    _activation_shape,
    _deepspeed,
    _embedding_terms,
    _first_layer_bytes,
    _head_terms,
    _layer_bytes,
    _lora,
    _loss_terms,
    _rank_params,
    _recompute_terms,
    _torch_or_paper,
    accumulates_in_backward,
    fullest_shard_index,
    held_at_peak,
    kept_blocks_bytes,
    last_layer_backward,
    layer_grads_bytes,
    resident_layers,
    shard_degree,
    torch_or_paper_states,
)
from .estimate_inputs import EstimateInputs
from .host import checkpoint_staging, rank_host, startup_host
from .precision import element_bytes
from .schedule import ALL_FORWARDS_FIRST
from .degrees import Degrees
from .stages import RankParams
from .timeline import BACKWARD, BACKWARD_END, FORWARD, LOSS, MOMENTS


@dataclass(frozen=True)
class RankFigures:
    """One rank's moment totals (allowances included) and host bytes (training, start-up)."""

    moments: dict[str, int]
    host: int
    startup: int


_ONE = Degrees()
_PIPELINED = Degrees(pp=2)


def _sum(terms) -> int:
    return sum(t.bytes for t in terms)


@lru_cache(maxsize=4096)
def _framework(inputs: EstimateInputs, rp: RankParams, degree: int, resident: int) -> tuple:
    """(GPU params + optimizer, gradients at each moment, buffers at each moment, host while
    training) of the framework's part, as byte totals."""
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    index = fullest_shard_index(inputs, rp, degree)
    if inputs.lora is not None and inputs.shape is not None:
        memory, host = _lora(inputs, rp, eb, degree, index, resident)
    elif inputs.framework == "deepspeed":
        memory, host = _deepspeed(inputs, rp, degree, index)
    else:
        memory = _torch_or_paper(inputs, rp, eb, degree, index, resident)
        host = rank_host(inputs, rp, eb, degree, resident, memory.cpu, memory.host_groups)
    fixed = _sum(memory.gpu["params"]) + _sum(memory.gpu["optimizer"])
    grads = {m: _sum(memory.grads_at[m]) for m in MOMENTS}
    buffers = {m: _sum(memory.buffers_at[m]) for m in MOMENTS}
    return (fixed, grads, buffers, _sum(host) + _sum(checkpoint_staging(inputs, rp, degree)),
            layer_grads_bytes(memory.grads_at[BACKWARD_END]), kept_blocks_bytes(inputs, memory.buffers_at[BACKWARD]))


# What `_framework_key` sets to fixed values, beside the degrees (pipelined or not) and the
# microbatches (one, or more than one).
_KEY_FIXED = dict(order="tp-cp-dp-pp", gpus_per_node=8, micro_batch=1, seq_len=1, schedule="1f1b", virtual=1,
                  stage_split=(0, 0), sequence_parallel=False, recompute="none", attention="flash", loss="fp32",
                  dropout=False, gpu_memory=None, cpu_memory_per_node=None, strategy="balanced",
                  resident_layers=None, hybrid=False)
_KEY_KEPT = tuple(f.name for f in fields(EstimateInputs) if f.name not in (*_KEY_FIXED, "degrees", "num_microbatches"))
_KEYS: dict[tuple, EstimateInputs] = {}  # the kept values -> the one key instance with them


def _framework_key(inputs: EstimateInputs) -> EstimateInputs:
    """The inputs with what the framework's part does not read set to fixed values, so plans
    that differ only in their activations share it: `_torch_or_paper`, `_deepspeed`,
    `rank_host` and `checkpoint_staging` read the framework, stage, precision, optimizer,
    offload, the DeepSpeed knobs, whether microbatches accumulate, whether there is an
    architecture, whether stages pipeline (the offload engine's gradient staging, core/host.py;
    FSDP2's deferred reduction, core/buffers.py) and whether every forward runs first;
    the rank's parameters and shard degree come beside the key. One instance per distinct key
    (the caches keyed on it then find it by identity), kept on the instance asked about too
    (every stage of a plan asks for it; `with_` drops it from copies)."""
    values = inputs.__dict__
    cached = values.get("_framework_key")
    if cached is not None:
        return cached
    pipelined, accumulates = inputs.degrees.pp > 1, min(inputs.num_microbatches, 2)
    forwards_first = pipelined and inputs.schedule in ALL_FORWARDS_FIRST
    token = (pipelined, accumulates, forwards_first, *map(values.__getitem__, _KEY_KEPT))
    key = _KEYS.get(token)
    if key is None:
        if len(_KEYS) >= 4096:
            _KEYS.clear()
        key = _KEYS[token] = inputs.with_(degrees=_PIPELINED if pipelined else _ONE, num_microbatches=accumulates,
                                          **{**_KEY_FIXED, "schedule": "gpipe" if forwards_first else "1f1b"})
    values["_framework_key"] = key
    return key


@lru_cache(maxsize=4096)
def _act_sums(act: ActivationShape) -> tuple[int, int, int, int, int, int]:
    """(per layer, embedding edge, head edge, recompute working set, loss gradient, kept
    logits) byte totals of one microbatch."""
    return (_layer_bytes(act), _sum(_embedding_terms(act)), _sum(_head_terms(act)), _sum(_recompute_terms(act)),
            _sum(_loss_terms(act)), _sum(kept_logits_terms(act)))


def _framework_part(inputs: EstimateInputs, at: Coordinates):
    """(element bytes, rank parameters, resident layers, the framework's byte totals, start-up
    host bytes)."""
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    rp = _rank_params(inputs, at)
    degree = shard_degree(inputs)
    resident = resident_layers(rp, eb, inputs, degree)
    return eb, rp, resident, _framework(_framework_key(inputs), rp, degree, resident), _sum(startup_host(inputs, rp, eb))


def rank_host_figures(inputs: EstimateInputs, at: Coordinates) -> tuple[int, int]:
    """The rank's host bytes (training, start-up) of `rank_figures`, without its GPU moments:
    the host does not hold activations."""
    _, _, _, framework, startup = _framework_part(inputs, at)
    return framework[3], startup


def rank_figures(inputs: EstimateInputs, at: Coordinates) -> RankFigures:
    """The numbers `rank_estimate(inputs, at, ...)` reports, without its terms."""
    eb, rp, resident, (fixed, grads, buffers, host, layer_grads, kept_blocks), startup = _framework_part(inputs, at)
    act = None if inputs.shape is None else _activation_shape(inputs, eb)
    saved, in_backward, extra, has_loss = (0, 0, _NO_EXTRA, False) if act is None else _activation_part(
        act, inputs.schedule, inputs.degrees.pp, inputs.num_microbatches, inputs.virtual,
        at.pp_rank, rp.chunk_layers, rp.has_head, inputs.framework == "deepspeed")
    if act is not None:
        sweep = last_layer_backward(inputs, rp, resident, layer_grads, _layer_bytes(act), grads[BACKWARD], kept_blocks)
        if sweep is not None:
            freed, blocks_freed, produced = sweep
            in_backward -= freed
            if produced is not None:
                grads = {**grads, BACKWARD: produced}
            buffers = {**buffers, BACKWARD: buffers[BACKWARD] - blocks_freed}
    totals = {}
    moments = PRESENT[has_loss, accumulates_in_backward(inputs)]
    for name in moments:
        tensors = fixed + grads[name] + buffers[name] + extra[name]
        tensors += saved if name in (FORWARD, LOSS) else in_backward if name == BACKWARD else 0
        totals[name] = tensors + (CUDA_CONTEXT_BYTES + int(tensors * FRAGMENTATION) if inputs.on_gpu else 0)
    return RankFigures(totals, host, startup)


_NO_EXTRA = MappingProxyType(dict.fromkeys(MOMENTS, 0))  # read-only: shared by every caller


@lru_cache(maxsize=8192)
def _activation_part(act: ActivationShape, schedule: str, pp: int, microbatches: int, virtual: int, pp_rank: int,
                     chunk_layers: tuple[int, ...], has_head: bool, deepspeed: bool) -> tuple[int, int, MappingProxyType, bool]:
    """(saved activations in forward and at the loss, in backward, each moment's transients,
    whether the rank computes the loss) of a rank: what its figures add to the framework's part,
    shared by the plans that differ only in their sharding or offload."""
    per_layer, embedding, head, recompute, loss, logits = _act_sums(act)
    stages = [pp_rank + chunk * pp for chunk in range(len(chunk_layers))] or [pp_rank]
    last_stage = pp * max(1, len(chunk_layers)) - 1
    # Under LoRA the first layer keeps less (no gradient flows into it).
    first = _first_layer_bytes(act) - per_layer if act.lora is not None and chunk_layers and chunk_layers[0] else 0
    stage_bytes = {}
    for stage, layers in zip(stages, chunk_layers or (0,)):
        stage_bytes[stage] = (layers * per_layer + (embedding + first if stage == 0 else 0)
                              + (head if stage == last_stage else 0))
    held = held_at_peak(schedule, pp, microbatches, virtual, pp_rank, stage_bytes)
    saved = sum(held[stage] * stage_bytes[stage] for stage in stage_bytes)
    head_held = held.get(last_stage, 0)
    in_backward = saved - head if has_head and head_held else saved
    extra = dict.fromkeys(MOMENTS, 0)
    extra[BACKWARD] += recompute
    if has_head:
        extra[LOSS] += loss
        if deepspeed or pp > 1:
            for moment in (FORWARD, LOSS, BACKWARD):
                extra[moment] += logits * head_held
    return saved, in_backward, MappingProxyType(extra), has_head  # cached: read-only for every caller


def rank_states_bytes(inputs: EstimateInputs, at: Coordinates) -> int:
    """The parameters and optimizer states the rank holds on its GPU through the step: a part
    of every moment (the search's lower bound). Under fsdp2 and zero-paper without LoRA, from
    the model states alone (`torch_or_paper_states`, what `_framework` adds up too), without
    the buffers and host memory a plan too big for its states never needs."""
    eb = element_bytes(inputs.framework, inputs.precision, inputs.optimizer)
    rp = _rank_params(inputs, at)
    degree = shard_degree(inputs)
    resident = resident_layers(rp, eb, inputs, degree)
    key = _framework_key(inputs)
    if inputs.lora is None and inputs.framework != "deepspeed":
        states = torch_or_paper_states(key, rp, eb, degree, fullest_shard_index(key, rp, degree), resident)
        return _sum(states.gpu["params"]) + _sum(states.gpu["optimizer"])
    return _framework(key, rp, degree, resident)[0]
