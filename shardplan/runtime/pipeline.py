"""Pipeline stages cut at the planner's layer split, and the torch schedule that runs them.

A stage is the full model with the other stages' layers deleted and the embedding / final
norm / head set to None where they do not belong, so parameter names stay those of the full
model (TORCH-NOTES). Rank r holds stages r, r + pp, ... (loop placement), the placement
torch's interleaved and looped schedules expect.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti

from ..core.stages import rank_stages

# The planner's schedule -> the torch schedule class that runs it (the report names it).
TORCH_SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "round-robin": ScheduleLoopedBFS,
    "zero-bubble": ScheduleInterleavedZeroBubble,
}


def stage_module(full: nn.Module, layers: range, first: bool, last: bool, tie_copy: bool) -> nn.Module:
    """A copy of `full` holding only `layers` (and the embedding / head when first / last)."""
    stage = copy.deepcopy(full)
    for name in list(stage.layers.keys()):
        if int(name) not in layers:
            del stage.layers[name]
    if not first:
        stage.embed = None
        stage.pos_embed = None
    if not last:
        stage.final_norm = None
        stage.lm_head = None
        stage.has_head = False
    elif tie_copy:
        # Tied embeddings over several stages: the last stage keeps its own copy of the
        # embedding matrix as the head, kept equal by summing the two gradients (Megatron-LM).
        weight = full.embed.weight
        head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device=weight.device, dtype=weight.dtype)
        head.weight.requires_grad_(weight.requires_grad)  # frozen under LoRA, as the embedding
        if not weight.is_meta:
            with torch.no_grad():
                head.weight.copy_(weight)
        # On the meta device the copy's values come from the embedding's when it is
        # materialized (runtime/model.py `materialize`, tied_head).
        stage.lm_head = head
    return stage


def build_stages(full: nn.Module, pp: int, virtual: int, pp_rank: int,
                 split: tuple[int, int] = (0, 0)) -> list[tuple[int, nn.Module]]:
    """(global stage index, module) for every stage this pipeline rank holds; `split`: the
    layers of the first and last stage (core/pipeline.py)."""
    last = pp * virtual - 1
    tie_copy = full.lm_head is None and pp > 1
    return [(index, stage_module(full, layers, index == 0, index == last, tie_copy))
            for index, layers in rank_stages(len(full.layers), pp, virtual, pp_rank, split)]


def build_schedule(kind: str, modules: list[tuple[int, nn.Module]], total_stages: int, microbatches: int,
                   device: torch.device, group: dist.ProcessGroup, loss_fn):
    """Wrap the stage modules in PipelineStages and the planner's schedule."""
    stages = [PipelineStage(module, index, total_stages, device, group=group) for index, module in modules]
    schedule_class = TORCH_SCHEDULES[kind]
    if issubclass(schedule_class, PipelineScheduleMulti):  # several stages per rank
        return schedule_class(stages, microbatches, loss_fn=loss_fn), schedule_class.__name__
    return schedule_class(stages[0], microbatches, loss_fn=loss_fn), schedule_class.__name__
