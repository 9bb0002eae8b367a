"""A torchtitan job config (TOML) as job-file tables: the import half of the torchtitan format
(torchtitan.py, which re-exports `from_torchtitan`, `model_preset` and `model_parallel_degrees`).

Keys the config leaves out take torchtitan's defaults (torchtitan_common.py `DEFAULTS`, from
torchtitan 0.2.2's torchtitan/config/job_config.py); the pipeline stages are torchtitan's own
split (torchtitan/distributed/pipeline_parallel.py, `pipeline_llm` and
`generate_llm_fqn_per_model_part`), and what torchtitan refuses is refused with its arithmetic.
"""

from __future__ import annotations

import math
import posixpath

from ...core.pipeline import split_layers
from .common import Imported, Reader, float8_not_modelled, offload_as_written
from .torchtitan_common import CHUNKED, DEFAULTS, FLAVORS, NO_FSDP, SCHEDULES, fsdp_applied


def model_preset(data: dict) -> str | None:
    """The shardplan preset of the config's [model], if one matches."""
    model = data.get("model") if isinstance(data.get("model"), dict) else {}
    key = (model.get("name", "llama3"), model.get("flavor", "debugmodel"))
    if not all(isinstance(part, str) for part in key):
        return None  # a mistyped name or flavor: the import's own checks say so
    return FLAVORS.get(key)


def _ordinal(text: str) -> str:
    """`2` -> `2nd` (torchtitan's selective_ac_option is a layer interval, written as a string)."""
    number = int(text) if str(text).isdigit() else None
    if number is None:
        return f"{text}th"
    suffix = "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")
    return f"{number}{suffix}"


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


# Names torchtitan's job config had before 0.2, as (table, key) -> (table, key) of today, with the
# commit of pytorch/torchtitan that renamed or moved it (`git log -p -- torchtitan/config_manager.py`).
# The published train_configs of 2024 to spring 2025 use them; torchtitan 0.2.2 refuses them
# ("Invalid field names"), and the torchtitan they were written for read no other name: its
# ConfigManager merged the TOML over its argparse defaults and ignored keys it did not define.
_RENAMED = {
    # 8570415c3 (2025-06-05, PR #1238, gradient accumulation): batch_size became local_batch_size.
    ("training", "batch_size"): ("training", "local_batch_size", "8570415c3"),
    # 785c34c99 (2025-03-18, PR #980) made [parallelism] of [training]'s degrees and [experimental]'s.
    ("training", "data_parallel_replicate_degree"): ("parallelism", "data_parallel_replicate_degree", "785c34c99"),
    ("training", "data_parallel_shard_degree"): ("parallelism", "data_parallel_shard_degree", "785c34c99"),
    ("training", "tensor_parallel_degree"): ("parallelism", "tensor_parallel_degree", "785c34c99"),
    ("training", "fsdp_reshard_after_forward"): ("parallelism", "fsdp_reshard_after_forward", "785c34c99"),
    ("experimental", "pipeline_parallel_degree"): ("parallelism", "pipeline_parallel_degree", "785c34c99"),
    ("experimental", "pipeline_parallel_schedule"): ("parallelism", "pipeline_parallel_schedule", "785c34c99"),
    ("experimental", "pipeline_parallel_microbatches"): ("parallelism", "pipeline_parallel_microbatches",
                                                         "785c34c99"),
    ("experimental", "pipeline_parallel_split_points"): ("parallelism", "pipeline_parallel_split_points",
                                                         "785c34c99"),
    ("experimental", "context_parallel_degree"): ("parallelism", "context_parallel_degree", "785c34c99"),
    # aafe0e870 (2024-05-21, pipeline parallel) moved training.pipeline_parallel_degree to [experimental].
    ("training", "pipeline_parallel_degree"): ("parallelism", "pipeline_parallel_degree", "aafe0e870"),
    # db6b39acd (2024-09-10, HSDP) split data_parallel_degree (-1: the ranks left over) into the
    # shard degree (the same meaning) and a replicate degree (default 1).
    ("training", "data_parallel_degree"): ("parallelism", "data_parallel_shard_degree", "db6b39acd"),
}


# [experimental] keys 785c34c99 (2025-03-18) moved to [parallelism] that shardplan does not read
# (torchtitan/config_manager.py of that commit; the degrees and schedule are in `_RENAMED`).
_MOVED_TO_PARALLELISM = ("enable_async_tensor_parallel", "enable_compiled_autograd",
                         "context_parallel_rotate_method", "pipeline_parallel_schedule_csv")


def renamed(data: dict) -> tuple[dict, dict[str, str], list[tuple[str, str]]]:
    """A torchtitan config with its pre-0.2 names (`_RENAMED`) under today's: (the config as
    today's names write it, {today's dotted key: the dotted key the file wrote}, notes as
    (dotted key, message)). Where the file gives both names, today's is read and the old one
    is named as not read: no torchtitan release reads both, and 0.2 reads today's."""
    tables = {name: dict(value) if isinstance(value, dict) else value for name, value in data.items()}
    written_as: dict[str, str] = {}
    notes = []
    for (old_table, old_key), (table, key, commit) in _RENAMED.items():
        source = tables.get(old_table)
        target = tables.setdefault(table, {})
        if not isinstance(source, dict) or old_key not in source or not isinstance(target, dict):
            continue  # a table that is no table: the import says so
        old, new = f"{old_table}.{old_key}", f"{table}.{key}"
        value = source.pop(old_key)
        if not source and old_table == "experimental":
            del tables[old_table]
        if key in target:
            given = written_as.get(new, new)
            notes.append((old, f"not read: torchtitan commit {commit} renamed it {new}, and {given} is given and "
                               "read instead"))
            continue
        target[key] = value
        written_as[new] = old
        notes.append((old, f"the name before torchtitan commit {commit} (torchtitan 0.2 refuses it): read as {new}"))
    return {name: value for name, value in tables.items() if value != {} or name in data}, written_as, notes


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
    data, written_as, renames = renamed(data)
    for key, message in renames:
        out.note(key, message)
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
    par = Reader(tables["parallelism"], "parallelism", out, _within(written_as, "parallelism"))
    degrees = _read_degrees(par, out, dp, dp_said)
    _read_training(Reader(tables["training"], "training", out, _within(written_as, "training")), out, degrees)
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
    if isinstance(data.get("experimental"), dict):
        # What [experimental] keeps after the degrees are read (`renamed`): each key named, those
        # 785c34c99 moved to [parallelism] (enable_async_tensor_parallel, ...) with their new name.
        experimental = Reader(top.table("experimental"), "experimental", out)
        for name in experimental.data:
            if name in _MOVED_TO_PARALLELISM:
                experimental.raw(name)
                out.note(experimental.key(name), f"not read: shardplan has no setting for it (torchtitan commit "
                                                 f"785c34c99 moved it to parallelism.{name}; 0.2 refuses this name)")
        experimental.unread("not read: no effect on the plan")
    top.unread("not read: no effect on the plan")
    offload_as_written(out)
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


def _within(written_as: dict[str, str], table: str) -> dict[str, str]:
    """`renamed`'s record for one table: {key: the dotted key the file wrote it as}."""
    return {path.split(".", 1)[1]: old for path, old in written_as.items() if path.startswith(f"{table}.")}


def model_parallel_degrees(data: dict) -> dict[str, object]:
    """The model-parallel degrees a torchtitan config states, by job key (as written, under
    its pre-0.2 names too)."""
    data = renamed(data)[0]
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
    if dp is not None and total != dp:  # a shard degree the config gives, against the command line
        out.problem(par.key("data_parallel_shard_degree"), f"replicate {replicate} x shard {shard} makes dp {total}, "
                                                           f"but {dp_said or f'--dp {dp}'}")
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
    if offload and not fsdp_applied(degrees["data_parallel_shard_degree"], degrees["context_parallel_degree"]):
        out.note(training.key("enable_cpu_offload"), f"torchtitan offloads only under FSDP, {NO_FSDP}: "
                                                     "read as no offload")
    elif offload:
        for key in ("params", "grads", "optimizer"):
            out.set(f"offload.{key}", True, training.key("enable_cpu_offload"))
        out.set("offload.gpu_param_budget", 0, training.key("enable_cpu_offload"))  # every layer
    # torchtitan 2f989b9f3 (2024-07-18) to db6b39acd (2024-09-10, HSDP): data_parallel_type "ddp"
    # replicated the model over data_parallel_degree's ranks, "fsdp" (the default) sharded it.
    kind = training.choice("data_parallel_type", ("fsdp", "ddp")) if training.has("data_parallel_type") else None
    if kind:
        if kind == "ddp":
            out.set("zero.stage", 0, training.key("data_parallel_type"))
        read = "DDP, read as zero.stage = 0" if kind == "ddp" else "FSDP, as data_parallel_shard_degree shards"
        out.note(training.key("data_parallel_type"), f"a key before torchtitan commit db6b39acd (torchtitan 0.2 "
                                                     f"refuses it): {read}")
    training.raw("mixed_precision_reduce")
    training.unread("not read: no effect on the plan")


def _read_pipeline(par: Reader, out: Imported, degrees: dict, num_layers: int | None) -> None:
    pp = degrees["pipeline_parallel_degree"]
    names = {v.lower(): k for k, v in SCHEDULES.items()}
    raw = par.str("pipeline_parallel_schedule") if par.has("pipeline_parallel_schedule") else DEFAULTS["schedule"]
    micro = par.int("pipeline_parallel_microbatch_size", 1) if par.has("pipeline_parallel_microbatch_size") \
        else DEFAULTS["microbatch_size"]
    fqns = par.raw("module_fqns_per_model_part")
    # Before torchtitan 0.2 (5e2033c75, 2025-04-07, PR #1073) the number of microbatches was given,
    # and the stages by the first layer of each but the first (6e06a49cd, 2025-10-13, PR #1868
    # replaced split points with module_fqns_per_model_part).
    count = par.int("pipeline_parallel_microbatches", 1) if par.has("pipeline_parallel_microbatches") else None
    splits = par.raw("pipeline_parallel_split_points")
    layers_per_stage = par.int("pipeline_parallel_layers_per_stage", 1) \
        if par.has("pipeline_parallel_layers_per_stage") else None
    first_less = par.int("pipeline_parallel_first_stage_less_layers") \
        if par.has("pipeline_parallel_first_stage_less_layers") else DEFAULTS["first_less"]
    last_less = par.int("pipeline_parallel_last_stage_less_layers") \
        if par.has("pipeline_parallel_last_stage_less_layers") else DEFAULTS["last_less"]
    if pp == 1 or raw is None:
        return
    if raw.lower() not in _TORCH_SINGLE_STAGE:
        out.problem(par.key("pipeline_parallel_schedule"), f"must be one of {', '.join(_TORCH_SCHEDULES)}, in any case "
                                                           f"(got {raw!r}): torchtitan refuses other names "
                                                           "(torch/distributed/pipelining/schedules.py, "
                                                           "get_schedule_class)")
        return
    schedule = names.get(raw.lower())
    if schedule is None:  # a torch schedule shardplan does not plan (ZBVZeroBubble, DualPipeV, ...)
        out.note(par.key("pipeline_parallel_schedule"), f"{raw!r} has no shardplan schedule; planned as 1f1b")
        schedule = "1f1b"
    out.set("parallel.pipeline_schedule", schedule, par.key("pipeline_parallel_schedule"))
    # Pipeline microbatches come from the local batch: local_batch_size / microbatch size.
    local = degrees.get("local_batch_size", DEFAULTS["local_batch_size"])
    micro = micro or 1
    if count and not par.has("pipeline_parallel_microbatch_size"):
        if local % count:
            out.problem(par.key("pipeline_parallel_microbatches"), f"{count} microbatches do not divide training."
                                                                   f"local_batch_size ({local}); torchtitan refuses it")
            return
        micro = local // count
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
    elif splits and fqns is None:
        where = par.key("pipeline_parallel_split_points")
        counts = _split_point_counts(splits, num_layers)
        if isinstance(counts, str):
            out.problem(where, counts)
            return
        if not counts:
            out.note(where, "without the model's layers the stages cannot be read; planned as the even split")
            return
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
            num_stages = pp * (1 if _TORCH_SINGLE_STAGE[raw.lower()] else 2)
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
        if schedule in CHUNKED:
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


def _split_point_counts(splits: object, num_layers: int | None) -> list[int] | str | None:
    """Layers per stage from pipeline_parallel_split_points (torchtitan before 0.2: each names
    the first layer of a stage but the first, "layers.4,layers.8" makes three stages; a string
    is split at commas), or why they are refused; None without the model's layers."""
    names = splits.split(",") if isinstance(splits, str) else splits
    if not isinstance(names, list) or not all(isinstance(n, str) and n.strip().startswith("layers.") and
                                              n.strip()[7:].isdigit() for n in names):
        return f"expected layer names (\"layers.4\", ...), got {splits!r}"
    if num_layers is None:
        return None
    bounds = [0, *(int(n.strip()[7:]) for n in names), num_layers]
    counts = [b - a for a, b in zip(bounds, bounds[1:])]
    if any(c <= 0 for c in counts):
        return f"the split points must rise from layers.1 to layers.{num_layers - 1} (the model has {num_layers} layers)"
    return counts


# torch's schedule classes by the name torchtitan hands to `get_schedule_class`
# (torch/distributed/pipelining/schedules.py; its names, in its order, matched in any case):
# True for PipelineScheduleSingle subclasses, one stage per rank; False for
# PipelineScheduleMulti subclasses, several. Any other name raises ValueError there, and
# torchtitan's `pipeline_llm` asks for the class before anything else.
_TORCH_SCHEDULES = {
    "1F1B": True, "Interleaved1F1B": False, "GPipe": True, "LoopedBFS": False, "InterleavedZeroBubble": False,
    "PipelineScheduleSingle": True, "PipelineScheduleMulti": False, "ZBVZeroBubble": False, "DualPipeV": False,
}
_TORCH_SINGLE_STAGE = {name.lower(): single for name, single in _TORCH_SCHEDULES.items()}
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
