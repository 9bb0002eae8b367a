"""What `shardplan run` can execute: a job asking for more is refused before any process
starts, with the key and the reason, never silently run differently. Torch-free."""

from __future__ import annotations

from ..core.offload import ENGINE_OPTIMIZERS
from ..io.job import ResolvedJob
from ..spec.job import JobSpec
from ..spec.errors import InputError, Problem
from ..spec.model import ModelShape


def unbuildable(shape: ModelShape) -> str | None:
    """What of this architecture runtime/model.py does not build (None: it builds it all)."""
    missing = []
    if shape.moe:
        missing.append("mixture-of-experts layers")
    if shape.shared_layer_norm or shape.family == "falcon":
        missing.append("Falcon's parallel attention/MLP block")
    if shape.position_embedding == "alibi":
        missing.append("ALiBi positions")
    if shape.family == "gemma2":
        missing.append("Gemma-2's post-norms and soft-capping")
    return ", ".join(missing) or None


def require_library(compression: str) -> str | None:
    """The install hint when the library a compression needs (torchao: int8 quantisation,
    runtime/offload_codec.py) is missing, else None."""
    if compression != "int8":
        return None
    import importlib.util

    if importlib.util.find_spec("torchao") is None:
        return f"{compression} compression needs torchao: pip install 'shardplan[offload]'"
    return None


def unsupported(resolved: ResolvedJob) -> list[Problem]:
    """Everything of the job `run` cannot execute: the model, then the plan's keys."""
    job, shape = resolved.job, resolved.shape
    found: list[tuple[str, str]] = []
    if shape is None:
        what = "not a bare parameter count" if job.model.params is not None else "and the job names no model"
        found.append(("model", f"`run` needs an architecture (a preset, hf_config or inline shape), {what}"))
    elif unbuildable(shape):
        found.append(("model", f"`run` builds GPT-2 and Llama-style models, not {unbuildable(shape)} "
                               f"(model {shape.name or shape.family})"))
    return [Problem(path, message) for path, message in found + _plan_refusals(resolved, libraries=True)]


def refusal_warnings(resolved: ResolvedJob) -> list[Problem]:
    """`validate`'s warnings for an fsdp2 job whose plan `run` would refuse (the shipped
    llama-2-70b-3d: ZeRO-1 under tensor parallel), at the key's file line. Only the plan's
    keys: a model `run` does not build is no plan to change (docs/run.md lists what it
    builds), a library this machine lacks is not the job's business, and a job for another
    framework is not meant for `run` at all."""
    if resolved.job.zero.framework != "fsdp2":
        return []
    found = [Problem(path, f"`shardplan run` would refuse it: {message}", severity="warning")
             for path, message in _plan_refusals(resolved, libraries=False)]
    return resolved.locate(found)


def _plan_refusals(resolved: ResolvedJob, libraries: bool) -> list[tuple[str, str]]:
    """What `run` cannot execute of the job's plan keys (parallelism, sharding, offload,
    recomputation, precision, LoRA); with `libraries`, also an offload library this machine
    lacks."""
    job, shape = resolved.job, resolved.shape
    par, zero, off = job.parallel, job.zero, job.offload
    found: list[tuple[str, str]] = []
    if job.train.activation_checkpointing == "op":
        found.append(("train.activation_checkpointing", "torchtitan's operator policy (op) is estimated, not executed "
                                                        "by `run`: use none, selective or full"))
    if par.cp > 1:
        found.append(("parallel.cp", "context parallelism is not executed by `run`"))
    if par.sequence_parallel and par.tp > 1 and shape is not None and shape.position_embedding == "learned":
        found.append(("parallel.sequence_parallel", "sequence parallel with learned position embeddings "
                                                    "(GPT-2) is not executed by `run`"))
    if zero.min_num_params:
        found.append(("zero.min_num_params", "FSDP2 shards every parameter; `run` cannot keep small ones whole"))
    if zero.framework != "fsdp2":
        found.append(("zero.framework", "`run` executes the fsdp2 accounting; set zero.framework = \"fsdp2\""))
    found += _offload_unsupported(job, off.optimizer, off.params, None, libraries)
    if not (off.optimizer or off.params):  # what the job leaves to the offload strategy
        found += _decided_unsupported(resolved, libraries)
    for key in ("async_prefetch", "overlap"):
        if not getattr(off, key):
            found.append((f"offload.{key}", "FSDP2 always prefetches on its own stream, overlapped with compute; "
                                            f"`run` cannot turn that off (remove offload.{key} = false)"))
    if par.tp > 1 and zero.stage == 1:
        found.append(("zero.stage", "stage 1 runs under DDP, which cannot wrap tensor-parallel (DTensor) "
                                    "parameters: use stage 0, 2 or 3 with tp > 1"))
    if shape is not None and par.tp > 1 and shape.tie_embeddings:
        found.append(("model.tie_embeddings", "tied embeddings with tensor parallel are not executed by `run`"))
    if shape is not None and par.tp > shape.num_kv_heads:
        found.append(("parallel.tp", "replicated key/value heads (tp > num_kv_heads) are not executed by `run`"))
    if par.pp > 1 and par.pipeline_schedule == "zero-bubble":
        found.append(("parallel.pipeline_schedule",
                      "torch 2.13's zero-bubble schedule (ScheduleInterleavedZeroBubble) diverges under FSDP2 and "
                      "keeps every microbatch's activations until the step ends on the last stage; `run` refuses it: "
                      "use 1f1b (the estimate still models ZB-H1)"))
    if job.checkpoint.dir and zero.stage == 1 and par.dp > 1:
        found.append(("checkpoint.dir", "checkpoints of ZeroRedundancyOptimizer (zero.stage 1) states are not "
                                        "written by `run`: use zero.stage 0, 2 or 3"))
    found += _lora_unsupported(resolved)
    if job.train.precision == "fp16-mixed":
        found.append(("train.precision", "fp16-mixed needs loss scaling, which `run` does not implement: use bf16-mixed"))
    return found


def _lora_unsupported(resolved: ResolvedJob) -> list[tuple[str, str]]:
    """LoRA / QLoRA plans `run` executes: FSDP2 (zero.stage 0, 2, 3) over data parallelism;
    NF4 weights that torchao can split evenly over the shard group."""
    job, shape = resolved.job, resolved.shape
    if job.lora is None:
        return []
    par = job.parallel
    found = []
    if par.tp > 1 and job.lora.base_dtype == "nf4":
        found.append(("parallel.tp", "torchao's NF4 weights are not split by tensor parallel: QLoRA with tp > 1 is "
                                     "estimated, not executed by `run`"))
    if par.tp > 1 and par.sequence_parallel:
        found.append(("parallel.sequence_parallel", "LoRA with sequence parallel is estimated, not executed by `run`"))
    if job.zero.stage == 1:
        found.append(("zero.stage", "LoRA runs under FSDP2: use zero.stage 0, 2 or 3"))
    if job.lora.base_dtype == "nf4" and shape is not None and par.tp == 1:
        from ..core.lora import nf4_problems

        shards = par.dp * par.cp if job.zero.stage >= 2 else 1
        for name, rows, numel in nf4_problems(shape, par.tp, shards):
            if shards == 1:
                need = f"whole blocks of 64 * 256 = 16,384 elements: {name} has {numel:,}"
            else:
                need = (f"whole blocks of 64 * 256 elements in each of its {shards} FSDP shards, and rows that split "
                        f"evenly over them: {name} has {numel:,} elements in {rows:,} rows")
            found.append(("lora.base_dtype", f"torchao stores a layer linear as NF4 only in {need}"))
    return found


def _offload_unsupported(job: JobSpec, optimizer: bool, params: bool, strategy: str | None,
                         libraries: bool = True) -> list[tuple[str, str]]:
    """What `run` cannot execute of an offload of the optimizer states and/or the parameters:
    as the job writes it (`strategy` None), or as the offload strategy decides it to fit;
    with `libraries`, also a library this machine lacks."""
    if not (optimizer or params):
        return []
    what = " and ".join(name for name, moved in (("parameters", params), ("optimizer states", optimizer)) if moved)
    by = f"the {strategy} offload strategy offloads the {what} to fit, but " if strategy else ""
    after = (": use a plan that fits without offload (`shardplan plan` finds them) or set "
             "offload.strategy = \"conservative\"" if strategy else "")
    found = []
    missing = require_library(job.offload.cpu_compression) if libraries else None
    if missing:
        found.append(("offload.cpu_compression", f"{by}{missing}"))
    if job.train.optimizer not in ENGINE_OPTIMIZERS:
        found.append(("offload.strategy" if strategy else "offload.optimizer",
                      f"{by}the offload engine steps {' and '.join(ENGINE_OPTIMIZERS)} on the CPU, not "
                      f"{job.train.optimizer}{after}"))
    if params and job.lora is not None and job.lora.base_dtype == "nf4":
        found.append(("offload.strategy" if strategy else "offload.params",
                      f"{by}`run` does not offload NF4 weights to the CPU{after}"))
    return found


def _decided_unsupported(resolved: ResolvedJob, libraries: bool = True) -> list[tuple[str, str]]:
    """`_offload_unsupported` of the offload the job's strategy decides, computed only where
    such an offload could be refused (the estimate it takes is the one `run`'s workers take,
    runtime/worker.py)."""
    job = resolved.job
    risky = (job.train.optimizer not in ENGINE_OPTIMIZERS or (libraries and require_library(job.offload.cpu_compression))
             or (job.lora is not None and job.lora.base_dtype == "nf4"))
    if not risky or resolved.shape is None or "gpu_memory" not in job.cluster.model_fields_set:
        return []
    from ..core.estimate_inputs import inputs_from_job
    from ..core.memory import estimate_memory

    decided = estimate_memory(inputs_from_job(job, resolved.shape, True)).inputs
    return decided_offload_unsupported(job, decided.offload_optimizer, decided.offload_params, libraries)


def decided_offload_unsupported(job: JobSpec, optimizer: bool, params: bool,
                                libraries: bool = True) -> list[tuple[str, str]]:
    """What `run` cannot execute of the offload the job's strategy decided (the worker asks
    again with its own decision: runtime/worker.py)."""
    if job.offload.optimizer or job.offload.params:
        return []
    return _offload_unsupported(job, optimizer, params, job.offload.strategy, libraries)


def offload_refusals(job: JobSpec, decided_optimizer: bool, decided_params: bool) -> list[tuple[str, str]]:
    """The offload of an fsdp2 estimate that `run` would refuse, as written or as the strategy
    decided it (`estimate` warns: the figures are the offload engine's, which does not run
    it). What this machine has installed is not the plan's business."""
    if job.zero.framework != "fsdp2":
        return []
    off = job.offload
    return (_offload_unsupported(job, off.optimizer, off.params, None, libraries=False)
            + decided_offload_unsupported(job, decided_optimizer, decided_params, libraries=False))


def require_supported(resolved: ResolvedJob) -> None:
    problems = unsupported(resolved)
    if problems:
        raise InputError([p.at(resolved.file or None) for p in problems])
