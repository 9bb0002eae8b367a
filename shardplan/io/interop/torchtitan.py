"""The plan as a torchtitan job config (TOML), and a torchtitan job config as job-file tables.

Keys, defaults and meanings: torchtitan 0.2.2 (the last release on the package index whose
`ConfigManager` reads TOML job files; 0.3.0 replaced them with Python config registries),
torchtitan/config/job_config.py (`JobConfig`), torchtitan/distributed/parallel_dims.py
(the data-parallel world is data_parallel_replicate_degree * data_parallel_shard_degree; FSDP
is applied when the shard degree or context parallel is above 1),
torchtitan/models/llama3/infra/parallelize.py (`fsdp_reshard_after_forward`: "default"
reshards unless pipeline parallel is on; tensor parallel always shards the norms along the
sequence), torchtitan/distributed/pipeline_parallel.py (`pipeline_llm`: microbatches =
local_batch_size / pipeline_parallel_microbatch_size; stages from module_fqns_per_model_part,
else `generate_llm_fqn_per_model_part`), torchtitan/train.py (gradient accumulation steps =
global_batch_size / (local_batch_size * data-parallel degree)).
"""

from __future__ import annotations

import math
import posixpath

from ...core.pipeline import split_layers
from ...spec.job import CheckpointSpec
from .common import Exported, Imported, Note, Plan, Reader, float8_not_modelled, unexpressed
from .offload import whole_model_offload

TARGET = "torchtitan"

# torchtitan model name and flavor -> the shardplan preset of the same architecture
# (torchtitan/models/llama3/__init__.py, `llama3_args`; the parameter counts are checked
# against torchtitan's own model in the tests). The _flex / _varlen flavors differ only in
# the attention kernel.
FLAVORS = {
    ("llama3", "8B"): "llama-3-8b",
    ("llama3", "8B_flex"): "llama-3-8b",
    ("llama3", "8B_varlen"): "llama-3-8b",
    ("llama3", "70B"): "llama-3-70b",
    ("llama3", "405B"): "llama-3.1-405b",
}
_PRESET_FLAVORS = {"llama-3-8b": ("llama3", "8B"), "llama-3-70b": ("llama3", "70B"),
                   "llama-3.1-405b": ("llama3", "405B")}

# shardplan schedule -> torch.distributed.pipelining's name, which torchtitan passes to
# `get_schedule_class` (the same classes `shardplan run` uses, runtime/pipeline.py).
SCHEDULES = {
    "gpipe": "GPipe",
    "1f1b": "1F1B",
    "interleaved-1f1b": "Interleaved1F1B",
    "round-robin": "LoopedBFS",
    "zero-bubble": "InterleavedZeroBubble",
}
_SINGLE_STAGE = ("gpipe", "1f1b")  # torch's PipelineScheduleSingle subclasses
_CHUNKED = ("interleaved-1f1b", "round-robin")  # shardplan places `virtual_stages` chunks per rank

# JobConfig defaults that decide the plan (job_config.py, torchtitan 0.2.2).
DEFAULTS = {
    "local_batch_size": 8, "global_batch_size": -1, "seq_len": 2048, "steps": 10000,
    "dtype": "float32", "mixed_precision_param": "bfloat16", "lr": 8e-4,
    "ac_mode": "selective", "reshard": "default", "schedule": "1F1B", "microbatch_size": 1,
    "first_less": 1, "last_less": 1, "train_timeout": 100,
    # [job] and [checkpoint]: checkpoints go to {dump_folder}/{folder} (components/checkpoint.py,
    # CheckpointManager: os.path.join(base_folder, folder), base_folder = job.dump_folder).
    "dump_folder": "./outputs", "checkpoint_folder": "checkpoint", "checkpoint_interval": 500, "keep_latest_k": 10,
}

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


def torchtitan_split(num_stages: int, num_layers: int, input_weight: int, output_weight: int) -> list[int]:
    """Layers per stage as torchtitan splits them without module_fqns_per_model_part
    (`generate_llm_fqn_per_model_part`): the embedding counts as `input_weight` layers on the
    first stage, norm and head as `output_weight` on the last, and num_layers plus both
    weights are dealt evenly, the earlier stages taking the remainder."""
    if num_stages == 1:
        return [num_layers]
    effective = num_layers + input_weight + output_weight
    base, extra = divmod(effective, num_stages)
    counts, left = [], num_layers
    for stage in range(num_stages):
        share = base + (stage < extra)
        if stage == 0:
            share -= input_weight
        elif stage == num_stages - 1:
            share -= output_weight
        take = max(0, min(share, left))
        counts.append(take)
        left -= take
    return counts


def to_torchtitan(plan: Plan) -> Exported:
    job = plan.job
    par, train, ckpt = job.parallel, job.train, job.checkpoint
    notes: list[Note] = []
    config: dict = {}
    flavor = _PRESET_FLAVORS.get(job.model.preset or "")
    if flavor:
        config["model"] = {"name": flavor[0], "flavor": flavor[1]}
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
        cannot = "" if _fsdp_applied(shard, par.cp) else f"torchtitan offloads to the CPU only under FSDP, {_NO_FSDP}"
        training["enable_cpu_offload"], note = whole_model_offload(plan.offload, "enable_cpu_offload",
                                                                   job.zero.stage, cannot)
        if note:
            notes.append(Note("offload", note))
        return training
    if off.params and not _fsdp_applied(shard, par.cp):
        # torchtitan hands enable_cpu_offload to apply_fsdp only; without FSDP it would just
        # build the model on the CPU (torchtitan/train.py, init_device) and never move it.
        training["enable_cpu_offload"] = False
        notes.append(Note("offload", f"torchtitan offloads to the CPU only under FSDP, {_NO_FSDP}; "
                                     "written as enable_cpu_offload = false"))
        return training
    training["enable_cpu_offload"] = off.params
    if any(offloading) and not all(offloading):
        notes.append(Note("offload", "torchtitan's enable_cpu_offload moves parameters, gradients and optimizer "
                                     f"states together; written as {str(off.params).lower()} from offload.params"))
    if off.params and off.gpu_param_budget:
        notes.append(Note("offload.gpu_param_budget", "torchtitan offloads every layer; the plan keeps "
                                                      f"{off.gpu_param_budget} bytes of layers on the GPU"))
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


# torchtitan/distributed/parallel_dims.py: `fsdp_enabled` is dp_shard > 1 or cp > 1, and
# llama3/infra/parallelize.py applies FSDP (with enable_cpu_offload's CPUOffloadPolicy) only then.
_NO_FSDP = "which it applies only with data_parallel_shard_degree or context_parallel_degree above 1"


def _fsdp_applied(shard: int, cp: int) -> bool:
    """Whether torchtitan wraps the model in FSDP for these degrees."""
    return shard > 1 or cp > 1


def _dp_degrees(plan: Plan) -> tuple[int, int]:
    """(data_parallel_replicate_degree, data_parallel_shard_degree) of the plan."""
    par, zero = plan.job.parallel, plan.job.zero
    if zero.stage == 0:
        return par.dp, 1
    if zero.hybrid:
        shard = max(1, plan.shard_group // par.cp)
        return par.dp // shard, shard
    return 1, par.dp


def _parallelism(plan: Plan, notes: list[Note]) -> dict:
    job = plan.job
    par, zero = job.parallel, job.zero
    replicate, shard = _dp_degrees(plan)
    if zero.stage > 0 and not _fsdp_applied(shard, par.cp):
        notes.append(Note("zero.stage", f"torchtitan shards with FSDP, {_NO_FSDP}; ZeRO-{zero.stage} over "
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
        chunks = par.virtual_stages if par.pipeline_schedule in _CHUNKED else 1
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


# -- import ---------------------------------------------------------------------------------
def model_preset(data: dict) -> str | None:
    """The shardplan preset of the config's [model], if one matches."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    return FLAVORS.get((model.get("name", "llama3"), model.get("flavor", "debugmodel")))


def _ordinal(text: str) -> str:
    """`2` -> `2nd` (torchtitan's selective_ac_option is a layer interval, written as a string)."""
    number = int(text) if str(text).isdigit() else None
    if number is None:
        return f"{text}th"
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


def from_torchtitan(data: dict, dp: int | None = None, num_layers: int | None = None,
                    model_given: bool = False, dp_said: str = "") -> Imported:
    """Job tables from a torchtitan job config; keys it leaves out take torchtitan's
    defaults. `dp`: the data-parallel size from the command line (needed when
    data_parallel_shard_degree is -1, "the ranks left over": --dp, or --world over the
    model-parallel degrees, as torchtitan's ParallelDims derives it), `dp_said` how a message
    names it; `num_layers`: the model's
    layers, for torchtitan's own stage split; `model_given`: the command line names the
    model, so the config's [model] is not read."""
    out = Imported()
    top = Reader(data, "", out)
    tables = {name: (top.table(name) if top.has(name) else None) or {} for name in
              ("model", "optimizer", "training", "parallelism", "activation_checkpoint", "checkpoint", "comm",
               "debug")}
    if model_given:
        top.seen.add("model")
    else:
        _read_model(Reader(tables["model"], "model", out), out)
    opt = Reader(tables["optimizer"], "optimizer", out)
    name = opt.choice("name", ("Adam", "AdamW")) if opt.has("name") else "AdamW"
    if name:
        out.set("train.optimizer", "adamw", opt.key("name"))
    lr = opt.number("lr") if opt.has("lr") else DEFAULTS["lr"]
    if lr is not None and lr > 0:
        out.set("train.lr", lr, opt.key("lr"))
    opt.unread("not read: no effect on memory")
    par = Reader(tables["parallelism"], "parallelism", out)
    degrees = _read_degrees(par, out, dp, dp_said)
    _read_training(Reader(tables["training"], "training", out), out, degrees)
    _read_pipeline(par, out, degrees, num_layers)
    par.unread()
    ac = Reader(tables["activation_checkpoint"], "activation_checkpoint", out)
    mode = ac.choice("mode", ("none", "selective", "full", "memory_budget")) if ac.has("mode") else DEFAULTS["ac_mode"]
    option = ac.str("selective_ac_option") if ac.has("selective_ac_option") else None
    if mode == "memory_budget":
        out.note(ac.key("mode"), "a memory budget is read as the operator policy (\"op\")")
        mode = "op"
    elif mode == "selective" and option in (None, "op"):
        mode = "op"  # torchtitan's default selective option is its operator policy
    elif mode == "selective" and option == "1":
        mode = "full"  # every layer recomputed in full
    elif mode == "selective":
        out.note(ac.key("selective_ac_option"), f"{option!r} (every {_ordinal(option)} layer recomputed in full) is read "
                                                "as no recomputation: the estimate keeps more than the run does")
        mode = "none"
    if mode:
        out.set("train.activation_checkpointing", mode, ac.key("mode"))
    ac.unread()
    job = Reader(top.table("job") if top.has("job") else {}, "job", out)
    _read_checkpoint(Reader(tables["checkpoint"], "checkpoint", out), job, out)
    job.unread("not read: no effect on the plan")
    comm = Reader(tables["comm"], "comm", out)
    timeout = comm.int("train_timeout_seconds", minimum=1) if comm.has("train_timeout_seconds") else DEFAULTS["train_timeout"]
    if timeout:
        out.set("parallel.communication_timeout", float(timeout), comm.key("train_timeout_seconds"))
    comm.unread()
    debug = Reader(tables["debug"], "debug", out)
    seed = debug.int("seed") if debug.has("seed") else None
    if seed is not None:
        out.set("train.seed", seed, debug.key("seed"))
    debug.unread()
    _read_low_precision(Reader(tables["model"], "model", out), top, out)
    top.unread("not read: no effect on the plan")
    return out


def _read_model(model: Reader, out: Imported) -> None:
    name = model.str("name") if model.has("name") else "llama3"
    flavor = model.str("flavor") if model.has("flavor") else "debugmodel"
    preset = FLAVORS.get((name, flavor))
    if preset:
        out.set("model.preset", preset, model.key("flavor"))
    else:
        out.note(model.key("flavor"), f"torchtitan model {name!r} flavor {flavor!r} has no shardplan preset "
                                      "(give --set model.preset=NAME or an inline shape)")
    model.seen.add("converters")  # _read_low_precision says what they do
    model.unread("not read: no effect on the plan")


# model.converters that swap the linears for low-precision ones (torchtitan 0.2.2 registers
# "quantize.linear.float8", "quantize.grouped_mm.float8", "quantize.linear.mx" and
# "quantize.grouped_mm.mx": components/quantization/float8.py and mx.py; torchtitan before 0.2
# named them "float8" and "mx", with [float8] and [mx] tables, which 0.2.2's ConfigManager refuses).
_FLOAT8 = {"float8", "quantize.linear.float8", "quantize.grouped_mm.float8"}
_MX = {"mx", "quantize.linear.mx", "quantize.grouped_mm.mx"}
_OLD_TABLES = {"float8": "quantize.linear.float8", "mx": "quantize.linear.mx"}


def _read_low_precision(model: Reader, top: Reader, out: Imported) -> None:
    """model.converters and the tables configuring them ([quantize], or [float8] / [mx] of
    torchtitan before 0.2): float8 and MX training are not modelled, and the notes say what
    the estimate is instead."""
    precision = out.tables.get("train", {}).get("precision")
    converters = model.data.get("converters") if model.has("converters") else []
    names = [converters] if isinstance(converters, str) else converters if isinstance(converters, list) else []
    names = [n for part in names if isinstance(part, str) for n in part.split(",") if n.strip()]
    low = [n.strip() for n in names if n.strip() in _FLOAT8 | _MX]
    if low:
        kinds = " and ".join(k for k, group in (("float8", _FLOAT8), ("MX (mxfp8)", _MX)) if set(low) & group)
        renamed = [f"{n!r} (torchtitan 0.2 names it {_OLD_TABLES[n]!r})" if n in _OLD_TABLES else repr(n) for n in low]
        out.note(model.key("converters"), f"{', '.join(renamed)}: {float8_not_modelled(precision, kinds)}")
    others = [n.strip() for n in names if n.strip() not in _FLOAT8 | _MX]
    if others or (model.has("converters") and not names):
        out.note(model.key("converters"), f"not read: {', '.join(others) or repr(converters)}: shardplan has "
                                          "no setting for it")
    for table in ("quantize", *_OLD_TABLES):
        if not top.has(table):
            continue
        top.raw(table)
        where, inner = table, top.data[table]
        while isinstance(inner, dict) and len(inner) == 1 and isinstance(next(iter(inner.values())), dict):
            key, inner = next(iter(inner.items()))  # [quantize.linear.float8]: the line of that table
            where = f"{where}.{key}"
        moved = f"torchtitan 0.2 moved [{table}] to [{_OLD_TABLES[table]}] (0.2.2 refuses it); " \
            if table in _OLD_TABLES else ""
        if low:
            out.note(where, f"{moved}configures the converters of model.converters, which are not modelled")
        else:
            out.note(where, f"{moved}not read: no effect without a float8 or mx converter in model.converters")


def _read_checkpoint(ckpt: Reader, job: Reader, out: Imported) -> None:
    """checkpoint.dir / every / keep from [checkpoint] with torchtitan's defaults (DEFAULTS;
    torchtitan/config/job_config.py, `Checkpoint`): the folder is {job.dump_folder}/{folder},
    as components/checkpoint.py joins them; `enable_checkpoint` is the name torchtitan gave
    `enable` before 0.2 (torchtitan PR #1607 renamed it; 0.2.2's ConfigManager refuses it)."""
    if ckpt.has("enable"):
        enabled, where = ckpt.bool("enable"), ckpt.key("enable")
    elif ckpt.has("enable_checkpoint"):
        enabled, where = ckpt.bool("enable_checkpoint"), ckpt.key("enable_checkpoint")
        out.note(where, "torchtitan 0.2 renamed it checkpoint.enable and refuses this name: read as enable")
    else:
        enabled, where = False, ""
    if not enabled:
        for key in ("folder", "interval", "keep_latest_k"):
            if ckpt.has(key):
                ckpt.raw(key)
                out.note(ckpt.key(key), "not read: checkpoint.enable is not true, so torchtitan saves no checkpoints")
        ckpt.unread()
        return
    dump = job.str("dump_folder") if job.has("dump_folder") else DEFAULTS["dump_folder"]
    folder = ckpt.str("folder") if ckpt.has("folder") else DEFAULTS["checkpoint_folder"]
    if dump is not None and folder is not None:
        path = posixpath.normpath(posixpath.join(dump, folder))
        out.set("checkpoint.dir", path, ckpt.key("folder") if ckpt.has("folder") else where)
        if job.has("dump_folder") and not posixpath.isabs(folder):
            out.note(job.key("dump_folder"), f"read for checkpoint.dir ({path}) only: shardplan has no setting for "
                                             "torchtitan's other outputs (logs, traces)")
    interval = ckpt.int("interval", minimum=1) if ckpt.has("interval") else DEFAULTS["checkpoint_interval"]
    if interval:
        out.set("checkpoint.every", interval, ckpt.key("interval") if ckpt.has("interval") else where)
    keep = ckpt.int("keep_latest_k") if ckpt.has("keep_latest_k") else DEFAULTS["keep_latest_k"]
    if keep == 1:  # components/checkpoint.py, CheckpointManager.__init__
        out.problem(ckpt.key("keep_latest_k"), "torchtitan refuses 1: it keeps at least 2 checkpoints, as the last "
                                               "may still be saving (components/checkpoint.py, CheckpointManager); "
                                               "give 0 (keep all) or >= 2")
    elif keep == 0 and interval:
        # torchtitan saves every `interval` steps and at the last step (CheckpointManager._should_save).
        steps = out.tables.get("train", {}).get("steps", DEFAULTS["steps"])
        count = max(1, math.ceil(steps / interval))
        out.set("checkpoint.keep", count, ckpt.key("keep_latest_k"))
        out.note(ckpt.key("keep_latest_k"), f"0 keeps every checkpoint: read as the {count} this run saves "
                                            f"(one every {interval} of {steps} steps and one at the last)")
    elif keep:
        out.set("checkpoint.keep", keep, ckpt.key("keep_latest_k") if ckpt.has("keep_latest_k") else where)
    ckpt.unread()


# [parallelism]'s model-parallel degrees, by the job key each sets.
MODEL_PARALLEL_KEYS = (("parallel.tp", "tensor_parallel_degree"), ("parallel.pp", "pipeline_parallel_degree"),
                       ("parallel.cp", "context_parallel_degree"))


def model_parallel_degrees(data: dict) -> dict[str, object]:
    """The model-parallel degrees a torchtitan config states, by job key (as written)."""
    par = data.get("parallelism") if isinstance(data.get("parallelism"), dict) else {}
    return {job_key: par[key] for job_key, key in MODEL_PARALLEL_KEYS if key in par}


def _read_degrees(par: Reader, out: Imported, dp: int | None, dp_said: str) -> dict:
    values = {}
    for key, default in (("data_parallel_replicate_degree", 1), ("data_parallel_shard_degree", -1),
                         ("tensor_parallel_degree", 1), ("pipeline_parallel_degree", 1),
                         ("context_parallel_degree", 1)):
        value = par.int(key, minimum=-1 if key == "data_parallel_shard_degree" else 1) if par.has(key) else default
        values[key] = default if value is None else value
    replicate, shard = values["data_parallel_replicate_degree"], values["data_parallel_shard_degree"]
    if shard == 0:
        out.problem(par.key("data_parallel_shard_degree"), "must be -1 (the ranks left over) or >= 1 (got 0)")
        shard = 1
    if shard == -1:
        if dp is None:  # read as 1 it plans a job torchtitan would spread over every GPU
            given = "" if par.has("data_parallel_shard_degree") else "not given, torchtitan's default "
            out.problem(par.key("data_parallel_shard_degree"), f"{given}-1 takes the ranks left over, which the "
                                                               "config does not say: give --dp or --world")
            shard = 1
        elif dp % replicate:
            out.problem(par.key("data_parallel_replicate_degree"), f"{replicate} does not divide {dp_said or f'--dp {dp}'}")
            shard = 1
        else:
            shard = dp // replicate
    total = replicate * shard
    out.set("parallel.dp", total, par.key("data_parallel_shard_degree"))
    for job_key, key in MODEL_PARALLEL_KEYS:
        out.set(job_key, values[key], par.key(key))
    if values["tensor_parallel_degree"] > 1:
        out.set("parallel.sequence_parallel", True, par.key("tensor_parallel_degree"))
    reshard = par.choice("fsdp_reshard_after_forward", ("default", "always", "never")) \
        if par.has("fsdp_reshard_after_forward") else DEFAULTS["reshard"]
    pp = values["pipeline_parallel_degree"]
    if shard > 1 or values["context_parallel_degree"] > 1:
        keeps = reshard == "never" or (reshard == "default" and pp > 1)
        out.set("zero.stage", 2 if keeps else 3, par.key("fsdp_reshard_after_forward"))
        if replicate > 1:
            # shardplan's hybrid sharding shards inside a node: a node of shard * cp * tp
            # GPUs holds exactly one HSDP shard group (rank order tp-cp-dp-pp).
            node = shard * values["context_parallel_degree"] * values["tensor_parallel_degree"]
            out.set("zero.hybrid", True, par.key("data_parallel_replicate_degree"))
            out.set("cluster.gpus_per_node", node, par.key("data_parallel_shard_degree"))
            out.note(par.key("data_parallel_replicate_degree"), f"HSDP ({replicate} replicas of {shard} shard ranks) "
                                                                f"is read as hybrid sharding inside nodes of {node} GPUs "
                                                                "(cluster.gpus_per_node; shardplan shards inside a node)")
    else:
        out.set("zero.stage", 0, par.key("data_parallel_shard_degree"))
    return {**values, "data_parallel_shard_degree": shard, "dp": total}


def _read_training(training: Reader, out: Imported, degrees: dict) -> None:
    local = training.int("local_batch_size", 1) if training.has("local_batch_size") else DEFAULTS["local_batch_size"]
    wanted = training.int("global_batch_size", -1) if training.has("global_batch_size") else -1
    local = local or DEFAULTS["local_batch_size"]
    dp = degrees["dp"]
    if wanted is not None and wanted > 0:
        if wanted % (local * dp):
            out.problem(training.key("global_batch_size"), f"{wanted} is not a multiple of local_batch_size "
                                                           f"({local}) * data-parallel degree ({dp})")
            return
        accumulation = wanted // (local * dp)
    else:
        accumulation = 1
    degrees["local_batch_size"], degrees["accumulation"] = local, accumulation
    out.set("parallel.micro_batch_size", local, training.key("local_batch_size"))
    out.set("parallel.num_microbatches", accumulation, training.key("global_batch_size"))
    seq = training.int("seq_len", 1) if training.has("seq_len") else DEFAULTS["seq_len"]
    if seq:
        out.set("train.seq_len", seq, training.key("seq_len"))
    steps = training.int("steps", 1) if training.has("steps") else DEFAULTS["steps"]
    if steps:
        out.set("train.steps", steps, training.key("steps"))
    dtype = training.choice("dtype", ("bfloat16", "float32")) if training.has("dtype") else DEFAULTS["dtype"]
    param = training.choice("mixed_precision_param", ("bfloat16", "float32")) \
        if training.has("mixed_precision_param") else DEFAULTS["mixed_precision_param"]
    if dtype == "bfloat16":
        out.set("train.precision", "bf16", training.key("dtype"))
    elif param == "bfloat16":
        out.set("train.precision", "bf16-mixed", training.key("mixed_precision_param"))
    elif param == "float32":
        out.set("train.precision", "fp32", training.key("mixed_precision_param"))
    offload = training.bool("enable_cpu_offload")
    if offload and not _fsdp_applied(degrees["data_parallel_shard_degree"], degrees["context_parallel_degree"]):
        out.note(training.key("enable_cpu_offload"), f"torchtitan offloads only under FSDP, {_NO_FSDP}: "
                                                     "read as no offload")
    elif offload:
        for key in ("params", "grads", "optimizer"):
            out.set(f"offload.{key}", True, training.key("enable_cpu_offload"))
        out.set("offload.gpu_param_budget", 0, training.key("enable_cpu_offload"))  # every layer
    training.raw("mixed_precision_reduce")
    training.unread("not read: no effect on the plan")


def _read_pipeline(par: Reader, out: Imported, degrees: dict, num_layers: int | None) -> None:
    pp = degrees["pipeline_parallel_degree"]
    names = {v.lower(): k for k, v in SCHEDULES.items()}
    raw = par.str("pipeline_parallel_schedule") if par.has("pipeline_parallel_schedule") else DEFAULTS["schedule"]
    micro = par.int("pipeline_parallel_microbatch_size", 1) if par.has("pipeline_parallel_microbatch_size") \
        else DEFAULTS["microbatch_size"]
    fqns = par.raw("module_fqns_per_model_part")
    layers_per_stage = par.int("pipeline_parallel_layers_per_stage", 1) \
        if par.has("pipeline_parallel_layers_per_stage") else None
    first_less = par.int("pipeline_parallel_first_stage_less_layers") \
        if par.has("pipeline_parallel_first_stage_less_layers") else DEFAULTS["first_less"]
    last_less = par.int("pipeline_parallel_last_stage_less_layers") \
        if par.has("pipeline_parallel_last_stage_less_layers") else DEFAULTS["last_less"]
    if pp == 1 or raw is None:
        return
    schedule = names.get(raw.lower())
    if schedule is None:
        out.note(par.key("pipeline_parallel_schedule"), f"{raw!r} has no shardplan schedule; planned as 1f1b")
        schedule = "1f1b"
    out.set("parallel.pipeline_schedule", schedule, par.key("pipeline_parallel_schedule"))
    # Pipeline microbatches come from the local batch: local_batch_size / microbatch size.
    local = degrees.get("local_batch_size", DEFAULTS["local_batch_size"])
    micro = micro or 1
    if local % micro:
        out.problem(par.key("pipeline_parallel_microbatch_size"), f"{micro} does not divide training."
                                                                  f"local_batch_size ({local})")
        return
    out.set("parallel.micro_batch_size", micro, par.key("pipeline_parallel_microbatch_size"))
    out.set("parallel.num_microbatches", local // micro * degrees.get("accumulation", 1), "training.local_batch_size")
    if degrees.get("accumulation", 1) > 1:
        out.note("training.global_batch_size", "gradient accumulation over pipeline steps is planned as more "
                                               "microbatches per step")
    first_less, last_less = first_less or 0, last_less or 0
    if layers_per_stage and num_layers is not None:
        refused = _refused_layers_per_stage(raw, pp, num_layers, first_less, last_less, layers_per_stage)
        if refused:
            out.problem(par.key("pipeline_parallel_layers_per_stage"), refused)
            return
    if isinstance(fqns, list) and fqns and all(isinstance(p, list) for p in fqns):
        counts = [sum(1 for name in part if str(name).startswith("layers.")) for part in fqns]
        where = par.key("module_fqns_per_model_part")
    else:
        if fqns is not None:
            out.problem(par.key("module_fqns_per_model_part"), "expected a list of lists of module names")
            return
        if num_layers is None:
            out.note(par.key("pipeline_parallel_degree"), "without the model's layers torchtitan's stage split "
                                                          "cannot be read; planned as the even split")
            return
        if layers_per_stage:  # pipeline_llm: ceil(effective layers / layers per stage) stages
            num_stages = math.ceil((num_layers + first_less + last_less) / layers_per_stage)
        else:  # pipeline_llm's default: one stage per rank for single-stage schedules, else two
            num_stages = pp * (1 if _TORCH_SINGLE_STAGE.get(raw.lower(), schedule in _SINGLE_STAGE) else 2)
        refused = _refused_split(num_stages, num_layers, first_less, last_less)
        if refused:
            key = "pipeline_parallel_layers_per_stage" if layers_per_stage else "pipeline_parallel_degree"
            out.problem(par.key(key), refused)
            return
        counts = torchtitan_split(num_stages, num_layers, first_less, last_less)
        where = par.key("pipeline_parallel_first_stage_less_layers")
    if len(counts) % pp:
        out.problem(where, f"{len(counts)} stages do not divide over pipeline_parallel_degree {pp}")
        return
    chunks = len(counts) // pp
    if chunks > 1:
        if schedule in _CHUNKED:
            out.set("parallel.virtual_stages", chunks, where)
        else:
            out.note(where, f"{chunks} stages per rank: shardplan plans {schedule} with one; read as the even split")
            return
    total = sum(counts)
    if len(counts) > 1 and 0 not in counts:
        first, last = counts[0], counts[-1]
        even = split_layers(total, len(counts))
        if counts != even:
            mine = split_layers(total, len(counts), first, last)
            out.set("parallel.first_stage_layers", first, where)
            out.set("parallel.last_stage_layers", last, where)
            if mine != counts:
                out.note(where, f"stages of {counts} layers: shardplan keeps the first ({first}) and last ({last}) "
                                f"and splits the rest evenly: {mine}")


# torch's schedule classes by the name torchtitan hands to `get_schedule_class`
# (torch/distributed/pipelining/schedules.py): True for PipelineScheduleSingle subclasses, one
# stage per rank; False for PipelineScheduleMulti subclasses, several.
_TORCH_SINGLE_STAGE = {
    "1f1b": True, "gpipe": True, "pipelineschedulesingle": True, "interleaved1f1b": False, "loopedbfs": False,
    "interleavedzerobubble": False, "pipelineschedulemulti": False, "zbvzerobubble": False, "dualpipev": False,
}
_PIPELINE_LLM = "torchtitan/distributed/pipeline_parallel.py, pipeline_llm"
_FQN_SPLIT = "torchtitan/distributed/pipeline_parallel.py, generate_llm_fqn_per_model_part"


def _refused_layers_per_stage(schedule: str, pp: int, num_layers: int, first_less: int, last_less: int,
                              layers_per_stage: int) -> str | None:
    """Why torchtitan refuses pipeline_parallel_layers_per_stage, else None: its number of
    virtual stages, ceil((layers + first_stage_less_layers + last_stage_less_layers) /
    layers_per_stage), must be divisible by the pipeline degree, giving exactly one stage per
    rank to a single-stage schedule and at least two to a multi-stage one (pipeline_llm)."""
    stages = math.ceil((num_layers + first_less + last_less) / layers_per_stage)
    made = (f"{layers_per_stage} layers per stage make ceil(({num_layers} layers + first_stage_less_layers "
            f"{first_less} + last_stage_less_layers {last_less}) / {layers_per_stage}) = {stages} stages")
    if stages % pp:
        return (f"{made}, which pipeline_parallel_degree {pp} does not divide; torchtitan refuses it (the number "
                f"of virtual stages must be divisible by the pipeline parallel size: {_PIPELINE_LLM})")
    per_rank = stages // pp
    single = _TORCH_SINGLE_STAGE.get(schedule.lower())
    if single is True and per_rank != 1:
        return (f"{made}, {per_rank} per rank; torchtitan refuses it ({schedule} is a single-stage schedule, "
                f"which requires exactly 1 stage per rank: {_PIPELINE_LLM})")
    if single is False and per_rank < 2:
        return (f"{made}, {per_rank} per rank; torchtitan refuses it ({schedule} is a multi-stage schedule, "
                f"which requires at least 2 stages per rank: {_PIPELINE_LLM})")
    return None


def _refused_split(num_stages: int, num_layers: int, first_less: int, last_less: int) -> str | None:
    """Why torchtitan's own stage split refuses these stages, else None: at most one stage per
    effective layer, and the embedding's and head's weights at most the smallest stage's share
    (generate_llm_fqn_per_model_part)."""
    if num_stages == 1:
        return None
    effective = num_layers + first_less + last_less
    counted = f"{effective} effective layers ({num_layers} + first_stage_less_layers {first_less} + " \
              f"last_stage_less_layers {last_less})"
    if num_stages > effective:
        return f"{num_stages} stages exceed the {counted}; torchtitan refuses it ({_FQN_SPLIT})"
    share = effective // num_stages
    for name, weight in (("first", first_less), ("last", last_less)):
        if weight > share:
            return (f"pipeline_parallel_{name}_stage_less_layers {weight} exceeds the {share} layers of the smallest "
                    f"of {num_stages} stages over {counted}; torchtitan refuses it ({_FQN_SPLIT})")
    return None


def dumps(config: dict) -> str:
    import tomli_w

    return tomli_w.dumps(config)
