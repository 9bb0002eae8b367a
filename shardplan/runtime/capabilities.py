"""What `shardplan run` can execute: a job asking for more is refused before any process
starts, with the key and the reason, never silently run differently. Torch-free."""

from __future__ import annotations

from ..io.job import ResolvedJob
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
    job, shape = resolved.job, resolved.shape
    par, zero, off = job.parallel, job.zero, job.offload
    found: list[tuple[str, str]] = []
    if shape is None:
        what = "not a bare parameter count" if job.model.params is not None else "and the job names no model"
        found.append(("model", f"`run` needs an architecture (a preset, hf_config or inline shape), {what}"))
    elif unbuildable(shape):
        found.append(("model", f"`run` builds GPT-2 and Llama-style models, not {unbuildable(shape)} "
                               f"(model {shape.name or shape.family})"))
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
    missing = require_library(off.cpu_compression) if (off.optimizer or off.params) else None
    if missing:
        found.append(("offload.cpu_compression", missing))
    if job.train.optimizer not in ("adamw", "sgd") and (off.optimizer or off.params):
        found.append(("offload.optimizer", f"the offload engine steps adamw and sgd on the CPU, not "
                                           f"{job.train.optimizer}"))
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
    return [Problem(path, message) for path, message in found]


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
    if job.lora.base_dtype == "nf4" and job.offload.params:
        found.append(("offload.params", "`run` does not offload NF4 weights to the CPU"))
    if job.lora.base_dtype == "nf4" and shape is not None and par.tp == 1:
        from ..core.lora import nf4_problems

        shards = par.dp * par.cp if job.zero.stage >= 2 else 1
        for name, rows, numel in nf4_problems(shape, par.tp, shards):
            found.append(("lora.base_dtype", f"torchao's NF4 needs every layer linear's {numel:,} elements to split "
                                             f"into {shards} whole multiples of 64 * 256 and its {rows} rows "
                                             f"evenly: {name} does not"))
    return found


def require_supported(resolved: ResolvedJob) -> None:
    problems = unsupported(resolved)
    if problems:
        raise InputError([p.at(resolved.file or None) for p in problems])
