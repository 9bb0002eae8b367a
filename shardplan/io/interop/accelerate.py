"""The plan as an accelerate config YAML (FSDP2 plugin), and an accelerate config as tables.

Keys and meanings: accelerate 1.15, accelerate/commands/config/config_args.py
(`ClusterConfig`: distributed_type, mixed_precision, num_machines, num_processes,
fsdp_config, parallelism_config, deepspeed_config), accelerate/utils/launch.py (how
`accelerate launch` hands fsdp_config to `FullyShardedDataParallelPlugin` and
parallelism_config to `ParallelismConfig`), accelerate/utils/dataclasses.py
(`FullyShardedDataParallelPlugin`: fsdp_version 2 takes reshard_after_forward as a bool; FSDP1
sharding strategies FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD, HYBRID_SHARD_ZERO2 are
1-5; `fsdp_offload_params` is FSDP2's CPUOffloadPolicy, which moves a module's parameters,
gradients and optimizer step to the CPU; `fsdp_activation_checkpointing` recomputes every
wrapped transformer block), accelerate/parallelism_config.py (dp_replicate, dp_shard, tp, cp;
FSDP2 only). Under `distributed_type: DEEPSPEED`, `DeepSpeedPlugin` (the same dataclasses.py)
takes `deepspeed_config_file`, a DeepSpeed config JSON that the DeepSpeed importer reads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Collection

from ...core.estimate_inputs import EstimateInputs
from ...spec.job import FSDP_STAGE_NAMES
from .common import (Exported, Imported, Note, Plan, Reader, float8_not_modelled, integral, offload_as_written,
                     unexpressed)
from .offload import whole_model_offload
from .source import Referenced

TARGET = "accelerate"

FSDP1_STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2")
_MIXED = {"bf16-mixed": "bf16", "fp16-mixed": "fp16", "fp32": "no", "bf16": "bf16"}

COVERED = (
    "parallel.dp", "parallel.tp", "parallel.cp", "zero.stage", "zero.hybrid", "zero.min_num_params",
    "offload.params", "offload.grads", "offload.optimizer", "offload.gpu_param_budget", "offload.pin_memory",
    "train.precision", "train.activation_checkpointing",
)


def as_written(inputs: EstimateInputs) -> EstimateInputs:
    """The plan as accelerate's config writes it, whose fit the offload note checks: no
    pipeline parallel, the stages' ranks data parallel (`to_accelerate`), each with the
    whole model and the same micro batch and accumulation; ZeRO-0 with tensor or context
    parallel under FSDP2 with reshard_after_forward false, which shards gradients and
    optimizer states as ZeRO-2."""
    d = inputs.degrees
    if d.pp > 1:
        inputs = inputs.with_(degrees=replace(d, dp=d.dp * d.pp, pp=1), schedule="1f1b", virtual=1,
                              stage_split=(0, 0))
    if inputs.zero_stage == 0 and (d.tp > 1 or d.cp > 1):
        inputs = inputs.with_(zero_stage=2)
    return inputs


def to_accelerate(plan: Plan) -> Exported:
    job = plan.job
    par, zero, off, train = job.parallel, job.zero, job.offload, job.train
    notes: list[Note] = []
    config: dict = {"compute_environment": "LOCAL_MACHINE", "debug": False}
    fsdp = zero.stage > 0 or par.tp > 1 or par.cp > 1
    if fsdp:
        config["distributed_type"] = "FSDP"
    else:
        config["distributed_type"] = "MULTI_GPU" if plan.world > 1 else "NO"
    config["mixed_precision"] = _MIXED[train.precision]
    if zero.framework == "deepspeed":
        # A DeepSpeed job (one imported from `distributed_type: DEEPSPEED`) is written as FSDP2,
        # the engine this export writes; accelerate runs DeepSpeed from a config file.
        notes.append(Note("zero.framework", "the job plans DeepSpeed's engine; written for FSDP2, whose memory "
                                            "differs: to keep DeepSpeed, write its config with `shardplan export "
                                            "--to deepspeed` and name it as deepspeed_config_file under "
                                            "distributed_type: DEEPSPEED"))
    if train.precision == "bf16":
        notes.append(Note("train.precision", "accelerate keeps fp32 parameters under bf16 autocast; pure bf16 "
                                             "training is written as mixed_precision bf16"))
    # use_cpu: false leaves the device to the machine, as `shardplan run` does (runtime/dist.py,
    # pick_device: CUDA where a GPU exists, else the CPU with gloo); a job file says no device.
    # true would not run this plan on CPUs either: accelerate 1.15 hands use_cpu to the workers
    # only through its simple launcher (accelerate/utils/launch.py:133), not the multi-GPU one
    # that FSDP and MULTI_GPU take (commands/launch.py:1399), and on the CPU it runs MULTI_CPU
    # with gloo and DDP, never FSDP (state.py:808; FSDP is set only for GPU-like types, :986-1013).
    config.update(num_machines=plan.nodes, num_processes=plan.world, machine_rank=0,
                  main_training_function="main", rdzv_backend="static", same_network=True, use_cpu=False)
    if fsdp:
        if zero.stage == 1:
            notes.append(Note("zero.stage", "FSDP2 cannot shard optimizer states alone (ZeRO-1); written with "
                                            "reshard_after_forward false (gradients sharded too)"))
        elif zero.stage == 0:
            notes.append(Note("zero.stage", "accelerate runs tensor and context parallel under FSDP2 only; "
                                            "written with reshard_after_forward false"))
        offload_params, decided_note = off.params, ""
        if plan.offload.changed:  # the offload strategy's decision, in the one setting FSDP2 has
            offload_params, decided_note = whole_model_offload(plan.offload, "fsdp_offload_params", zero.stage,
                                                               relayout=as_written)
        fsdp_config = {
            "fsdp_version": 2,
            "fsdp_reshard_after_forward": zero.stage == 3,
            "fsdp_offload_params": offload_params,
            "fsdp_activation_checkpointing": train.activation_checkpointing != "none",
            # What `accelerate config` answers by default for FSDP2 (accelerate 1.15
            # commands/config/cluster.py:464-492: the first of FSDP2_STATE_DICT_TYPE,
            # SHARDED_STATE_DICT, and CPU-RAM-efficient loading "[YES/no]"): only the first
            # process reads the pretrained weights. The job plans neither (the start-up host
            # memory is `run`'s), and an imported config's values are noted as not read.
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_cpu_ram_efficient_loading": True,
        }
        if zero.min_num_params:
            fsdp_config.update(fsdp_auto_wrap_policy="SIZE_BASED_WRAP", fsdp_min_num_params=zero.min_num_params)
        else:
            fsdp_config["fsdp_auto_wrap_policy"] = "TRANSFORMER_BASED_WRAP"
        config["fsdp_config"] = fsdp_config
        # accelerate has no pipeline parallel: num_processes is the whole world, so the
        # pipeline stages' ranks join data parallel (ParallelismConfig's sizes must multiply
        # to num_processes, `_validate_accelerator`): more replicas under hybrid sharding,
        # more shard ranks otherwise.
        replicate, shard = 1, par.dp * par.pp
        if zero.hybrid:
            replicate, shard, hybrid_note = plan.hybrid_degrees(par.dp * par.pp, "accelerate")
            if hybrid_note:
                notes.append(Note("zero.hybrid", hybrid_note))
        if zero.hybrid or par.tp > 1 or par.cp > 1:
            config["parallelism_config"] = {
                "parallelism_config_dp_replicate_size": replicate,
                "parallelism_config_dp_shard_size": shard,
                "parallelism_config_tp_size": par.tp,
                "parallelism_config_cp_size": par.cp,
            }
        if plan.offload.changed:
            if decided_note:
                notes.append(Note("offload", decided_note))
        elif any((off.params, off.grads, off.optimizer)) and not all((off.params, off.grads, off.optimizer)):
            notes.append(Note("offload", "FSDP2's CPU offload moves parameters, gradients and optimizer states "
                                         f"together; written as {str(off.params).lower()} from offload.params"))
        if not plan.offload.changed and (kept := plan.offload.kept_note("FSDP2's CPU offload")):
            notes.append(Note("offload.gpu_param_budget", kept))
        if not off.pin_memory and offload_params:
            notes.append(Note("offload.pin_memory", "accelerate's CPUOffloadPolicy always pins; false is not exported"))
        if train.activation_checkpointing in ("selective", "op"):
            notes.append(Note("train.activation_checkpointing", "accelerate recomputes whole transformer blocks; "
                                                                f"{train.activation_checkpointing!r} is written as "
                                                                "fsdp_activation_checkpointing"))
    else:
        if plan.offload.changed:
            notes.append(Note("offload", whole_model_offload(
                plan.offload, "fsdp_offload_params", zero.stage,
                "accelerate offloads to the CPU only under FSDP or DeepSpeed",
                "export it with --zero 3, which accelerate writes as FSDP2, or export to deepspeed",
                relayout=as_written)[1]))
        elif any((off.params, off.grads, off.optimizer)):
            notes.append(Note("offload", "accelerate offloads to the CPU only under FSDP or DeepSpeed"))
        if train.activation_checkpointing != "none":
            notes.append(Note("train.activation_checkpointing", "without FSDP accelerate's config has no "
                                                                "activation checkpointing (enable it in the model)"))
    if par.pp > 1:
        notes.append(Note("parallel.pp", f"accelerate has no pipeline parallel: the {par.pp} stages' ranks are "
                                         f"written as data parallel ({par.dp * par.pp} data-parallel ranks of "
                                         f"{plan.world} processes)"))
    if par.micro_batch_size > 1 or par.num_microbatches > 1:
        # One line for both keys, named by the one the plan changes (accumulation first).
        steps = f"{par.num_microbatches} step{'s' if par.num_microbatches > 1 else ''}"
        notes.append(Note("parallel.num_microbatches" if par.num_microbatches > 1 else "parallel.micro_batch_size",
                          "accelerate takes batch size and gradient accumulation in the training script "
                          "(Accelerator(gradient_accumulation_steps=...)); "
                          f"micro batch {par.micro_batch_size}, {steps}"))
    if job.model.source is not None:
        notes.append(Note("model", "accelerate's config has no model: the training script builds it"))
    covered = COVERED if fsdp else ("parallel.dp", "train.precision", "offload.params", "offload.grads",
                                    "offload.optimizer", "train.activation_checkpointing")
    said = {note.path for note in notes}
    if said & {"parallel.micro_batch_size", "parallel.num_microbatches"}:
        said |= {"parallel.micro_batch_size", "parallel.num_microbatches"}  # the batch line says both
    notes += [note for note in unexpressed(plan, covered, TARGET) if note.path not in said]
    return Exported(config, notes)


def dumps(config: dict) -> str:
    import yaml  # imported here: planning commands never pay for it

    return yaml.safe_dump(config, sort_keys=False, default_flow_style=False)


# -- import ---------------------------------------------------------------------------------
def from_accelerate(data: dict, referenced: dict[str, Referenced] | None = None, world: int | None = None,
                    dp: int | None = None, hidden_size: int | None = None, given: Collection[str] = ()) -> Imported:
    """Job tables from an accelerate config. `referenced`: the files it names, read by the
    caller (source.py `read_referenced`), by dotted key: the DeepSpeed config of
    `deepspeed_config.deepspeed_config_file`. `world` and `dp`: what the command line gives
    (--world, --dp), which stand for `accelerate launch --num_processes` where the config
    leaves num_processes out. `hidden_size` and `given`: the DeepSpeed importer's (the model's
    hidden size, the job keys the command line sets), for that file."""
    out = Imported()
    top = Reader(data, "", out)
    kind = top.choice("distributed_type", ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED", "MULTI_CPU", "MEGATRON_LM",
                                            "XLA", "MULTI_XPU", "MULTI_NPU", "MULTI_MLU", "MULTI_SDAA",
                                            "MULTI_MUSA", "MULTI_HPU")) if top.has("distributed_type") else "NO"
    machines = top.int("num_machines", minimum=1) if top.has("num_machines") else 1
    machines = machines or 1
    parallelism = top.table("parallelism_config") if top.has("parallelism_config") else None
    reader = Reader(parallelism or {}, "parallelism_config", out)
    sizes = {}
    for name in _PARALLELISM_SIZES:
        key = f"parallelism_config_{name}_size"
        sizes[name] = reader.int(key, minimum=1) if reader.has(key) else None
    tp, sp = sizes["tp"] or 1, sizes["sp"] or 1
    cp = (sizes["cp"] or 1) * sp  # accelerate refuses both above 1 (ParallelismConfig.__post_init__)
    replicate = sizes["dp_replicate"]
    processes = _processes(top, out, kind, world, dp, tp * cp, machines)
    if processes is None:
        return out
    mixed = top.choice("mixed_precision", ("no", "fp16", "bf16", "fp8")) if top.has("mixed_precision") else "no"
    if mixed == "fp8":
        out.note("mixed_precision", f"fp8 is read as bf16-mixed: {float8_not_modelled('bf16-mixed')}")
    if mixed:
        out.set("train.precision", {"no": "fp32", "fp16": "fp16-mixed"}.get(mixed, "bf16-mixed"), "mixed_precision")
    if parallelism is not None:
        total = math.prod(size or 1 for size in sizes.values())
        if total != 1 and total != processes:  # sizes all 1: accelerate replicates over every process
            given = [name for name, size in sizes.items() if size is not None]
            where = reader.key(f"parallelism_config_{'dp_shard' if 'dp_shard' in given else given[0]}_size")
            product = " * ".join(f"{name} {size or 1}" for name, size in sizes.items() if name != "sp" or size)
            out.problem(where, f"{product} = {total} does not match num_processes ({processes}); accelerate "
                               "rejects it (ParallelismConfig: total_size must equal num_processes)")
            return out
        shard = sizes["dp_shard"]
        if kind == "FSDP" and replicate and replicate > 1 and shard and shard * tp * cp != processes // machines:
            # shardplan's hybrid sharding shards inside a node: a node of shard * cp * tp GPUs
            # holds exactly one HSDP shard group (accelerate's mesh puts tp fastest, then cp,
            # dp_shard and dp_replicate: ParallelismConfig._get_mesh), as torchtitan's import reads it.
            node = shard * tp * cp
            out.set("cluster.gpus_per_node", node, reader.key("parallelism_config_dp_shard_size"))
            out.set("cluster.nodes", processes // node, reader.key("parallelism_config_dp_replicate_size"))
            out.note(reader.key("parallelism_config_dp_shard_size"),
                     f"HSDP ({replicate} replicas of {shard} shard ranks) is read as hybrid sharding inside nodes of "
                     f"{node} GPUs (cluster.gpus_per_node, cluster.nodes; shardplan shards inside a node)")
        out.set("parallel.tp", tp, reader.key("parallelism_config_tp_size"))
        out.set("parallel.cp", cp, reader.key("parallelism_config_sp_size" if sp > 1 else "parallelism_config_cp_size"))
        if sp > 1:
            out.note(reader.key("parallelism_config_sp_size"),
                     f"Ulysses sequence parallelism (DeepSpeed's ALST) over {sp} ranks is planned as context parallel "
                     f"(parallel.cp = {sp}): each rank keeps the activations of 1/{sp} of the sequence, and ZeRO "
                     "shards over the data-parallel and sequence-parallel ranks together, as DeepSpeed does")
        reader.unread()
    if processes % (tp * cp):
        out.problem("num_processes", f"{processes} is not divisible by tp ({tp}) * cp ({cp})")
        return out
    dp = processes // (tp * cp)
    out.set("parallel.dp", dp, "num_processes")
    if kind == "FSDP":
        fsdp = top.table("fsdp_config") if top.has("fsdp_config") else {}
        _fsdp(Reader(fsdp or {}, "fsdp_config", out), out, replicate, dp)
    elif kind == "DEEPSPEED":
        ds = top.table("deepspeed_config") if top.has("deepspeed_config") else {}
        _deepspeed(Reader(ds or {}, "deepspeed_config", out), out, top, processes, referenced or {}, cp,
                   hidden_size, given)
    elif kind in ("NO", "MULTI_GPU", "MULTI_CPU"):
        out.set("zero.stage", 0, "distributed_type")
    elif kind:
        out.note("distributed_type", f"{kind} is planned as plain data parallel")
    for key in _LAUNCHER_KEYS:
        if top.has(key):
            top.raw(key)
            out.note(key, _CPU if key == "use_cpu" and top.data[key] is True else _LAUNCHER)
    top.unread("not read: no effect on the plan")
    offload_as_written(out)
    return out


# ParallelismConfig's sizes as accelerate launch takes them (parallelism_config_*_size;
# accelerate/parallelism_config.py: total_size is their product; sp is DeepSpeed's Ulysses
# sequence parallelism, ALST).
_PARALLELISM_SIZES = ("dp_replicate", "dp_shard", "tp", "cp", "sp")


def _processes(top: Reader, out: Imported, kind: str | None, world: int | None, dp: int | None,
               model_parallel: int, machines: int) -> int | None:
    """The number of processes, and the cluster it fills. `num_processes` of the config, else
    what the command line gives (--world, or --dp times tp x cp), as `accelerate launch
    --num_processes` does: a config file without it (`ClusterConfig.num_processes` -1) needs that
    flag (commands/launch.py, `_validate_launch_command`), except with distributed_type NO, one
    process (config_args.py, `BaseConfig.process_config`). Neither: planned as 1 process, with a
    note. No cluster is written where the config names neither the processes nor the machines
    (`--num_machines` of the launch), so that --dp still applies and nodes of 8 GPUs are planned."""
    if top.has("num_processes"):
        processes = top.int("num_processes", minimum=1) or 1
        where = "num_processes"
        if world is not None and world != processes:
            out.problem(where, f"{processes} processes, but --world {world}")
            return None
    elif world is not None or dp is not None:
        processes, where = (world if world is not None else dp * model_parallel), ""
    elif kind == "NO":
        processes, where = 1, "distributed_type"
    else:
        out.note("num_processes", "not given: `accelerate launch` needs --num_processes with this config; planned "
                                  "as 1 process: give --world N (or --dp N)")
        return 1
    if processes % machines:
        out.problem(where or "num_machines", f"{processes} processes do not fill {machines} machines evenly")
        return None
    if not where and not top.has("num_machines"):
        return processes  # the launch names the machines too: the cluster stays the job's default
    out.set("cluster.nodes", machines, "num_machines")
    out.set("cluster.gpus_per_node", processes // machines, where)
    return processes


# ClusterConfig's keys about the machines and the launch (accelerate/commands/config/config_args.py),
# not the plan: what export leaves out of every target for the same reason ([cluster], common.py).
_LAUNCHER_KEYS = ("compute_environment", "machine_rank", "main_training_function", "rdzv_backend", "same_network",
                  "use_cpu", "debug", "gpu_ids", "main_process_ip", "main_process_port", "mpirun_config",
                  "downcast_bf16", "enable_cpu_affinity", "tpu_name", "tpu_zone", "tpu_env", "tpu_use_cluster",
                  "tpu_use_sudo", "tpu_vm", "command_file", "commands")
_LAUNCHER = "not read: a launcher setting (the machines, not the plan)"
# shardplan has no device setting: `shardplan run` uses CUDA with NCCL where a GPU exists, else
# the CPU with gloo (runtime/dist.py, pick_device).
_CPU = "not read: shardplan has no CPU setting (`shardplan run` uses the CPU with gloo where no GPU exists)"


def _fsdp(fsdp: Reader, out: Imported, replicate: int | None, dp: int) -> None:
    version = fsdp.int("fsdp_version", minimum=1) if fsdp.has("fsdp_version") else 1
    reshard = fsdp.raw("fsdp_reshard_after_forward")
    strategy = fsdp.raw("fsdp_sharding_strategy")
    where = fsdp.key("fsdp_reshard_after_forward")
    if isinstance(reshard, bool):
        stage, hybrid = (3 if reshard else 2), False
    else:
        name = reshard if reshard is not None else strategy if strategy is not None else "FULL_SHARD"
        where = fsdp.key("fsdp_reshard_after_forward" if reshard is not None else "fsdp_sharding_strategy")
        if isinstance(name, int) and 1 <= name <= len(FSDP1_STRATEGIES):
            name = FSDP1_STRATEGIES[name - 1]
        if not isinstance(name, str) or name.upper() not in FSDP1_STRATEGIES:
            out.problem(where, f"must be true/false (FSDP2) or one of {', '.join(FSDP1_STRATEGIES)} (got {name!r})")
            return
        key = name.lower() if name.upper() != "HYBRID_SHARD_ZERO2" else "_hybrid_shard_zero2"
        stage, hybrid = FSDP_STAGE_NAMES[key]
    if version not in (1, 2):
        out.problem(fsdp.key("fsdp_version"), f"must be 1 or 2 (got {version})")
    out.set("zero.stage", stage, where)
    if replicate and replicate > 1:
        hybrid = True
        where = "parallelism_config.parallelism_config_dp_replicate_size"
    if hybrid:
        out.set("zero.hybrid", True, where)
        out.note(where, "read as hybrid sharding: shard inside a node, replicate across nodes")
    if fsdp.bool("fsdp_offload_params"):
        for key in ("params", "grads", "optimizer"):
            out.set(f"offload.{key}", True, fsdp.key("fsdp_offload_params"))
        out.set("offload.gpu_param_budget", 0, fsdp.key("fsdp_offload_params"))
    if fsdp.bool("fsdp_activation_checkpointing"):
        out.set("train.activation_checkpointing", "full", fsdp.key("fsdp_activation_checkpointing"))
    # accelerate's policies (accelerate/utils/constants.py, FSDP_AUTO_WRAP_POLICY, read upper-cased);
    # none given is NO_WRAP (FullyShardedDataParallelPlugin: FSDP_AUTO_WRAP_POLICY's default).
    policy = fsdp.choice("fsdp_auto_wrap_policy", ("TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP")) \
        if fsdp.has("fsdp_auto_wrap_policy") else "NO_WRAP"
    if policy == "SIZE_BASED_WRAP":
        size = fsdp.int("fsdp_min_num_params") if fsdp.has("fsdp_min_num_params") else None
        if size:
            out.set("zero.min_num_params", size, fsdp.key("fsdp_min_num_params"))
    elif fsdp.has("fsdp_min_num_params"):
        fsdp.raw("fsdp_min_num_params")
        out.note(fsdp.key("fsdp_min_num_params"), "not read: accelerate uses it only with fsdp_auto_wrap_policy "
                                                  "SIZE_BASED_WRAP")
    if policy == "NO_WRAP":
        given = "" if fsdp.has("fsdp_auto_wrap_policy") else "not given, accelerate's default NO_WRAP: "
        out.note(fsdp.key("fsdp_auto_wrap_policy"), f"{given}the whole model is one FSDP unit, all its parameters "
                                                    "gathered at once; shardplan plans one unit per transformer block")
    if strategy is not None and reshard is not None:
        out.note(fsdp.key("fsdp_sharding_strategy"), "not read: fsdp_reshard_after_forward is given and is read "
                                                     "instead (accelerate deprecates fsdp_sharding_strategy for it)")
    for key, why in _FSDP_NOT_CARRIED.items():
        if fsdp.has(key):
            fsdp.raw(key)
            out.note(fsdp.key(key), f"not read: {why}")
    fsdp.unread()


# fsdp_config keys that shardplan reads but does not carry over, and why: what each does is
# accelerate's (accelerate/utils/dataclasses.py, FullyShardedDataParallelPlugin: the fields'
# help and, in __post_init__, what FSDP2 drops); what shardplan plans instead is FSDP2 as
# `shardplan run` executes it (core/buffers.py: offload.prefetch_layers blocks gathered ahead;
# core/host.py: the model built on the meta device, one block materialized at a time).
_PLANS_FSDP2_PREFETCH = ("shardplan plans FSDP2, which gathers offload.prefetch_layers blocks (1 unless set) "
                         "ahead in forward and backward")
_FSDP_NOT_CARRIED = {
    "fsdp_backward_prefetch": f"FSDP1's backward prefetch policy (accelerate drops it under FSDP2); "
                              f"{_PLANS_FSDP2_PREFETCH}",
    "fsdp_forward_prefetch": f"FSDP1's explicit forward prefetch (not implemented in FSDP2); {_PLANS_FSDP2_PREFETCH}",
    "fsdp_use_orig_params": "FSDP1's flat parameters (unless true); shardplan plans FSDP2, which always keeps the "
                            "original parameters (accelerate drops the key under FSDP2)",
    "fsdp_sync_module_states": "broadcasts rank 0's weights once at start-up (FSDP1; accelerate drops it under "
                               "FSDP2); no effect on the training step shardplan plans",
    "fsdp_cpu_ram_efficient_loading": "how pretrained weights are loaded at start-up (only the first process reads "
                                      "them); shardplan's start-up host memory is that of `shardplan run`, which "
                                      "builds the model on the meta device and materializes one block at a time",
    "fsdp_state_dict_type": "how checkpoints are gathered and saved; no effect on the training step shardplan plans",
    "fsdp_transformer_layer_cls_to_wrap": "shardplan shards every transformer block as one unit (what "
                                          "TRANSFORMER_BASED_WRAP does with the model's block class)",
    "fsdp_activation_checkpointing_offload": "moves each recomputed block's input to pinned CPU memory; shardplan "
                                             "keeps the inputs of recomputed blocks on the GPU",
}

# accelerate config keys that accelerate refuses beside deepspeed_config_file, which decides
# them (accelerate/utils/dataclasses.py, DeepSpeedPlugin._deepspeed_config_checks; the
# top-level mixed_precision counts when the YAML gives one, accelerate/commands/launch.py
# `launch_command`, and `accelerate config` writes null there with a file).
_DECIDED_BY_FILE = ("gradient_accumulation_steps", "gradient_clipping", "zero_stage", "offload_optimizer_device",
                    "offload_param_device", "offload_param_nvme_path", "offload_optimizer_nvme_path",
                    "zero3_save_16bit_model")
_REFUSED_BESIDE_FILE = ("accelerate refuses it beside deepspeed_config_file, whose DeepSpeed config decides it "
                        "(DeepSpeedPlugin._deepspeed_config_checks)")
# accelerate's ZeRO stage when the config gives none (DeepSpeedPlugin.__post_init__:
# ACCELERATE_DEEPSPEED_ZERO_STAGE, default 2).
_ZERO_STAGE_DEFAULT = 2


def _deepspeed(ds: Reader, out: Imported, top: Reader, processes: int, referenced: dict[str, Referenced],
               sequence: int = 1, hidden_size: int | None = None, given: Collection[str] = ()) -> None:
    from .deepspeed import PARAM_OFFLOAD_IGNORED

    out.set("zero.framework", "deepspeed", "distributed_type")
    if ds.has("deepspeed_config_file"):
        name = ds.str("deepspeed_config_file")
        file = referenced.get(ds.key("deepspeed_config_file"))
        if name is not None and file is None:
            out.problem(ds.key("deepspeed_config_file"), f"{name}: the DeepSpeed config was not read")
        elif file is not None:
            _deepspeed_file(ds, out, top, processes, file, sequence, hidden_size, given)
        return
    stage = ds.int("zero_stage") if ds.has("zero_stage") else _ZERO_STAGE_DEFAULT
    if stage is not None:
        if stage > 3:
            out.problem(ds.key("zero_stage"), f"must be 0, 1, 2 or 3 (got {stage})")
        else:
            out.set("zero.stage", stage, ds.key("zero_stage") if ds.has("zero_stage") else "distributed_type")
    for key, job_keys in (("offload_optimizer_device", ("offload.optimizer", "offload.grads")),
                          ("offload_param_device", ("offload.params",))):
        device = ds.choice(key, ("none", "cpu", "nvme")) if ds.has(key) else None
        if device in ("cpu", "nvme") and key == "offload_param_device" and (stage or 0) < 3:
            # DeepSpeedPlugin writes zero_optimization.offload_param at any stage; DeepSpeed reads it at 3 only.
            out.note(ds.key(key), PARAM_OFFLOAD_IGNORED.format(stage=stage))
        elif device in ("cpu", "nvme"):
            for job_key in job_keys:
                out.set(job_key, True, ds.key(key))
            if key == "offload_param_device":
                out.set("offload.gpu_param_budget", 0, ds.key(key))
    steps = ds.int("gradient_accumulation_steps", minimum=1) if ds.has("gradient_accumulation_steps") else None
    if steps:
        out.set("parallel.num_microbatches", steps, ds.key("gradient_accumulation_steps"))
    _deepspeed_extras(ds, out)


def _deepspeed_file(ds: Reader, out: Imported, top: Reader, processes: int, file: Referenced,
                    sequence: int = 1, hidden_size: int | None = None, given: Collection[str] = ()) -> None:
    """The DeepSpeed config JSON that deepspeed_config_file names, read by the DeepSpeed
    importer with the data-parallel size accelerate launches (num_processes over its
    tensor_parallel.autotp_size and over `sequence`, the sequence-parallel ranks of
    parallelism_config, which DeepSpeed's batch arithmetic leaves out of its data-parallel
    world as the mpu accelerate hands it says); its notes and problems point into that file."""
    from .deepspeed import from_deepspeed, model_parallel_degrees

    where, doc = ds.key("deepspeed_config_file"), file.doc
    if file.resolved:
        out.note(where, file.resolved)
    for key in _DECIDED_BY_FILE:
        if ds.has(key):
            ds.raw(key)
            out.problem(ds.key(key), f"{_REFUSED_BESIDE_FILE}: remove it here and set it in {doc.path}")
    if top.has("mixed_precision") and top.raw("mixed_precision") is not None:
        out.problem("mixed_precision", f"{_REFUSED_BESIDE_FILE}: remove it (`accelerate config` writes null) and "
                                       f"set bf16 / fp16 in {doc.path}")
    if "zero_optimization" not in doc.data:
        out.problem(where, f"{doc.path} has no zero_optimization, which accelerate requires of a DeepSpeed config "
                           "file (DeepSpeedPlugin: 'Please specify the ZeRO optimization config')")
        return
    tp = integral(model_parallel_degrees(doc.data).get("parallel.tp", 1))
    tp = tp if tp is not None and tp >= 1 else 1  # the DeepSpeed importer names a bad autotp_size
    if processes % (tp * sequence):
        out.problem(where, f"num_processes ({processes}) is not a multiple of {doc.path}'s "
                           f"tensor_parallel.autotp_size ({tp})" + (f" x sequence parallel ({sequence})"
                                                                    if sequence > 1 else ""))
        return
    dp = processes // (tp * sequence)
    split = (f" / autotp_size {tp}" if tp > 1 else "") + (f" / sequence parallel {sequence}" if sequence > 1 else "")
    said = f"num_processes {processes}" + (f"{split} makes dp {dp}" if split else "")
    out.merge(from_deepspeed(doc.data, dp, said, hidden_size, given), doc.path, doc.line_of)
    _deepspeed_extras(ds, out)


def _deepspeed_extras(ds: Reader, out: Imported) -> None:
    """deepspeed_config's keys beside the plan's, each with why it is not carried over."""
    stage = out.tables.get("zero", {}).get("stage")
    if ds.has("zero3_init_flag"):
        init = ds.bool("zero3_init_flag")
        if init is False and stage == 3:
            out.note(ds.key("zero3_init_flag"), "not read: shardplan's ZeRO-3 start-up assumes deepspeed.zero.Init "
                                                "(true), which partitions the model while it is built; false "
                                                "builds each rank's whole model on the CPU first")
        elif stage != 3:
            # accelerate sets it false below stage 3 (utils/dataclasses.py, DeepSpeedPlugin
            # __post_init__: "DeepSpeed Zero3 Init flag is only applicable for ZeRO Stage 3").
            out.note(ds.key("zero3_init_flag"), f"not read: it acts at ZeRO stage 3 only (the config's stage is "
                                                f"{stage or 0})")
    if ds.has("zero3_save_16bit_model"):
        ds.raw("zero3_save_16bit_model")
        out.note(ds.key("zero3_save_16bit_model"), "not read: how the model is saved at the end; no effect on the "
                                                   "training step shardplan plans")
    if ds.has("deepspeed_multinode_launcher"):  # the launcher (pdsh, standard, ...), as the other launch keys
        ds.raw("deepspeed_multinode_launcher")
        out.note(ds.key("deepspeed_multinode_launcher"), _LAUNCHER)
    ds.unread()
