"""The plan as a DeepSpeed config JSON, and a DeepSpeed config as job-file tables.

Keys and defaults: DeepSpeed's config-json documentation (docs/_pages/config-json.md) and
its config classes, v0.19.8: deepspeed/runtime/config.py (batch arithmetic:
train_batch_size = train_micro_batch_size_per_gpu * gradient_accumulation_steps * data-parallel
world size, any two of the three given), deepspeed/runtime/zero/config.py
(`DeepSpeedZeroConfig`: stage, bucket sizes and their `stage3_*` aliases, sub_group_size),
deepspeed/runtime/pipe/engine.py (`PipelineEngine`: ZeRO stages 0-1 only), deepspeed/__init__.py
(`initialize`: a PipelineModule's topology gives the data-parallel size),
deepspeed/runtime/zero/offload_config.py (offload_optimizer / offload_param: device,
pin_memory), deepspeed/runtime/tensor_parallel/config.py (`tensor_parallel.autotp_size`).
"""

from __future__ import annotations

import json
import math
from typing import Collection

from ...core.pipeline import split_label, split_layers
from ...spec.job import ZeroSpec
from .common import AUTO, REFUSED, Exported, Imported, Note, Plan, Reader, offload_as_written, unexpressed
from .offload import Offload, fit_of, same, way_out

TARGET = "deepspeed"

# shardplan key -> DeepSpeed's zero_optimization key (the stage3_* names are the aliases
# DeepSpeed's docs use; the field names without the prefix are accepted too).
_BUCKETS = {
    "reduce_bucket_size": "reduce_bucket_size",
    "allgather_bucket_size": "allgather_bucket_size",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "max_live_parameters": "stage3_max_live_parameters",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "sub_group_size": "sub_group_size",  # no stage3_ alias (zero/config.py line 182)
}
# sub_group_size is handed to the stage 3 optimizer alone (runtime/engine.py line 2775).
_STAGE3_ONLY = ("prefetch_bucket_size", "max_live_parameters", "param_persistence_threshold", "sub_group_size")
# DeepSpeedZeroConfig's lower bounds where they are not 0 (zero/config.py: reduce_bucket_size
# is `Field(..., gt=0)`; the others `ge=0`).
_BUCKET_MINIMUM = {"reduce_bucket_size": 1}
_STAGE12_ONLY = ("allgather_bucket_size",)  # stage 3 gathers by the prefetch bucket instead
# Where DeepSpeed 0.19.8 refuses a config, named in the notes so a reader can check them.
PIPELINE_ZERO_RULE = ('"ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism" '
                      "(deepspeed/runtime/pipe/engine.py:77)")
PIPELINE_MPU_RULE = "deepspeed/__init__.py:583"  # mpu = model.mpu(): dp from the PipelineModule's topology
BATCH_RULE = ("train_batch_size == train_micro_batch_size_per_gpu * gradient_accumulation_steps * dp "
              "(deepspeed/runtime/config.py:602)")
REFUSES = "DeepSpeed refuses this config"
PARTITION_RULE = "deepspeed/runtime/pipe/module.py:133"
OVERLAP_PIPELINE_RULE = ("DeepSpeed's pipeline engine turns overlap_comm off at ZeRO stages 0-2 (\"Pipeline "
                         "parallelism does not support overlapped communication, will be disabled\", "
                         "deepspeed/runtime/engine.py:2665)")
# data_types.grad_accum_dtype as DeepSpeed spells it (runtime/config.py `DtypeEnum`, lines 144-149).
_DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "torch.float32": "fp32",
           "bf16": "bf16", "bfloat16": "bf16", "torch.bfloat16": "bf16",
           "fp16": "fp16", "float16": "fp16", "half": "fp16", "torch.float16": "fp16"}
DEEPSPEED_PLANS = "`shardplan plan --framework deepspeed` searches only the plans DeepSpeed runs"
FIT_PLANS = "`shardplan plan --framework deepspeed` finds the plans that fit as DeepSpeed allocates them"


def _applies(key: str, stage: int) -> bool:
    """Whether DeepSpeed reads this bucket knob at this stage."""
    return not ((key in _STAGE3_ONLY and stage != 3) or (key in _STAGE12_ONLY and stage == 3))

# Job keys this format carries (everything else that differs from its default gets a note).
COVERED = (
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.micro_batch_size", "parallel.num_microbatches",
    "zero.stage", "zero.hybrid", "zero.overlap_comm", "zero.grad_accum_dtype", *(f"zero.{k}" for k in _BUCKETS),
    "offload.params", "offload.grads", "offload.optimizer", "offload.pin_memory", "offload.gpu_param_budget",
    "train.precision", "train.optimizer", "train.lr", "train.global_batch_size", "train.activation_checkpointing",
)


def to_deepspeed(plan: Plan) -> Exported:
    """The DeepSpeed config that runs this plan, and what it cannot say."""
    job = plan.job
    par, zero, off, train = job.parallel, job.zero, job.offload, job.train
    notes: list[Note] = []
    config: dict = {
        "train_batch_size": plan.global_batch,
        "train_micro_batch_size_per_gpu": par.micro_batch_size,
        "gradient_accumulation_steps": par.num_microbatches,
    }
    if train.optimizer == "sgd":
        config["optimizer"] = {"type": "SGD", "params": {"lr": train.lr}}
    else:
        config["optimizer"] = {"type": "AdamW", "params": {"lr": train.lr}}
        if train.optimizer == "adamw8bit":
            notes.append(Note("train.optimizer", "deepspeed has no 8-bit AdamW; written as AdamW (32-bit states)"))
    if train.precision in ("bf16-mixed", "bf16"):
        config["bf16"] = {"enabled": True}
        if train.precision == "bf16":
            notes.append(Note("train.precision", "deepspeed keeps fp32 master weights with bf16 enabled; "
                                                 "pure bf16 training ('bf16') is written as bf16 mixed precision"))
    elif train.precision == "fp16-mixed":
        config["fp16"] = {"enabled": True}
    written = _decided_offload(plan, notes) if plan.offload.changed else None
    stage = zero.stage if written is None else written.zero_stage
    if written is None and (off.optimizer or off.grads) and stage == 0:
        # ZeRO-Offload runs on ZeRO's optimizer: at stage 0 DeepSpeed ignores offload_optimizer.
        stage = 1
        notes.append(_stage_note(0, 1, par.dp))
    if written is None:
        _as_planned_fit(plan, stage, notes)
    zero_config: dict = {"stage": stage}
    for key, name in _BUCKETS.items():
        if not _applies(key, stage):
            continue
        zero_config[name] = getattr(zero, key)  # the job file holds DeepSpeed's bounds (spec/job.py)
    if written is not None:  # the strategy's decision (its notes are written)
        if written.optimizer:
            zero_config["offload_optimizer"] = {"device": "cpu", "pin_memory": off.pin_memory}
        if written.params:
            zero_config["offload_param"] = {"device": "cpu", "pin_memory": off.pin_memory}
    else:
        if off.optimizer or off.grads:
            zero_config["offload_optimizer"] = {"device": "cpu", "pin_memory": off.pin_memory}
            if not off.optimizer:
                notes.append(Note("offload.grads", "deepspeed cannot offload gradients alone: offload_optimizer "
                                                   "moves the optimizer states with them"))
            elif not off.grads:
                notes.append(Note("offload.grads", "deepspeed's offload_optimizer (ZeRO-Offload) moves the gradient "
                                                   "partitions to the CPU too; the plan keeps them on the GPU"))
        if off.params:
            zero_config["offload_param"] = {"device": "cpu", "pin_memory": off.pin_memory}
            if kept := plan.offload.kept_note("deepspeed's offload_param"):
                notes.append(Note("offload.gpu_param_budget", kept))
    if zero.overlap_comm is not None:
        zero_config["overlap_comm"] = zero.overlap_comm
        if zero.overlap_comm and par.pp > 1 and stage <= 2:
            notes.append(Note("zero.overlap_comm", f"{OVERLAP_PIPELINE_RULE}: written as given, planned without it"))
    if zero.hybrid:
        # MiCS (mics_shard_size) sharded inside groups and replicated across them; DeepSpeed
        # 0.19 removed it and rejects the key (runtime/config.py, _REMOVED_ZERO_CONFIG_KEYS).
        notes.append(Note("zero.hybrid", "deepspeed 0.19 has no hybrid sharding (MiCS was removed); "
                                         "written as sharding over every data-parallel rank"))
    config["zero_optimization"] = zero_config
    if zero.grad_accum_dtype is not None:
        config["data_types"] = {"grad_accum_dtype": zero.grad_accum_dtype}
    if par.tp > 1:
        config["tensor_parallel"] = {"autotp_size": par.tp}
    if train.activation_checkpointing != "none":
        # The section configures deepspeed.checkpointing, which the model's code calls per
        # layer; DeepSpeed has no key choosing which activations to keep.
        config["activation_checkpointing"] = {
            "partition_activations": False, "cpu_checkpointing": False, "contiguous_memory_optimization": False,
        }
        if train.activation_checkpointing in ("selective", "op"):
            notes.append(Note("train.activation_checkpointing", f"deepspeed cannot express {train.activation_checkpointing!r}: "
                                                                "the activation_checkpointing section is written, and the "
                                                                "model's code chooses what deepspeed.checkpointing recomputes"))
    if job.model.source is not None:
        notes.append(Note("model", "deepspeed's config has no model: the training script builds it"))
    notes = _pipeline_notes(plan, stage) + notes + unexpressed(plan, COVERED, TARGET)
    return Exported(config, notes)


def _pipeline_notes(plan: Plan, stage: int) -> list[Note]:
    """What a pipeline plan needs from the training script, and where DeepSpeed refuses the
    config as written (first: a reader sees them before the notes on keys)."""
    par = plan.job.parallel
    if par.pp == 1:
        return []
    notes = []
    if stage >= 2:
        notes.append(Note("zero.stage", f"DeepSpeed {REFUSED} with pp {par.pp} it needs DeepSpeed's pipeline engine, which "
                                        f"runs ZeRO stages 0 and 1 only, {PIPELINE_ZERO_RULE}, and the config writes "
                                        f"stage {stage}; {DEEPSPEED_PLANS}"))
    without = f"{REFUSES} without a PipelineModule: the {par.pp} stages' ranks then join data parallel"
    if par.tp == par.cp == 1:  # no model-parallel unit: dp is the world
        micro, steps = par.micro_batch_size, par.num_microbatches
        without += (f", dp = world {plan.world} (deepspeed/runtime/config.py:471), and {BATCH_RULE} fails: "
                    f"{plan.global_batch} != {micro} * {steps} * {plan.world}")
    else:
        without += f", and {BATCH_RULE} fails"
    dims = " * ".join(f"{axis} {getattr(par, axis)}" for axis in ("tp", "pp", "cp") if getattr(par, axis) > 1)
    notes.append(Note("parallel.pp", f"deepspeed's config has no pipeline degree: the training script's "
                                     f"PipelineModule(num_stages={par.pp}) sets it, and DeepSpeed takes the "
                                     f"data-parallel size from its topology ({PIPELINE_MPU_RULE}); the batch keys are "
                                     f"written for dp = world {plan.world} / ({dims}) = {par.dp}. {without}"
                                     + (f". {_partition_note(plan)}" if plan.shape is not None else "")))
    return notes


def _partition_note(plan: Plan) -> str:
    """Which layers the plan puts on each stage, and how PipelineModule is told: its default
    partition_method, 'parameters', balances parameter counts (pipe/module.py:133, 409-411),
    which moves blocks off the stages that hold the embedding and the head."""
    par = plan.job.parallel
    layers = plan.shape.num_layers
    counts = split_layers(layers, par.pp, par.first_stage_layers, par.last_stage_layers)
    # split_label compresses a long uneven split and leaves the even one to us.
    shown = split_label(layers, par.pp, par.first_stage_layers, par.last_stage_layers).removeprefix("layers ")
    split = (f"{counts[0]} blocks on each of" if len(set(counts)) == 1
             else f"blocks {shown or '/'.join(map(str, counts))} on")
    even = counts == split_layers(layers, par.pp)
    how = ("partition_method='type:<the block class>' (or 'uniform' over the blocks alone) gives it" if even else
           "partition_method='type:<the block class>' splits the blocks evenly instead, and PipelineModule takes no "
           "count per stage: build the stages' layer lists in code")
    return (f"The plan puts {split} its {par.pp} stages: {how}; PipelineModule's default, "
            f"partition_method='parameters' ({PARTITION_RULE}), balances parameter counts and gives the stages with "
            "the embedding and the head fewer blocks")


def _stage_note(stage: int, written: int, dp: int) -> Note:
    shards = (f"which shards them over the {dp} data-parallel ranks" if dp > 1
              else "which over one data-parallel rank shards nothing")
    return Note("zero.stage", "deepspeed offloads optimizer states only with ZeRO stages 1-3 "
                              f"(offload_optimizer); {stage} is written as {written}, {shards}")


def _decided_offload(plan: Plan, notes: list[Note]) -> Offload:
    """What DeepSpeed writes for the offload strategy's decision: offload_optimizer (ZeRO-Offload,
    which moves the gradient partitions with the optimizer states and runs on ZeRO's optimizer,
    stages 1-3: zero/offload_config.py, `DeepSpeedZeroOffloadOptimizerConfig`) and offload_param
    (every parameter, stage 3). What differs from the decision, or does not fit as DeepSpeed
    allocates it (the `deepspeed` accounting), gets a note."""
    decision, stage, dp = plan.offload, plan.job.zero.stage, plan.job.parallel.dp
    decided = decision.offload
    moved = decided.optimizer or decided.grads
    written = Offload(params=decided.params, grads=moved, optimizer=moved,
                      resident_layers=0 if decided.params else None, zero_stage=max(stage, 1) if moved else stage)
    if written.zero_stage != stage:
        notes.append(_stage_note(stage, written.zero_stage, dp))
    fit = fit_of(decision, written, TARGET)
    if same(decision, written) and fit.fits:
        return written
    why = []
    if decided.optimizer != decided.grads:
        why.append("offload_optimizer moves the optimizer states and the gradient partitions together")
    if decided.params and decision.kept_layers():
        why.append("offload_param offloads every layer's parameters")
    because = f" ({'; '.join(why)})" if why else ""
    notes.append(Note("offload", f"the {decision.strategy} strategy offloads {decision.describe()}: "
                                 f"{decision.written_as(written)}{because}, {fit}{way_out(fit, FIT_PLANS)}"))
    return written


def _as_planned_fit(plan: Plan, stage: int, notes: list[Note]) -> None:
    """The plan written as the job states it (no offload strategy's decision to write): a note
    when it does not fit as DeepSpeed allocates it (the `deepspeed` accounting: its flat
    buffers, buckets and copies, docs/estimate.md), which a job planned under `fsdp2` can miss."""
    decision, off = plan.offload, plan.job.offload
    if decision.inputs is None:
        return  # no model to estimate
    moved = off.optimizer or off.grads  # offload_optimizer moves both
    written = Offload(params=off.params, grads=moved, optimizer=moved,
                      resident_layers=0 if off.params else None, zero_stage=stage)
    fit = fit_of(decision, written, TARGET)
    if fit.fits is False:
        notes.append(Note("zero.framework", f"written as planned, {fit}: {FIT_PLANS}"))


def dumps(config: dict) -> str:
    return json.dumps(config, indent=2) + "\n"


# -- import ---------------------------------------------------------------------------------
_AUTO = AUTO
_OFFLOAD_DEVICES = ("cpu", "nvme", "none")
# Sections DeepSpeed 0.19 removed: it refuses a config that has one before reading anything
# else (runtime/config.py, `_reject_removed_config_keys`: _REMOVED_TOP_LEVEL_CONFIG_KEYS,
# _REMOVED_ZERO_CONFIG_KEYS). Older configs (DeepSpeedExamples' BERT ones) still carry them.
# mics_shard_size is read above, as hybrid sharding.
_REMOVED = "(removed in DeepSpeed 0.19, which refuses a config that has the key: delete it to run this config)"
_REMOVED_KEYS = {
    "nebula": "Nebula checkpointing", "compression_training": "the compression library",
    "amp": "NVIDIA Apex AMP", "quantize_training": "Mixture-of-Quantization",
    "sparse_gradients": "sparse embedding gradients", "eigenvalue": "eigenvalue-based Mixture-of-Quantization",
    "sparse_attention": "Sparse Attention", "elasticity": "elastic training",
    "graph_harvesting": "graph harvesting", "curriculum_learning": "the top-level curriculum learning",
    "progressive_layer_drop": "Progressive Layer Dropping",
}
_REMOVED_ZERO_KEYS = {"mics_hierarchical_params_gather": "MiCS", "zeropp_loco_param": "LoCo-Zero++"}
# DeepSpeed 0.19.8 accepts offload_param at every stage but reads it only on the stage-3 path
# (runtime/engine.py:2731 and :2773 hand `offload_param_config` to DeepSpeedZeRoOffload and
# DeepSpeedZeroOptimizer_Stage3); the stage 1-2 optimizer is built with offload_optimizer alone
# (engine.py:2655-2688). accelerate's DeepSpeedPlugin writes offload_param next to any stage
# (accelerate/utils/dataclasses.py), so published ZeRO-2 configs carry it.
PARAM_OFFLOAD_IGNORED = ("not read: DeepSpeed ignores parameter offload below ZeRO stage 3 (deepspeed/runtime/"
                         "engine.py:2655-2688 builds the stage {stage} optimizer with offload_optimizer only; "
                         "offload_param is read for stage 3, engine.py:2731, 2773)")


def model_parallel_degrees(data: dict) -> dict[str, object]:
    """The model-parallel degrees a DeepSpeed config states, by job key (as written): its
    tensor-parallel size (`tensor_parallel.autotp_size`); its pipeline and sequence parallel
    are set up in code."""
    tensor = data.get("tensor_parallel") if isinstance(data.get("tensor_parallel"), dict) else {}
    return {"parallel.tp": tensor["autotp_size"]} if "autotp_size" in tensor else {}


def from_deepspeed(data: dict, dp: int | None = None, dp_said: str = "", hidden_size: int | None = None,
                   given: Collection[str] = ()) -> Imported:
    """Job tables from a DeepSpeed config. `dp`: the data-parallel size the command line
    gives (--dp, or --world over the model-parallel degrees, as DeepSpeed derives it; a
    DeepSpeed config names no world size; with all three batch keys it follows), `dp_said`
    how a message names it. `hidden_size`: the model's, where the command line names the
    model, from which the bucket sizes a Hugging Face config leaves "auto" are read as the
    Trainer fills them in; `given`: the job keys the command line sets (`train.precision`),
    which the notes then no longer ask for."""
    out = Imported()
    out.set("zero.framework", "deepspeed", "")
    top = Reader(data, "", out)
    _batch(top, out, dp, dp_said or f"--dp {dp}")
    if dp is not None and "dp" not in out.tables.get("parallel", {}):
        out.set("parallel.dp", dp, "")  # the command line's (--world's) data-parallel size
    elif dp is None and "dp" not in out.tables.get("parallel", {}) and not out.problems:
        # DeepSpeed takes the data-parallel size from the launch (the world over the model-parallel
        # degrees, config.py `_set_batch_related_parameters`); without train_batch_size and all
        # three batch keys the config does not say it.
        given = next((k for k in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
                      if k in data and data[k] != "auto"), "")
        out.note(given, "the data-parallel degree is not in the config (DeepSpeed takes it from the launch): "
                        "planned as dp 1; give --dp N or --world N")
    _zero(top, out, hidden_size)
    _data_types(top, out)
    _precision(top, out, given)
    _optimizer(top, out)
    tensor = top.table("tensor_parallel")
    if tensor is not None:
        reader = Reader(tensor, "tensor_parallel", out)
        autotp = reader.int("autotp_size")
        if autotp:
            out.set("parallel.tp", autotp, "tensor_parallel.autotp_size")
        reader.unread()
    checkpointing = top.table("activation_checkpointing")
    if checkpointing is not None:
        out.set("train.activation_checkpointing", "full", "activation_checkpointing")
        out.note("activation_checkpointing", "read as full recomputation of every layer (the section configures "
                                             "deepspeed.checkpointing; the model's code decides what it wraps)")
        reader = Reader(checkpointing, "activation_checkpointing", out)
        for key in ("partition_activations", "cpu_checkpointing"):
            if reader.bool(key):
                out.note(reader.key(key), "not read: shardplan keeps checkpoints on the GPU, unpartitioned")
        # The section's other keys (activation_checkpointing/config.py); what export writes
        # (false) is DeepSpeed's default, and only another value is named.
        for key in ("contiguous_memory_optimization", "number_checkpoints", "synchronize_checkpoint_boundary",
                    "profile"):
            if reader.raw(key) not in (None, False):
                out.note(reader.key(key), "not read: shardplan has no setting for it")
    for key, what in _REMOVED_KEYS.items():
        if top.has(key):
            top.raw(key)
            out.note(key, f"not read: {what} {_REMOVED}")
    top.unread()
    offload_as_written(out)
    return out


def _batch(top: Reader, out: Imported, dp: int | None, dp_said: str) -> None:
    """Micro batch, accumulation and dp from DeepSpeed's rule: train_batch_size =
    micro_batch * accumulation * data-parallel size, any two given (config.py,
    `_set_batch_related_parameters`)."""
    values = {}
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps"):
        if top.raw(key) == "auto":
            out.note(key, _AUTO)
            continue
        top.seen.discard(key)
        values[key] = top.int(key, minimum=1)
    total = values.get("train_batch_size")
    micro = values.get("train_micro_batch_size_per_gpu")
    steps = values.get("gradient_accumulation_steps")
    if total and micro and steps:
        if total % (micro * steps):
            out.problem("train_batch_size", f"{total} is not train_micro_batch_size_per_gpu ({micro}) * "
                                             f"gradient_accumulation_steps ({steps}) * a number of GPUs")
            return
        found = total // (micro * steps)
        if dp is not None and dp != found:
            # DeepSpeed's pipeline engine takes its stages from the PipelineModule in code, not
            # from the config: a config exported from a pipeline plan needs --pp back.
            stages = (f"; the pipeline stages of a PipelineModule are not in the config: with {dp // found} "
                      f"times the --pp given (--pp {dp // found} without one) it adds up"
                      if dp > found and dp % found == 0 else "")
            out.problem("train_batch_size", f"{total} = {micro} * {steps} * {found} GPUs, but {dp_said}{stages}")
            return
        dp = found
        out.set("parallel.dp", dp, "train_batch_size")
    elif total and (micro or steps):
        if dp is None:
            given = "train_micro_batch_size_per_gpu" if micro else "gradient_accumulation_steps"
            out.problem("train_batch_size", f"with {given} but not "
                        f"{'gradient_accumulation_steps' if micro else 'train_micro_batch_size_per_gpu'} the number "
                        "of GPUs decides the rest: give --dp or --world")
            return
        other = micro or steps
        if total % (other * dp):
            out.problem("train_batch_size", f"{total} is not divisible by {other} * dp ({dp_said})")
            return
        micro, steps = (micro, total // (micro * dp)) if micro else (total // (steps * dp), steps)
    elif total:
        if dp is None:
            out.problem("train_batch_size", "alone, it is divided over the GPUs: give --dp or --world")
            return
        if total % dp:
            out.problem("train_batch_size", f"{total} is not divisible by dp ({dp_said})")
            return
        micro, steps = total // dp, 1
    elif steps and not micro:
        # Accumulation alone: the micro batch is the launcher's (the Hugging Face Trainer fills
        # an "auto" one from per_device_train_batch_size; DeepSpeed itself asks for one, config.py
        # `_set_batch_related_parameters`). It is not written, so `plan` searches it.
        out.set("parallel.num_microbatches", steps, "gradient_accumulation_steps")
        return
    elif micro:
        steps = steps or 1  # DeepSpeed's accumulation beside a micro batch alone
    else:
        return
    micro_key = "train_micro_batch_size_per_gpu" if values.get("train_micro_batch_size_per_gpu") else "train_batch_size"
    steps_key = "gradient_accumulation_steps" if values.get("gradient_accumulation_steps") else micro_key
    out.set("parallel.micro_batch_size", micro, micro_key)
    out.set("parallel.num_microbatches", steps, steps_key)


# The bucket keys the Hugging Face Trainer and accelerate fill in when a config leaves them
# "auto", from the model's hidden size h: transformers 5.23.0 integrations/deepspeed.py:232-242
# (`HfTrainerDeepSpeedConfig.trainer_config_finalize`; the two stage-3 keys at stage 3 only)
# and accelerate 1.15.0 accelerator.py:2296-2327 (`Accelerator._prepare_deepspeed`, the same
# three keys). By shardplan key: (the formula as they write it, its value for h).
_HIDDEN_FILLED = {
    "reduce_bucket_size": ("hidden_size * hidden_size", lambda h: h * h),
    "prefetch_bucket_size": ("int(0.9 * hidden_size * hidden_size)", lambda h: int(0.9 * h * h)),
    "param_persistence_threshold": ("10 * hidden_size", lambda h: 10 * h),
}
# DeepSpeed's config models drop every "auto" value before validating, so the field keeps
# its default (deepspeed/runtime/config_utils.py:55-56, DeepSpeedConfigModel.__init__).
_AUTO_DROPPED = "DeepSpeed drops an 'auto' value (deepspeed/runtime/config_utils.py:55-56)"


def _auto_bucket(key: str, where: str, stage: int, hidden_size: int | None, out: Imported) -> int | None:
    """The value of a bucket key written "auto", as whoever fills it in: the Hugging Face
    Trainer and accelerate from the model's hidden size (`_HIDDEN_FILLED`), else DeepSpeed's
    default (None: the job keeps it); a note says which."""
    default = ZeroSpec.model_fields[key].default
    if key not in _HIDDEN_FILLED:
        filled = ", ".join(_BUCKETS[k] for k in _HIDDEN_FILLED)
        out.note(where, f"'auto' is filled in by neither the Hugging Face Trainer nor accelerate (they fill {filled}); "
                        f"{_AUTO_DROPPED}: planned at DeepSpeed's default {default:,}")
        return None
    formula, fill = _HIDDEN_FILLED[key]
    if key != "reduce_bucket_size" and stage != 3:
        out.note(where, f"'auto': not read, DeepSpeed does not use it at stage {stage}")
        return None
    if hidden_size is None:
        out.note(where, f"'auto' is filled in by the Hugging Face Trainer and accelerate as {formula} of the "
                        f"model, whose hidden size the import was not given: planned at DeepSpeed's default {default:,}")
        return None
    value = fill(hidden_size)
    out.note(where, f"'auto' is filled in by the Hugging Face Trainer and accelerate: read as {formula} = "
                    f"{value:,} (hidden size {hidden_size:,})")
    return value


def _zero(top: Reader, out: Imported, hidden_size: int | None = None) -> None:
    raw = top.raw("zero_optimization")
    if isinstance(raw, bool):  # the old form: true is stage 1 (zero/config.py, read_zero_config_deprecated)
        out.set("zero.stage", 1 if raw else 0, "zero_optimization")
        return
    top.seen.discard("zero_optimization")
    table = top.table("zero_optimization")
    if table is None:
        return
    zero = Reader(table, "zero_optimization", out)
    stage = zero.int("stage")
    if stage is not None:
        if stage > 3:
            out.problem(zero.key("stage"), f"must be 0, 1, 2 or 3 (got {stage})")
        else:
            out.set("zero.stage", stage, zero.key("stage"))
    for key, name in _BUCKETS.items():
        for spelling in dict.fromkeys((name, key)):  # DeepSpeed accepts the field name and its alias
            if zero.has(spelling) and zero.raw(spelling) == "auto":
                value = _auto_bucket(key, zero.key(spelling), stage or 0, hidden_size, out)
                if value is not None:
                    out.set(f"zero.{key}", value, zero.key(spelling))
                continue
            value = zero.int(spelling) if zero.has(spelling) else None
            if value is None:
                continue
            if value < _BUCKET_MINIMUM.get(key, 0):
                out.problem(zero.key(spelling), f"must be > 0 (got {value}): DeepSpeed refuses it "
                                                "(zero/config.py, DeepSpeedZeroConfig)")
                continue
            if _applies(key, stage or 0):
                out.set(f"zero.{key}", value, zero.key(spelling))
            else:
                out.note(zero.key(spelling), f"not read: DeepSpeed does not use it at stage {stage or 0}")
    mics = zero.int("mics_shard_size") if zero.has("mics_shard_size") else None
    if mics is not None and mics > 0:
        out.set("zero.hybrid", True, zero.key("mics_shard_size"))
        out.set("cluster.gpus_per_node", mics, zero.key("mics_shard_size"))
        out.note(zero.key("mics_shard_size"), f"MiCS (removed in DeepSpeed 0.19) read as hybrid sharding inside "
                                              f"nodes of {mics} GPUs (cluster.gpus_per_node)")
    pins = []
    for key, job_keys in (("offload_optimizer", ("offload.optimizer", "offload.grads")),
                          ("offload_param", ("offload.params",))):
        section = zero.table(key) if zero.has(key) else None
        if section is None:
            continue
        reader = Reader(section, zero.key(key), out)
        device = reader.choice("device", _OFFLOAD_DEVICES)
        if device in ("cpu", "nvme") and key == "offload_param" and (stage or 0) < 3:
            out.note(reader.key("device"), PARAM_OFFLOAD_IGNORED.format(stage=stage or 0))
            reader.unread(PARAM_OFFLOAD_IGNORED.format(stage=stage or 0))
            continue
        if device in ("cpu", "nvme"):
            for job_key in job_keys:
                out.set(job_key, True, reader.key("device"))
            if key == "offload_param":
                out.set("offload.gpu_param_budget", 0, reader.key("device"))  # every parameter goes
            if key == "offload_optimizer":
                out.note(reader.key("device"), "ZeRO-Offload moves the gradient partitions with the optimizer "
                                               "states: read as offload.optimizer and offload.grads")
            if device == "nvme":
                out.note(reader.key("device"), "NVMe offload is planned as CPU offload (shardplan counts the "
                                               "states in CPU memory)")
            pin = reader.bool("pin_memory")
            if pin is not None:
                pins.append((pin, reader.key("pin_memory")))
        reader.unread()
    # The deprecated booleans, which DeepSpeed maps to the sections above when these are absent
    # (zero/config.py: cpu_offload -> offload_optimizer, cpu_offload_param -> offload_param, with
    # device "cpu"; cpu_offload_use_pin_memory sets no field).
    for key, section, job_keys in (("cpu_offload", "offload_optimizer", ("offload.optimizer", "offload.grads")),
                                   ("cpu_offload_param", "offload_param", ("offload.params",))):
        if not zero.has(key):
            continue
        value = zero.bool(key)
        if value and zero.has(section):
            out.note(zero.key(key), f"deprecated; {zero.key(section)} is given and is read instead")
        elif value and key == "cpu_offload_param" and (stage or 0) < 3:
            out.note(zero.key(key), PARAM_OFFLOAD_IGNORED.format(stage=stage or 0))
        elif value:
            for job_key in job_keys:
                out.set(job_key, True, zero.key(key))
            if key == "cpu_offload_param":
                out.set("offload.gpu_param_budget", 0, zero.key(key))
            out.note(zero.key(key), f"deprecated form of {section} with device \"cpu\": read as {' and '.join(job_keys)}")
    for key, what in _REMOVED_ZERO_KEYS.items():
        if zero.has(key):
            zero.raw(key)
            out.note(zero.key(key), f"not read: {what} {_REMOVED}")
    if zero.has("cpu_offload_use_pin_memory"):
        zero.raw("cpu_offload_use_pin_memory")
        out.note(zero.key("cpu_offload_use_pin_memory"), "deprecated and read by no DeepSpeed field: not read")
    if pins:
        out.set("offload.pin_memory", pins[0][0], pins[0][1])
        if len({pin for pin, _ in pins}) > 1:
            out.note(pins[1][1], f"differs from {pins[0][1]}; shardplan has one pin_memory, read from the first")
    if zero.has("overlap_comm"):
        overlap = zero.bool("overlap_comm")
        if overlap is not None:
            out.set("zero.overlap_comm", overlap, zero.key("overlap_comm"))
    zero.unread()


def _data_types(top: Reader, out: Imported) -> None:
    """data_types.grad_accum_dtype (runtime/config.py line 556): zero.grad_accum_dtype."""
    section = top.table("data_types") if top.has("data_types") else None
    if section is None:
        return
    reader = Reader(section, "data_types", out)
    if reader.has("grad_accum_dtype"):
        raw = reader.raw("grad_accum_dtype")
        name = _DTYPES.get(raw.strip().lower()) if isinstance(raw, str) else None
        if raw is not None and name is None:  # None is DeepSpeed's default: the model's dtype
            out.problem(reader.key("grad_accum_dtype"), f"must be one of {', '.join(repr(k) for k in _DTYPES)} "
                                                        f"(got {raw!r}; DeepSpeed's DtypeEnum, runtime/config.py)")
        elif name is not None:
            out.set("zero.grad_accum_dtype", name, reader.key("grad_accum_dtype"))
    reader.unread()


def _precision(top: Reader, out: Imported, given: Collection[str] = ()) -> None:
    enabled, auto, auto_keys = {}, [], []
    for key in ("bf16", "bfloat16", "fp16"):
        section = top.table(key) if top.has(key) else None
        if section is None:
            continue
        reader = Reader(section, key, out)
        if reader.raw("enabled") == "auto":
            out.note(reader.key("enabled"), _AUTO)
            auto.append(reader.key("enabled"))
            auto_keys.append(key)
        else:
            reader.seen.discard("enabled")
            enabled[key] = (reader.bool("enabled"), reader.key("enabled"))
        reader.unread("not read: no effect on memory")
    bf16 = next((v for k, v in enabled.items() if k != "fp16" and v[0]), None)
    fp16 = enabled.get("fp16", (False, ""))
    if bf16 and fp16[0]:
        out.problem(fp16[1], "bf16 and fp16 cannot both be enabled")
    elif bf16:
        out.set("train.precision", "bf16-mixed", bf16[1])
    elif fp16[0]:
        out.set("train.precision", "fp16-mixed", fp16[1])
    elif auto:
        # Nothing enabled as written: the Trainer's flags for the "auto" ones decide (one
        # "auto" beside a disabled other, as the Trainer's templates write them, too).
        flags = list(dict.fromkeys("--fp16" if key == "fp16" else "--bf16" for key in auto_keys))
        decide = f"the Trainer's {' / '.join(flags)} decide{'s' if len(flags) == 1 else ''} the precision"
        if "train.precision" in given:
            out.note(auto[0], f"{decide}: train.precision is the command line's")
        else:
            # Planned as DeepSpeed's default, and said so.
            hint = "bf16-mixed for a bf16 run" if "--bf16" in flags else "fp16-mixed for an fp16 run"
            out.set("train.precision", "fp32", auto[0])
            out.note(auto[0], f"{decide}: planned as fp32 (DeepSpeed's default); give --set train.precision={hint}")
    elif enabled:
        out.set("train.precision", "fp32", next(iter(enabled.values()))[1])
    else:
        out.set("train.precision", "fp32", "")  # DeepSpeed trains in fp32 unless told otherwise


def _optimizer(top: Reader, out: Imported) -> None:
    section = top.table("optimizer") if top.has("optimizer") else None
    if section is None:
        return
    reader = Reader(section, "optimizer", out)
    kind = reader.str("type")
    params = reader.table("params") if reader.has("params") else None
    if kind is not None:
        name = kind.lower()
        if name in ("adam", "adamw"):
            out.set("train.optimizer", "adamw", reader.key("type"))
            if name == "adam" and params and params.get("adam_w_mode") is False:
                out.note("optimizer.params.adam_w_mode", "Adam with L2 regularisation is planned as AdamW "
                                                         "(the same states)")
        elif name == "sgd":
            out.set("train.optimizer", "sgd", reader.key("type"))
        else:
            out.note(reader.key("type"), f"{kind!r} has no shardplan equivalent; planned as adamw")
    if params is not None:
        inner = Reader(params, "optimizer.params", out)
        lr = inner.number("lr") if inner.has("lr") else None
        if lr is not None and math.isfinite(lr) and lr > 0:
            out.set("train.lr", lr, inner.key("lr"))
        elif lr == 0:  # a scheduler (WarmupLR's warmup_min_lr, ...) sets the rate
            out.note(inner.key("lr"), "0 is not carried (train.lr must be > 0): the job keeps its default")
        elif lr is not None:
            out.problem(inner.key("lr"), f"must be a positive number (got {lr})")
        inner.raw("adam_w_mode")
        inner.unread("not read: no effect on memory")
    reader.unread()

