"""The plan as a torchtitan job config (TOML); with the import (torchtitan_import.py, whose
`from_torchtitan`, `model_preset` and `model_parallel_degrees` are importable from here too),
the torchtitan format.

Keys, defaults and meanings: torchtitan 0.2.2, as torchtitan_common.py cites them (JobConfig;
the data-parallel degrees and when FSDP applies, parallel_dims.py; `fsdp_reshard_after_forward`,
llama3/infra/parallelize.py; microbatches and stages, pipeline_parallel.py; gradient
accumulation, train.py).
"""

from __future__ import annotations

import math
import posixpath

from ...core.pipeline import split_layers
from ...spec.job import CheckpointSpec
from ...spec.model import RopeScaling
from .common import Exported, Note, Plan, unexpressed
from .offload import whole_model_offload
from .torchtitan_common import CHUNKED, DEFAULTS, FLAVORS, NO_FSDP, SCHEDULES, fsdp_applied
from .torchtitan_import import (MODEL_PARALLEL_KEYS, from_torchtitan, model_parallel_degrees, model_preset,
                                torchtitan_split)

__all__ = ["COVERED", "DEFAULTS", "FLAVORS", "MODEL_PARALLEL_KEYS", "SCHEDULES", "TARGET", "dumps", "from_torchtitan",
           "model_parallel_degrees", "model_preset", "stage_fqns", "to_torchtitan", "torchtitan_split"]

TARGET = "torchtitan"

# The flavor written for each preset (FLAVORS' entries without an attention-kernel variant):
# Llama 3.0's presets have the shapes of the 8B and 70B flavors too, without their RoPE scaling
# (`_rope_scaling_note` says so).
_PRESET_FLAVORS = {"llama-3.1-8b": ("llama3", "8B"), "llama-3.1-70b": ("llama3", "70B"),
                   "llama-3.1-405b": ("llama3", "405B"), "llama-3-8b": ("llama3", "8B"),
                   "llama-3-70b": ("llama3", "70B")}

COVERED = (
    "parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp", "parallel.pipeline_schedule",
    "parallel.virtual_stages", "parallel.first_stage_layers", "parallel.last_stage_layers",
    "parallel.micro_batch_size", "parallel.num_microbatches", "parallel.communication_timeout",
    "parallel.sequence_parallel", "zero.stage", "zero.hybrid", "offload.params", "offload.grads",
    "offload.optimizer", "offload.gpu_param_budget", "train.precision", "train.optimizer", "train.lr",
    "train.seq_len", "train.steps", "train.seed", "train.global_batch_size", "train.activation_checkpointing",
    "checkpoint.dir", "checkpoint.every", "checkpoint.keep",
)


def stage_fqns(layer_counts: list[int]) -> list[list[str]]:
    """module_fqns_per_model_part for stages of these layer counts: torchtitan's Llama
    module names (tok_embeddings on the first stage, norm and output on the last)."""
    parts, start = [], 0
    for index, count in enumerate(layer_counts):
        part = [f"layers.{i}" for i in range(start, start + count)]
        if index == 0:
            part.insert(0, "tok_embeddings")
        if index == len(layer_counts) - 1:
            part += ["norm", "output"]
        parts.append(part)
        start += count
    return parts


# The RoPE scaling of every llama3 flavor: torchtitan 0.2.2's RoPEScalingArgs defaults
# (torchtitan/models/llama3/model/args.py), Llama 3.1's, which TransformerModelArgs applies to
# every flavor (so the llama-3-8b and llama-3-70b presets, Llama 3.0's, differ from theirs).
_FLAVOR_ROPE_SCALING = RopeScaling(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                   original_max_position_embeddings=8192)


def _rope_scaling_note(plan: Plan) -> list[Note]:
    """A flavor fixes its RoPE scaling: a note when the model's differs (no memory or time
    figure depends on it; the positions a run encodes do)."""
    if plan.shape is None or plan.shape.rope_scaling == _FLAVOR_ROPE_SCALING:
        return []
    own = plan.shape.rope_scaling
    model = "has none" if own is None else (
        f"has factor {own.factor}, low_freq_factor {own.low_freq_factor}, high_freq_factor "
        f"{own.high_freq_factor}, original {own.original_max_position_embeddings} positions")
    return [Note("model.rope_scaling", "torchtitan's llama3 flavors all scale RoPE as Llama 3.1 does (factor 8.0, "
                                       "low_freq_factor 1.0, high_freq_factor 4.0, original 8192 positions: "
                                       f"RoPEScalingArgs, models/llama3/model/args.py); this model {model}, which the "
                                       "config cannot say: a run of it encodes positions differently")]


def to_torchtitan(plan: Plan) -> Exported:
    job = plan.job
    par, train, ckpt = job.parallel, job.train, job.checkpoint
    notes: list[Note] = []
    config: dict = {}
    flavor = _PRESET_FLAVORS.get(job.model.preset or "")
    if flavor:
        config["model"] = {"name": flavor[0], "flavor": flavor[1]}
        notes += _rope_scaling_note(plan)
    elif job.model.source is not None:
        notes.append(Note("model", "torchtitan names a model by flavor (llama3 8B, 70B, 405B match shardplan "
                                   "presets); this model has none, so [model] is left to you"))
    if train.optimizer == "sgd":
        notes.append(Note("train.optimizer", "torchtitan builds Adam or AdamW only; written as AdamW"))
    elif train.optimizer == "adamw8bit":
        notes.append(Note("train.optimizer", "torchtitan has no 8-bit AdamW; written as AdamW"))
    config["optimizer"] = {"name": "AdamW", "lr": train.lr}
    config["training"] = _training(plan, notes)
    config["parallelism"] = _parallelism(plan, notes)
    recompute = train.activation_checkpointing
    ac = {"mode": "selective" if recompute == "op" else recompute}
    if recompute in ("op", "selective"):
        # torchtitan's selective recomputation is its operator policy: shardplan's "op".
        ac["selective_ac_option"] = "op"
    if recompute == "selective":
        notes.append(Note("train.activation_checkpointing", "torchtitan has no attention-core recomputation "
                                                            "(Korthikanti et al.); written as its operator policy, "
                                                            "train.activation_checkpointing = \"op\""))
    config["activation_checkpoint"] = ac
    if ckpt.dir:
        config["checkpoint"] = _checkpoint(ckpt, notes)
    timeout = par.communication_timeout
    config["comm"] = {"train_timeout_seconds": math.ceil(timeout)}
    if not float(timeout).is_integer():
        notes.append(Note("parallel.communication_timeout", f"torchtitan takes whole seconds; {timeout} "
                                                            f"written as {math.ceil(timeout)}"))
    config["debug"] = {"seed": train.seed}
    if par.tp > 1 and not par.sequence_parallel:
        notes.append(Note("parallel.sequence_parallel", "torchtitan's tensor parallel always shards the norms "
                                                        "along the sequence (sequence parallel)"))
    notes += unexpressed(plan, COVERED, TARGET)
    return Exported(config, notes)


def _training(plan: Plan, notes: list[Note]) -> dict:
    job = plan.job
    par, off, train = job.parallel, job.offload, job.train
    # Under pipeline parallelism local_batch_size is cut into microbatches of
    # pipeline_parallel_microbatch_size; without it, accumulation makes up the global batch.
    local = par.micro_batch_size * (par.num_microbatches if par.pp > 1 else 1)
    training = {"local_batch_size": local, "global_batch_size": plan.global_batch, "seq_len": train.seq_len,
                "steps": train.steps}
    if train.precision == "bf16":
        training.update(dtype="bfloat16", mixed_precision_param="bfloat16")
    elif train.precision == "fp32":
        training.update(dtype="float32", mixed_precision_param="float32")
    else:
        training.update(dtype="float32", mixed_precision_param="bfloat16")
        if train.precision == "fp16-mixed":
            notes.append(Note("train.precision", "torchtitan mixes precision with bfloat16 only; fp16-mixed "
                                                 "written as bfloat16"))
    offloading = (off.params, off.grads, off.optimizer)
    _, shard = _dp_degrees(plan)
    if plan.offload.changed:  # the offload strategy's decision, in the one setting torchtitan has
        cannot = "" if fsdp_applied(shard, par.cp) else f"torchtitan offloads to the CPU only under FSDP, {NO_FSDP}"
        advice = ("give torchtitan more data-parallel ranks to shard over (`shardplan plan --gpus N`), or export "
                  "to deepspeed, which offloads on one data-parallel rank") if cannot else ""
        training["enable_cpu_offload"], note = whole_model_offload(plan.offload, "enable_cpu_offload",
                                                                   job.zero.stage, cannot, advice)
        if note:
            notes.append(Note("offload", note))
        return training
    if off.params and not fsdp_applied(shard, par.cp):
        # torchtitan hands enable_cpu_offload to apply_fsdp only; without FSDP it would just
        # build the model on the CPU (torchtitan/train.py, init_device) and never move it.
        training["enable_cpu_offload"] = False
        notes.append(Note("offload", f"torchtitan offloads to the CPU only under FSDP, {NO_FSDP}; "
                                     "written as enable_cpu_offload = false"))
        return training
    training["enable_cpu_offload"] = off.params
    if any(offloading) and not all(offloading):
        notes.append(Note("offload", "torchtitan's enable_cpu_offload moves parameters, gradients and optimizer "
                                     f"states together; written as {str(off.params).lower()} from offload.params"))
    if kept := plan.offload.kept_note("torchtitan"):
        notes.append(Note("offload.gpu_param_budget", kept))
    return training


def _checkpoint(ckpt: CheckpointSpec, notes: list[Note]) -> dict:
    """[checkpoint] for checkpoint.dir / every / keep. torchtitan saves to
    {job.dump_folder}/{folder}, dump_folder "./outputs" unless given; the [job] table is left
    to torchtitan's default (it holds the run's other outputs too), so a relative dir is
    written relative to it ("../ckpt" for "ckpt"), an absolute one as it is."""
    folder = ckpt.dir if posixpath.isabs(ckpt.dir) else posixpath.relpath(ckpt.dir, DEFAULTS["dump_folder"])
    keep = ckpt.keep
    if keep == 1:  # components/checkpoint.py, CheckpointManager: keep_latest_k 1 raises ValueError
        keep = 2
        notes.append(Note("checkpoint.keep", "torchtitan keeps at least 2 checkpoints (the last may still be "
                                             "saving) and refuses keep_latest_k = 1: written as 2"))
    return {"enable": True, "folder": folder, "interval": ckpt.every, "keep_latest_k": keep}


def _dp_degrees(plan: Plan, notes: list[Note] | None = None) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree) of the plan; what cannot
    be written of hybrid sharding goes to `notes`."""
    par, zero = plan.job.parallel, plan.job.zero
    if zero.stage == 0:
        return par.dp, 1
    if zero.hybrid:
        replicate, shard, note = plan.hybrid_degrees(par.dp, "torchtitan")
        if note and notes is not None:
            notes.append(Note("zero.hybrid", note))
        return replicate, shard
    return 1, par.dp


def _parallelism(plan: Plan, notes: list[Note]) -> dict:
    job = plan.job
    par, zero = job.parallel, job.zero
    replicate, shard = _dp_degrees(plan, notes)
    if zero.stage > 0 and not fsdp_applied(shard, par.cp):
        notes.append(Note("zero.stage", f"torchtitan shards with FSDP, {NO_FSDP}; ZeRO-{zero.stage} over "
                                        f"{shard} data-parallel rank is written as no sharding"))
    elif zero.stage == 1:
        notes.append(Note("zero.stage", "torchtitan's FSDP2 cannot shard optimizer states alone (ZeRO-1); "
                                        "written as stage 2 (gradients sharded too)"))
    if zero.stage == 0 and par.cp > 1:
        notes.append(Note("zero.stage", "torchtitan applies FSDP over the context-parallel ranks whatever the "
                                        "data-parallel degrees"))
    if zero.stage == 3:
        reshard = "always" if par.pp > 1 else "default"
    else:
        reshard = "never"
    result = {
        "data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
        "fsdp_reshard_after_forward": reshard, "tensor_parallel_degree": par.tp,
        "context_parallel_degree": par.cp, "pipeline_parallel_degree": par.pp,
    }
    if par.pp > 1:
        result["pipeline_parallel_schedule"] = SCHEDULES[par.pipeline_schedule]
        result["pipeline_parallel_microbatch_size"] = par.micro_batch_size
        chunks = par.virtual_stages if par.pipeline_schedule in CHUNKED else 1
        if par.pipeline_schedule == "zero-bubble" and par.virtual_stages > 1:
            notes.append(Note("parallel.virtual_stages", "shardplan plans zero-bubble with one stage per rank; "
                                                         "written with one"))
        if plan.shape is not None:
            counts = split_layers(plan.shape.num_layers, par.pp * chunks, par.first_stage_layers,
                                  par.last_stage_layers)
            result["module_fqns_per_model_part"] = stage_fqns(counts)
        else:
            notes.append(Note("parallel.pp", "without the model's layers the stage split is left to torchtitan"))
    return result


def dumps(config: dict) -> str:
    import tomli_w

    return tomli_w.dumps(config)
