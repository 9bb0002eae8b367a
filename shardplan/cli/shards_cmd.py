"""`shardplan shards [FILE] [--world N] [--numel N] [--style S] [--blocks N --assign A]`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Optional

import typer

from ..core.layout import Layout, shard_group_size
from ..core.schedule import chunks_per_rank
from ..core.shards import ASSIGNMENTS, STYLES, assign_blocks, chunk_size, ownership, shard_ranges
from ..core.estimate_inputs import lora_plan
from ..core.shards_model import (
    Storage, assign_params, dtype_name, model_shards, param_element_bytes, placed_params, whole_param_bytes,
)
from ..io.job import ResolvedJob
from ..render.output import write_document
from ..render.output import emit_diagnostics, stdout_console
from ..render.shards import (
    blocks_document, blocks_text, model_document, model_text, numel_document, numel_text,
    param_blocks_document, param_blocks_text,
)
from ..spec.common import MAX_WORLD_SIZE
from ..spec.errors import InputError, Problem
from ..spec.units import parse_count
from .options import JsonFlag, PlanFlags, plan_flags

# More blocks than this is a typing mistake, not an optimizer (same bound as the world).
MAX_BLOCKS = MAX_WORLD_SIZE


# (parameter, rank) rows a model listing holds: 2^22 takes about 20 s and 3 GB to build (Llama
# 3.1 405B over 2,048 ranks is 2.3M; a million ranks of any model would exhaust the memory).
MAX_SHARD_ROWS = 2**22


def default_style(resolved: ResolvedJob) -> str:
    """The job's own framework: fsdp2 -> fsdp2; deepspeed and zero-paper -> zero3 at stage 3, else zero12."""
    zero = resolved.job.zero
    if zero.framework == "fsdp2":
        return "fsdp2"
    return "zero3" if zero.stage == 3 else "zero12"


@dataclass(frozen=True)
class StageView:
    """What a job's ZeRO stage shards when it does not shard parameters by dim 0 or flat."""

    note: str
    assign: str | None = None  # whole parameters owned by one rank each
    world: int | None = None  # the shard group shown (1: nothing is sharded)


def stage_view(resolved: ResolvedJob) -> StageView | None:
    """Stage 0 shards nothing; FSDP2's stage 1 (DDP with torch's ZeroRedundancyOptimizer)
    keeps parameters and gradients whole and gives each parameter's optimizer states to one
    rank (core/states.py): `shards` of such a job shows that, as `estimate` counts it.
    DeepSpeed's stages 1 and 2 cut one flat buffer (the `zero12` style) of the states they
    shard, not of the 16-bit parameters: a note says so."""
    zero = resolved.job.zero
    group = default_world(resolved)
    if zero.stage == 0:
        if group == 1:
            return None
        return StageView(f"zero.stage = 0 shards nothing: each of the {group} ranks of the shard group holds "
                         "every parameter whole (shown over 1 rank)", world=1)
    if zero.stage == 1 and zero.framework == "fsdp2":
        note = ("zero.stage = 1 under fsdp2 is DDP with torch's ZeroRedundancyOptimizer: parameters "
                "and gradients stay whole on every rank, and each whole parameter's optimizer states "
                "live on one rank (shown: --assign zero-optimizer)")
        if resolved.job.lora is not None:
            note += ("; under LoRA only the adapters have optimizer states, so the partition is over them "
                     "(the frozen base stays whole on every rank); `shardplan run` refuses LoRA at "
                     "zero.stage 1 (use 0, 2 or 3): this is the estimate's view")
        return StageView(note, assign="zero-optimizer")
    if zero.stage in (1, 2) and zero.framework == "deepspeed":
        held = "fp32 master weights and optimizer states" if zero.stage == 1 else \
            "gradients, fp32 master weights and optimizer states"
        return StageView(f"zero.stage = {zero.stage} under deepspeed keeps the 16-bit parameters whole on every "
                         f"rank; the flat partitions shown (one per optimizer parameter group) are how the {held} are split "
                         "(deepspeed/runtime/zero/stage_1_and_2.py)")
    return None


def default_world(resolved: ResolvedJob) -> int:
    """The job's ZeRO/FSDP shard group: dp * cp, or its node-local part with hybrid sharding."""
    job = resolved.job
    return shard_group_size(Layout(resolved.degrees, job.parallel.order, job.cluster.gpus_per_node), job.zero.hybrid)


def _show(document: dict, json_out: bool, text, note: str | None = None) -> None:
    """`note`: why the job's stage is shown this way (the JSON's `note` key, a last line)."""
    if note:
        document = {**document, "note": note}
    if json_out:
        write_document(document)
    else:
        stdout_console().print(text(document), soft_wrap=True)
        if note:
            stdout_console().print(f"note: {note}", soft_wrap=True, highlight=False, markup=False)


@plan_flags
def shards(
    file: Annotated[Optional[str], typer.Argument(help="job file (TOML or JSON) or job preset name")] = None,
    world: Annotated[
        Optional[int],
        typer.Option("--world", min=1, max=MAX_WORLD_SIZE, help="ranks sharing the tensor (default: the job's dp*cp)"),
    ] = None,
    numel_arg: Annotated[
        Optional[str], typer.Option("--numel", help="shard one flat tensor of N elements (e.g. 4096, 124M, 7.5B)")
    ] = None,
    style: Annotated[
        Optional[str], typer.Option("--style", help=f"{', '.join(STYLES)} (default: the job's framework)")
    ] = None,
    blocks: Annotated[
        Optional[int], typer.Option("--blocks", min=1, max=MAX_BLOCKS, help="number of equal blocks to assign")
    ] = None,
    assign: Annotated[
        Optional[str], typer.Option("--assign", help="contiguous, round-robin or zero-optimizer: owner of each block (or parameter)")
    ] = None,
    json_out: JsonFlag = False,
    *,
    flags: PlanFlags,
) -> None:
    """What each rank owns: ranges of a flat tensor, a model's parameters, or whole blocks."""
    problems = []
    numel = None
    if numel_arg is not None:
        try:
            numel = parse_count(numel_arg)
        except ValueError as exc:
            problems.append(Problem("--numel", str(exc)))
    if style is not None and style not in STYLES:
        problems.append(Problem("--style", f"unknown style {style!r} (one of {', '.join(STYLES)})"))
    if assign is not None and assign not in ASSIGNMENTS:
        problems.append(Problem("--assign", f"unknown assignment {assign!r} (one of {', '.join(ASSIGNMENTS)})"))
    if blocks is not None and assign is None:
        problems.append(Problem("--blocks", f"needs --assign ({', '.join(ASSIGNMENTS)})"))
    if numel is not None and (blocks is not None or assign is not None):
        problems.append(Problem("--numel", "cannot be combined with --blocks/--assign: one question at a time"))
    if assign is not None and style is not None:
        problems.append(Problem("--assign", "assigns whole blocks; --style cuts tensors: give one of them"))
    if problems:
        raise InputError(problems)

    # Cutting a flat tensor or assigning blocks needs no model and no pipeline: the job's
    # cross-field rules only warn then.
    standalone = numel is not None or blocks is not None
    resolved = flags.load(file, warn_only=(lambda _: True) if standalone else None)
    emit_diagnostics(resolved.warnings)
    view = None if standalone or style or assign or resolved.shape is None else stage_view(resolved)
    if view is not None:
        assign = view.assign
    if view is not None and view.world and world is not None:
        view = None  # --world asks for a cut over that many ranks: shown as asked
    shard_world = world if world is not None else (view.world if view and view.world else default_world(resolved))

    if blocks is not None:
        owners = assign_blocks(blocks, shard_world, assign)
        shares = ownership(owners, [1] * blocks, shard_world)
        _show(blocks_document(shard_world, assign, owners, shares), json_out, blocks_text)
        return
    chosen = style or default_style(resolved)
    if numel is not None:
        shards_ = shard_ranges(numel, shard_world, chosen)
        document = numel_document(numel, shard_world, chosen, chunk_size(numel, shard_world, chosen), shards_)
        _show(document, json_out, numel_text)
        return

    shape = resolved.shape
    if shape is None:
        what = "a bare parameter count (model.params) has no tensors" if resolved.params_only else "no model"
        raise InputError(Problem(
            "", f"nothing to shard: {what}; give --numel N, --blocks N --assign A, or a job with a model"
        ))
    job = resolved.job
    par = job.parallel
    virtual = chunks_per_rank(par.pipeline_schedule, par.virtual_stages)
    # tp rank 0 holds the largest tensor-parallel pieces (torch.chunk gives later ranks less).
    lora = lora_plan(job)  # LoRA: the base frozen (bf16 or NF4), the adapters trainable
    placed = placed_params(shape, par.pp, virtual, par.tp, tp_rank=0,
                           split=(par.first_stage_layers, par.last_stage_layers), lora=lora)
    element_bytes = param_element_bytes(job.train.precision, chosen, job.zero.framework)
    storage = Storage(element_bytes, dtype_name(job.train.precision, element_bytes), lora)
    model = resolved.model_name or shape.name or shape.family

    if assign is not None:
        # Whole parameters own optimizer states: only trainable ones have any (LoRA: the adapters).
        owned, shares = assign_params([p for p in placed if p.trainable], shard_world, assign, element_bytes)
        # Every rank holds every parameter whole only where the job's stage keeps them so (the
        # stage-1 view: DDP); an --assign asked of another stage says nothing about them.
        whole = whole_param_bytes(placed, storage) if view is not None and view.assign else None
        document = param_blocks_document(model, shard_world, assign, element_bytes, owned, shares,
                                         whole, storage.dtype,
                                         lora.base_dtype if lora else None)
        _show(document, json_out, param_blocks_text, view and view.note)
        return
    rows = len(placed) * shard_world
    if rows > MAX_SHARD_ROWS:
        raise InputError(Problem("--world" if world is not None else "parallel.dp",
                                 f"{len(placed):,} parameters x {shard_world:,} ranks = {rows:,} shards, more than "
                                 f"the {MAX_SHARD_ROWS:,} a model listing holds: give --numel N to cut one tensor, "
                                 "or a smaller --world"))
    # DeepSpeed has no min_num_params (the estimate ignores it there); its stage 3 keeps small
    # parameters whole besides their partitions (stage3_param_persistence_threshold).
    deepspeed = job.zero.framework == "deepspeed"
    persistent = job.zero.param_persistence_threshold if deepspeed and job.zero.stage == 3 and chosen == "zero3" else None
    plan = model_shards(placed, shard_world, chosen, element_bytes,
                        min_numel=0 if deepspeed else job.zero.min_num_params, storage=storage,
                        persistent_at_most=persistent,
                        # The ZeRO paper's formulas flatten every parameter into one buffer.
                        optimizer_groups=job.zero.framework != "zero-paper")
    context = {"model": model, "tp": par.tp, "tp_rank": 0, "pp": par.pp, "precision": job.train.precision,
               "persistent_at_most": persistent}
    _show(model_document(context, plan), json_out, lambda _: model_text(context, plan, shape.num_layers),
          view and view.note)


def register(app: typer.Typer) -> None:
    app.command("shards")(shards)
