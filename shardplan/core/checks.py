"""Cross-field rules of a job: every problem at once, each at the dotted path to change.

Field-level rules (types, ranges) are pydantic's, in `shardplan.spec`; these relate fields
to each other and to the model's shape. Sources of the rules are named where they come from
a framework's own constraint.
"""

from __future__ import annotations

from dataclasses import replace

from ..spec.common import MAX_DIM, MAX_WORLD_SIZE
from ..spec.errors import PlanError, Problem
from ..spec.job import JobSpec
from ..spec.model import ModelShape
from ..spec.units import format_bytes
from .deepspeed import grad_accum_refused, model_dtype, uses_bf16_optimizer
from .degrees import Degrees, missing_axes
from .layout import layout_problems
from .pipeline import describe_split, split_problem
from .schedule import CHUNKED_SCHEDULES, NEEDS_FULL_PIPELINE, chunks_per_rank, interleaved_problem, one_chunk_interleaved


def error(path: str, message: str, keys: tuple[str, ...] = ()) -> Problem:
    return Problem(path, message, keys=keys)


def warning(path: str, message: str) -> Problem:
    return Problem(path, message, severity="warning")


DEGREE_KEYS = ("parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp")
CLUSTER_WORLD_KEYS = ("cluster.nodes", "cluster.gpus_per_node")


def world_keys(source: str) -> tuple[str, ...]:
    """The keys that gave a world size, by its source as io/job.py `external_worlds` names it.
    `--world` and WORLD_SIZE set no key: they state the machine the plan must fill, so a
    mismatch with degrees the file writes stays at the file's line (the message names them)."""
    return CLUSTER_WORLD_KEYS if source.startswith("from cluster") else ()


def world_problems(degrees: Degrees, worlds: list[tuple[int, str]]) -> list[Problem]:
    """dp*tp*pp*cp must equal every world size that was given, with the arithmetic shown.
    The degrees come first among the keys: the hint (`dp = 8 would fit`) is about them."""
    problems = []
    for world, source in worlds:
        if world > MAX_WORLD_SIZE:  # a cluster of more nodes than any world (--world is bounded)
            where = "cluster.nodes" if source.startswith("from cluster") else "parallel"
            problems.append(error(where, f"world size {world:,} ({source}) exceeds the largest supported world "
                                         f"({MAX_WORLD_SIZE:,})", world_keys(source)))
            continue
        message = degrees.world_mismatch(world, source)
        if message:
            problems.append(error("parallel", message, DEGREE_KEYS + world_keys(source)))
    return problems


def heads_problems(tp: int, shape: ModelShape) -> list[Problem]:
    """Tensor parallel splits attention by heads (Megatron-LM: heads divisible by tp)."""
    problems = []
    heads, kv_heads = shape.num_heads, shape.num_kv_heads
    if heads % tp:
        problems.append(error("parallel.tp", f"{tp} does not divide model.num_heads ({heads})"))
        return problems
    if tp > kv_heads:
        if tp % kv_heads:
            problems.append(error(
                "parallel.tp",
                f"{tp} exceeds model.num_kv_heads ({kv_heads}) and is not a multiple of it: "
                "key/value heads cannot be replicated evenly",
            ))
        else:
            problems.append(warning(
                "parallel.tp",
                f"{tp} exceeds model.num_kv_heads ({kv_heads}): each key/value head must be "
                f"replicated on {tp // kv_heads} tp ranks (the estimate counts the copies); "
                "Megatron-LM and `shardplan run` need num_kv_heads divisible by tp",
            ))
    elif kv_heads % tp:
        problems.append(error(
            "parallel.tp", f"{tp} does not divide model.num_kv_heads ({kv_heads})"
        ))
    return problems


def pipeline_problems(job: JobSpec, num_layers: int | None) -> list[Problem]:
    """Stage count against layers, and each schedule's own requirements."""
    par = job.parallel
    pp, virtual, m, schedule = par.pp, par.virtual_stages, par.num_microbatches, par.pipeline_schedule
    problems = []
    if virtual > 1 and schedule not in CHUNKED_SCHEDULES:
        problems.append(error(
            "parallel.virtual_stages",
            f"{virtual} chunks per rank need pipeline_schedule interleaved-1f1b or round-robin "
            f"(got {schedule})",
        ))
    if pp > 1 and schedule in NEEDS_FULL_PIPELINE and m < pp:
        problems.append(error(
            "parallel.num_microbatches",
            f"{schedule} needs at least pp ({pp}) microbatches to fill the pipeline (got {m})",
        ))
    if pp > 1 and schedule == "interleaved-1f1b" and (problem := interleaved_problem(pp, m)):
        problems.append(error("parallel.num_microbatches", problem))
    if message := one_chunk_interleaved(schedule, pp, virtual, m):
        problems.append(warning("parallel.virtual_stages", message))
    if pp > 1 and schedule == "gpipe" and m < pp:
        problems.append(warning(
            "parallel.num_microbatches",
            f"{m} microbatches on {pp} stages leave most of the pipeline idle",
        ))
    if num_layers is None:
        return problems
    stages = pp * chunks_per_rank(schedule, virtual)
    if stages > num_layers:
        what = f"pp ({pp})" if stages == pp else f"pp * virtual_stages ({pp} * {virtual} = {stages})"
        problems.append(error(
            "parallel.pp", f"{what} exceeds model.num_layers ({num_layers}): a stage needs a layer"
        ))
        return problems
    first, last = par.first_stage_layers, par.last_stage_layers
    if first or last:
        problem = split_problem(num_layers, stages, first, last)
        if problem:
            problems.append(error("parallel.first_stage_layers" if first else "parallel.last_stage_layers", problem))
        return problems
    if schedule in CHUNKED_SCHEDULES and pp > 1 and num_layers % stages:
        problems.append(error(
            "parallel.virtual_stages",
            f"{schedule} needs model.num_layers ({num_layers}) divisible by pp * virtual_stages "
            f"({pp} * {virtual} = {stages})",
        ))
    elif stages > 1 and num_layers % stages:
        problems.append(warning(
            "parallel.pp",
            f"{num_layers} layers split unevenly over {stages} stages: {describe_split(num_layers, stages)}",
        ))
    return problems


def sequence_problems(job: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """Sequence and context parallel split the sequence; it must divide."""
    par, seq = job.parallel, job.train.seq_len
    problems = []
    if par.cp > 1 and seq % (2 * par.cp):
        # Load-balanced causal context parallelism cuts the sequence into 2*cp chunks and
        # gives rank i chunks i and 2cp-1-i (Megatron-LM / torch context_parallel).
        problems.append(error(
            "train.seq_len", f"{seq} is not divisible by 2 * cp ({2 * par.cp}): context parallel "
            "splits the sequence into 2*cp chunks", ("train.seq_len", "parallel.cp"),
        ))
    if par.sequence_parallel:
        if par.tp == 1:
            problems.append(warning("parallel.sequence_parallel", "has no effect with tp = 1"))
        elif (seq // par.cp) % par.tp:
            local = f"seq_len / cp ({seq // par.cp})" if par.cp > 1 else f"train.seq_len ({seq})"
            problems.append(error(
                "parallel.sequence_parallel", f"{local} is not divisible by tp ({par.tp})",
                ("parallel.sequence_parallel", "train.seq_len", "parallel.cp", "parallel.tp"),
            ))
    if shape is not None and shape.max_seq_len is not None and seq > shape.max_seq_len:
        if shape.position_embedding == "learned":
            problems.append(error(
                "train.seq_len",
                f"{seq} exceeds the model's {shape.max_seq_len} learned positions",
            ))
        else:
            problems.append(warning(
                "train.seq_len", f"{seq} exceeds model.max_seq_len ({shape.max_seq_len})"
            ))
    return problems


def batch_problems(job: JobSpec, fitting_dp: int | None = None) -> list[Problem]:
    """A global batch that is given must be what the data-parallel ranks and accumulation make.
    `fitting_dp`: the data-parallel degree the world's message suggests instead of the job's,
    with which the accumulation hint is computed, so that the two hints agree."""
    par, wanted = job.parallel, job.train.global_batch_size
    made = par.dp * par.micro_batch_size * par.num_microbatches
    dp = fitting_dp or par.dp
    if not wanted or wanted == made:
        return []
    message = (f"{wanted} != dp ({par.dp}) * micro_batch_size ({par.micro_batch_size}) * "
               f"num_microbatches ({par.num_microbatches}) = {made}")
    per_step = dp * par.micro_batch_size
    if wanted % per_step == 0 and wanted // per_step <= MAX_DIM:  # a value num_microbatches takes
        message += f"; num_microbatches = {wanted // per_step} would make it" + (f" with dp = {dp}" if dp != par.dp else "")
    elif dp != par.dp:
        message += f"; no num_microbatches makes it with dp = {dp} and micro_batch_size = {par.micro_batch_size}"
    return [error("train.global_batch_size", message, ("train.global_batch_size", "parallel.dp",
                                                         "parallel.micro_batch_size", "parallel.num_microbatches"))]


def lora_problems(job: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """LoRA adapts linear layers the model has, and needs an architecture to find them."""
    lora = job.lora
    if lora is None:
        return []
    if shape is None:
        if job.model.params is not None:
            return [error("lora", "LoRA needs the model's architecture (its linear layers), not a bare parameter count")]
        return []
    if not shape.gated and "gate_proj" in lora.targets:
        return [error("lora.targets", f"'gate_proj': the {shape.family} MLP has no gate projection "
                                      "(targets: q_proj k_proj v_proj o_proj up_proj down_proj)")]
    from .lora import rank_warning

    problems = []
    above = rank_warning(shape, lora.rank, tuple(lora.targets))
    if above:
        problems.append(warning("lora.rank", above))
    if lora.base_dtype == "nf4":
        from .lora import nf4_problems

        bad = nf4_problems(shape, job.parallel.tp, 1)
        if bad:
            name, _, numel = bad[0]
            problems.append(warning("lora.base_dtype", f"torchao stores NF4 weights in whole blocks of 64 * 256 "
                                                       f"elements; {name} has {numel:,}: the estimate counts the "
                                                       "formula, `run` refuses the model"))
    return problems


# What a bare parameter count (`--params`, no architecture) leaves to the ZeRO paper's formulas.
BARE_COUNT_HINT = ("give the architecture (model.preset, model.hf_config or an inline shape), or zero.framework = "
                   "\"zero-paper\" for the ZeRO paper's formulas, which need only the count")


def bare_count_problems(job: JobSpec, shape: ModelShape | None) -> list[Problem]:
    """A bare parameter count has no tensors, and two accountings allocate by them: the
    `deepspeed` accounting sizes DeepSpeed's partitions, buckets and gathered modules by the
    model's tensors (core/deepspeed.py), and fsdp2's stage 1 is torch's ZeroRedundancyOptimizer,
    which gives whole tensors to ranks (core/states.py). Counted as one tensor, they gave a
    ZeRO-1 or ZeRO-2 that shards nothing, and a ZeRO-3 that gathers the whole model."""
    if shape is not None or job.model.params is None:
        return []
    zero = job.zero
    if zero.framework == "deepspeed":
        return [error("zero.framework", "the deepspeed accounting sizes DeepSpeed's partitions, buckets and "
                                        "gathered modules by the model's tensors, which a bare parameter count does "
                                        f"not have: {BARE_COUNT_HINT}", ("zero.framework", "model.params"))]
    if zero.framework == "fsdp2" and zero.stage == 1:
        return [error("zero.stage", "stage 1 under fsdp2 is torch's ZeroRedundancyOptimizer, which gives whole "
                                    "tensors to ranks, and a bare parameter count has none: "
                                    f"{BARE_COUNT_HINT}", ("zero.stage", "model.params"))]
    return []


def sharding_problems(job: JobSpec, nodes: int) -> list[Problem]:
    """ZeRO stage, hybrid sharding, offload and budgets."""
    zero, off, cluster = job.zero, job.offload, job.cluster
    problems = []
    if off.params and zero.stage != 3:
        problems.append(error(
            "offload.params", f"offloading parameters requires zero.stage = 3 (got {zero.stage})"
        ))
    if zero.hybrid and zero.stage < 2:
        problems.append(error(
            "zero.hybrid", f"hybrid sharding needs zero.stage 2 or 3 (got {zero.stage})"
        ))
    elif zero.hybrid and nodes == 1:
        problems.append(warning(
            "zero.hybrid", "on a single node hybrid sharding is the same as sharding over dp"
        ))
    problems += framework_key_problems(job)
    offloading = off.params or off.grads or off.optimizer
    # ZeRO shards over the data-parallel and context-parallel ranks together (core/layout.py
    # `shard_group_size`): cp 8 at dp 1 shards over 8.
    if zero.stage > 0 and job.parallel.dp * job.parallel.cp == 1 and not offloading:
        # At stage 3 the offload strategy may keep parameters on the CPU, which needs stage 3
        # (core/memory.py): `plan` writes such jobs with the strategy deciding.
        problems.append(warning("zero.stage", f"stage {zero.stage} with dp = 1 shards nothing" + (
            f"; it lets the {off.strategy} offload strategy keep parameters on the CPU, which needs stage 3"
            if zero.stage == 3 and off.strategy != "conservative" else "")))
    if zero.framework != "fsdp2" and job.parallel.pp > 1 and zero.stage >= 2:
        # DeepSpeed's PipelineEngine supports ZeRO stage 0 and 1 only.
        problems.append(error(
            "zero.stage",
            f"DeepSpeed's pipeline engine supports ZeRO stages 0 and 1 only (pp = "
            f"{job.parallel.pp}, stage = {zero.stage})",
        ))
    # Only budgets the user wrote are checked: a default adapts to the cluster instead; and
    # only against a GPU memory the job states (an unstated one is no claim about the GPU).
    written = off.model_fields_set
    if ("gpu_param_budget" in written and "gpu_memory" in cluster.model_fields_set
            and off.gpu_param_budget > cluster.gpu_memory):
        problems.append(error(
            "offload.gpu_param_budget",
            f"{format_bytes(off.gpu_param_budget)} exceeds cluster.gpu_memory "
            f"({format_bytes(cluster.gpu_memory)})",
        ))
    if "cpu_memory_budget" in written and off.cpu_memory_budget > cluster.cpu_memory_per_node:
        problems.append(error(
            "offload.cpu_memory_budget",
            f"{format_bytes(off.cpu_memory_budget)} exceeds cluster.cpu_memory_per_node "
            f"({format_bytes(cluster.cpu_memory_per_node)})",
        ))
    problems += offload_problems(job)
    return problems


# DeepSpeed's own knobs (spec/job.py ZeroSpec): only the `deepspeed` accounting reads them.
DEEPSPEED_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size", "max_live_parameters",
                  "param_persistence_threshold", "sub_group_size", "overlap_comm", "grad_accum_dtype")


def framework_key_problems(job: JobSpec) -> list[Problem]:
    """Keys the job writes that its framework's accounting does not read: a warning each,
    so a knob set for one framework is not silently taken for a change under another."""
    zero = job.zero
    written = zero.model_fields_set
    if zero.framework == "deepspeed":
        problems = grad_accum_problems(job)
        if "min_num_params" in written and zero.min_num_params:
            problems.append(warning("zero.min_num_params", 'has no effect under zero.framework = "deepspeed", which '
                                    "shards every parameter (its stage 3 keeps small ones whole by "
                                    "zero.param_persistence_threshold)"))
        # What the estimate counts but DeepSpeed's engine does not run (`plan`'s DeepSpeed space
        # leaves both out; `export --to deepspeed` notes them).
        if job.parallel.cp > 1:
            problems.append(warning("parallel.cp", f"DeepSpeed has no ring-attention context parallel (its Ulysses "
                                    f"sequence parallel is another algorithm, not estimated): the estimate counts "
                                    f"cp = {job.parallel.cp} as torch and Megatron-LM run it"))
        if "gpu_param_budget" in job.offload.model_fields_set and job.offload.gpu_param_budget:
            problems.append(warning("offload.gpu_param_budget", 'has no effect under zero.framework = "deepspeed", '
                                    "whose offload_param moves every parameter to the CPU "
                                    "(DeepSpeedZeroOffloadParamConfig has no budget of parameters kept on the GPU)"))
        if zero.hybrid and zero.stage >= 2:
            problems.append(warning("zero.hybrid", "DeepSpeed 0.19 has no hybrid sharding (MiCS was removed): the "
                                    "estimate shards inside each node, DeepSpeed over every data-parallel rank"))
        return problems
    return [warning(f"zero.{key}", f'is read only under zero.framework = "deepspeed" and by `export --to deepspeed`; '
                    f"the {zero.framework} estimate does not use it")
            for key in DEEPSPEED_KEYS if key in written]


def grad_accum_problems(job: JobSpec) -> list[Problem]:
    """zero.grad_accum_dtype as DeepSpeed reads it (`_do_optimizer_sanity_check`, engine.py
    lines 2294-2323; core/deepspeed.py `uses_bf16_optimizer`): refused without ZeRO unless it is
    the model's dtype; read at stage 1 with bf16 and no offload_optimizer (BF16_Optimizer);
    ignored otherwise, by ZeRO's own optimizers."""
    zero, precision = job.zero, job.train.precision
    wanted = zero.grad_accum_dtype
    if wanted is None or wanted == model_dtype(precision):
        return []
    if grad_accum_refused(zero.stage, precision, wanted):
        return [error("zero.grad_accum_dtype", f"DeepSpeed without ZeRO accumulates gradients in the model's dtype "
                                               f"({model_dtype(precision)}) only: it raises NotImplementedError for "
                                               f"{wanted} (engine.py _do_optimizer_sanity_check); set zero.stage = 1 "
                                               "or remove the key")]
    if uses_bf16_optimizer(zero.stage, precision, job.parallel.pp > 1, wanted, job.offload.optimizer):
        return []
    if zero.stage == 1 and model_dtype(precision) == "bf16" and job.offload.optimizer:
        why = "with offload.optimizer its ZeRO-Offload optimizer keeps fp32 gradient partitions anyway"
    else:
        why = (f"at stage {zero.stage} with {precision} it steps with its ZeRO optimizer, which does not read it "
               "(only stage 1 with bf16 does, stepping with BF16_Optimizer)")
    return [warning("zero.grad_accum_dtype", f"DeepSpeed ignores it: {why}")]


def offload_problems(job: JobSpec) -> list[Problem]:
    """What the offload flags mean together (core/offload.py, docs/estimate.md "Offload")."""
    zero, off = job.zero, job.offload
    problems = []
    host_states = off.optimizer or off.params
    if zero.framework == "fsdp2" and off.grads and not off.optimizer:
        # DeepSpeed offers no such mode either: its gradients go to the CPU with offload_optimizer.
        problems.append(error(
            "offload.grads", "gradients on the CPU serve only an optimizer that steps there: set "
            "offload.optimizer = true too (ZeRO-Offload), or remove offload.grads",
        ))
    if zero.framework == "fsdp2" and off.grads and off.optimizer and zero.stage == 1:
        problems.append(warning(
            "offload.grads", "at zero.stage 1 the gradients are views of DDP's buckets, which stay on the GPU: "
            "they are copied to the CPU, but no GPU memory is freed",
        ))
    if off.cpu_compression != "none":
        if zero.framework != "fsdp2":
            problems.append(warning(
                "offload.cpu_compression", f"only the fsdp2 offload engine (`run`) compresses; the {zero.framework} "
                "accounting keeps optimizer states uncompressed",
            ))
        elif not host_states:
            problems.append(warning(
                "offload.cpu_compression", "compresses optimizer states on the CPU: it has no effect unless "
                "offload.optimizer or offload.params is true",
            ))
        elif job.train.optimizer == "sgd":
            problems.append(warning("offload.cpu_compression", "SGD keeps no optimizer state to compress"))
    return problems


# GPU presets without bf16 arithmetic: Volta's tensor cores take fp16 only (NVIDIA Tesla V100
# datasheet; bf16 arrived with Ampere, NVIDIA A100 datasheet).
NO_BF16_GPUS = ("v100-sxm2-32gb",)


def precision_problems(job: JobSpec) -> list[Problem]:
    """A bf16 plan on a GPU that has no bf16: its peak (the fp16 tensor-core figure) would not
    apply; the time model's figures are then not those of any run."""
    gpu = job.cluster.gpu
    if gpu in NO_BF16_GPUS and job.train.precision in ("bf16-mixed", "bf16"):
        return [warning("train.precision", f"{gpu} has no bf16 (Volta tensor cores take fp16 only): use "
                                           "fp16-mixed; the time model's figures assume a bf16 the GPU lacks")]
    return []


def job_problems(
    job: JobSpec, shape: ModelShape | None, worlds: list[tuple[int, str]]
) -> list[Problem]:
    """Every cross-field problem of a job whose tables are individually valid.

    `worlds` lists the world sizes given from outside the degrees, each with its source
    (`from --world`, `from cluster: 2 nodes * 8 GPUs`, `from WORLD_SIZE`).
    """
    par = job.parallel
    try:
        degrees = Degrees(dp=par.dp, tp=par.tp, pp=par.pp, cp=par.cp)
    except PlanError as exc:  # a world beyond any cluster: nothing else can be checked
        return [error("parallel", str(exc), DEGREE_KEYS)]
    mismatched = world_problems(degrees, worlds)
    if mismatched and not {"dp", "tp", "pp", "cp"} & par.model_fields_set:
        # A job that gives no degrees asks which: the search answers that.
        mismatched = [replace(p, message=p.message + "; or `shardplan plan` chooses the degrees (and every plan key "
                                                     "the job leaves out)") for p in mismatched]
    problems = list(mismatched)
    for axis in missing_axes(par.order, degrees):
        problems.append(error(
            "parallel.order",
            f"{par.order!r} leaves out {axis}, whose degree is {degrees.of(axis)}",
            ("parallel.order", f"parallel.{axis}"),
        ))
    if shape is not None:
        problems += heads_problems(par.tp, shape)
    problems += pipeline_problems(job, shape.num_layers if shape else None)
    problems += sequence_problems(job, shape)
    # The batch hint follows the world's hint (`world_mismatch`) when the worlds agree on one dp.
    fitting = {degrees.fitting_dp(world) for world, _ in worlds if world != degrees.world}
    problems += batch_problems(job, fitting.pop() if len(fitting) == 1 else None)
    problems += lora_problems(job, shape)
    problems += bare_count_problems(job, shape)
    problems += precision_problems(job)
    placement = layout_problems(degrees, par.order, job.cluster.gpus_per_node,
                                hybrid=job.zero.hybrid and job.zero.stage >= 2)
    # Partly filled nodes matter only on a machine the job names; the default of 8 GPUs per
    # node is not a claim about the user's cluster.
    if "gpus_per_node" not in job.cluster.model_fields_set:
        placement = [p for p in placement if p.path != "cluster.gpus_per_node"]
    # Degrees that do not make the cluster's world place no rank where it will run: their
    # placement says nothing (a 2-node job at dp 1 is not "1 GPU used of node 0").
    if not mismatched:
        problems += placement
    world = worlds[0][0] if worlds else degrees.world
    nodes = -(-world // job.cluster.gpus_per_node)
    problems += sharding_problems(job, nodes)
    if shape is not None and job.offload.prefetch_layers > shape.num_layers:
        problems.append(warning(
            "offload.prefetch_layers",
            f"{job.offload.prefetch_layers} exceeds model.num_layers ({shape.num_layers})",
        ))
    return problems
