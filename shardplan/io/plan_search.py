"""`shardplan plan` from a resolved job: the world, the global batch, the hardware, the fixed
keys; the search; each plan's figures as `estimate` gives them; the job file of the best.

A plan's figures are computed again by `estimate_memory` and the time model on the plan's
inputs, which are the inputs `estimate` derives from the written job file: the two agree to
the byte and the microsecond (tests/test_plan.py).
"""

from __future__ import annotations

import gc
import sys
import time
from collections import Counter
from contextlib import contextmanager
from typing import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..core.degrees import Degrees
from ..core.estimate_inputs import EstimateInputs, default_cpu_budget, inputs_from_job
from ..core.memory import (HOST_WITHOUT_LIMIT, Estimate, cpu_limit, estimate_memory, offload_host_need,
                           resolve_offload, strategy_capacity)
from ..core.pipeline import split_label
from ..core.search import (Fixed, Group, Miss, SearchResult, Space, candidates, degree_options, degree_refusal,
                           model_refusal, next_split_batch, schedule_options, search)
from ..spec.common import MAX_WORLD_SIZE
from ..spec.errors import InputError, Problem
from ..spec.job import JobSpec
from ..spec.names import AUTO
from ..spec.units import GIB, counted, format_bytes
from .files import Document, read_document
from .job import ResolvedJob, hf_config_as_job
from .overrides import apply_overrides
from .plan_job import FIXED_KEYS, fixed_keys, plan_tables, written_job
from .to_fit import set_flags
from .writing import job_folders, relocate_job_paths, write_text

PROGRESS_AFTER = 0.3  # seconds before a search shows its progress bar


@dataclass
class PlanEntry:
    """One plan with its figures, as `estimate` would print them."""

    inputs: EstimateInputs
    tables: dict[str, dict[str, object]]
    estimate: Estimate
    timing: object  # core.step_time.StepTime


@dataclass
class PlanOutcome:
    resolved: ResolvedJob
    document: dict
    world: int
    global_batch: int
    gpu_memory: int
    entries: list[PlanEntry]
    result: SearchResult
    fixed: Fixed
    hardware: object = None
    notes: list[str] = field(default_factory=list)
    folders: dict = field(default_factory=dict)  # where its relative paths are meant from (io/writing.py `job_folders`)

    @property
    def found(self) -> bool:
        return bool(self.entries)

    def closest(self) -> list[Miss]:
        """The misses as shown (text and JSON): one per structure, the closest of its variants
        (degrees and sharding; for a miss timed whole also its recomputation and micro batch,
        for which a miss by its model states alone was measured for none), its layer split and
        schedule named. Misses timed whole first: one found by its model states alone is over
        by at least its figure, so it cannot be said to be closer than one measured whole."""
        shown, seen = [], set()
        for miss in sorted(self.result.misses, key=lambda m: (bool(m.at_least), m.short_bytes)):
            i = miss.inputs
            key = (i.degrees, i.zero_stage, i.hybrid, True if miss.at_least else (i.recompute, i.micro_batch))
            if key not in seen:
                seen.add(key)
                shown.append(miss)
        return shown

    def miss_lines(self) -> list[str]:
        """Nothing fits: the closest misses and what would take them under the GPU."""
        reasons = ", ".join(f"{n:,} {reason}" for reason, n in self.result.rejected.most_common())
        lines = [f"plan: no plan of {counted(self.world, 'GPU')} fits (evaluated {self.result.evaluated:,}"
                 + (f"; {reasons})" if reasons else ")")]
        shown = self.closest()[:3]
        for miss in shown:
            d = miss.inputs.degrees
            what = "GPU" if miss.reason == "GPU memory" else "host"
            hybrid = " hybrid" if miss.inputs.hybrid else ""
            split = split_label(miss.inputs.shape.num_layers, d.pp * miss.inputs.virtual, *miss.inputs.stage_split)
            # Chunks per rank say their schedule: a split of pp x virtual chunks is not of pp stages.
            shown_how = [f"{miss.inputs.schedule} v{miss.inputs.virtual}"] if miss.inputs.virtual > 1 else []
            shown_how += [split] if split else []
            # A miss by its states alone after one timed whole is over by more than it says:
            # not called closer than that one.
            label = "another miss" if miss.at_least and not shown[0].at_least else "closest"
            head = (f"plan: {label}: dp {d.dp} tp {d.tp} pp {d.pp} cp {d.cp}"
                    + (f" ({', '.join(shown_how)})" if shown_how else "") + f", ZeRO {miss.inputs.zero_stage}{hybrid}, ")
            short = format_bytes(miss.short_bytes)
            kept = ("the model states it keeps on the GPU with every offload" if miss.inputs.offload_params
                    or miss.inputs.offload_optimizer else "its parameters and optimizer states")
            lines.append(head + (f"{kept} with the CUDA allowances alone exceed the "
                                 f"{what} memory by {short} (the whole step by more)" if miss.at_least else
                                 f"{miss.inputs.recompute} recomputation, micro batch {miss.inputs.micro_batch}: "
                                 f"{short} over the {what} memory"))
        lines += [f"plan: {note}" for note in self.notes]
        return lines

    def write_best(self, path: Path | str, flag: str = "--write") -> None:
        """The best plan as a job file, written whole or not at all (io/writing.py)."""
        write_text(str(path), self.best_job_text(str(path)), flag)

    def best_job_text(self, target: str) -> str:
        """The best plan's job file as written to `target`: its relative paths name the same
        files from there (io/writing.py `relocate_job_paths`)."""
        import tomli_w

        best = self.entries[0]
        data = relocate_job_paths(written_job(self.document, best.tables), self.folders, target)
        _fit_cluster(data, self.world, self.resolved.job.cluster.gpus_per_node)
        d = best.inputs.degrees
        if target.lower().endswith(".json"):  # read back as JSON, as every command reads a .json job
            import json

            return json.dumps(data, indent=2) + "\n"
        header = (f"# shardplan plan: the fastest of the plans that fit {counted(self.world, 'GPU')}: dp {d.dp} x tp {d.tp} "
                  f"x pp {d.pp} x cp {d.cp}, {best.timing.step_seconds:.3f} s per step\n")
        return header + tomli_w.dumps(data)


def _plan_document(file: str, overrides: list) -> tuple[dict, dict]:
    """The job document a plan is written over, as the loader read it (a Hugging Face
    config.json as the job `[model] hf_config` names it, the overrides written in), and the
    folder its relative paths are meant from."""
    doc = read_document(Path(file)) if file else Document("", {})
    doc, notes = hf_config_as_job(doc)
    return apply_overrides(doc.data, overrides), job_folders(file, overrides, config_as_job=bool(notes))


def _fit_cluster(data: dict, world: int, gpus_per_node: int) -> None:
    """A written `cluster.nodes` must multiply to the plan's world."""
    cluster = data.get("cluster")
    if isinstance(cluster, dict) and "nodes" in cluster:
        if world % gpus_per_node == 0:
            cluster["nodes"] = world // gpus_per_node
        else:
            del cluster["nodes"]


def _world(resolved: ResolvedJob, gpus: int | None, nodes: int | None, fixed: Fixed) -> int:
    cluster = resolved.job.cluster
    if gpus is not None:
        return gpus
    if nodes is None and cluster.nodes is None:
        if None not in (fixed.dp, fixed.tp, fixed.pp, fixed.cp):
            return resolved.world
        raise InputError(Problem("--gpus", "how many GPUs? give --gpus N or --nodes N (or [cluster] nodes)"))
    count, where = (nodes, "--nodes") if nodes is not None else (cluster.nodes, "cluster.nodes")
    world = count * cluster.gpus_per_node
    if world > MAX_WORLD_SIZE:
        problem = Problem(where, f"{count:,} nodes x {cluster.gpus_per_node} GPUs per node = {world:,} GPUs, "
                                 f"more than the largest supported world ({MAX_WORLD_SIZE:,})")
        raise InputError([problem] if nodes is not None else resolved.locate([problem]))
    return world


def _global_batch(resolved: ResolvedJob, global_batch: int | None, fixed: Fixed) -> int:
    if global_batch is not None:
        return global_batch
    train, par = resolved.job.train, resolved.job.parallel
    if train.global_batch_size:
        return train.global_batch_size
    if None not in (fixed.dp, fixed.micro_batch, fixed.num_microbatches):
        return par.dp * par.micro_batch_size * par.num_microbatches
    raise InputError(Problem("--global-batch", "how many sequences per optimizer step? give --global-batch B "
                                               "(or train.global_batch_size)"))


def auto_flags(paths) -> str:
    """`--set KEY=auto` for each key: how a key the job (or its preset) writes is left to the
    search (io/overrides.py)."""
    return " ".join(f"--set {path}={AUTO}" for path in paths)


def _check_fixed(fixed: Fixed, world: int, batch: int, base: EstimateInputs, space: Space,
                 locate: Callable[[list[Problem]], list[Problem]]) -> None:
    """Keys the job fixes that no plan of this world and batch can keep: say which, and how to
    let the search choose them, rather than search nothing. A degree the model refuses at any
    number of GPUs (its heads, its layers) is named first, as `_blame_fixed` names it: more
    GPUs would not help it."""
    degrees = {key: value for key, value in (("dp", fixed.dp), ("tp", fixed.tp), ("pp", fixed.pp), ("cp", fixed.cp))
               if value is not None}
    for key, value in degrees.items():
        why = model_refusal(base.shape, space, key, value, base.seq_len, base.lora) if key != "dp" else None
        if why:
            raise InputError(locate([Problem(f"parallel.{key}", _fixed_refused(
                f"parallel.{key} = {value}", world, why, "it", [f"parallel.{key}"]))]))
    product = 1
    for value in degrees.values():
        product *= value
    if degrees and (world % product or (len(degrees) == 4 and product != world)):
        given = " x ".join(f"parallel.{key} = {value}" for key, value in degrees.items())
        raise InputError(Problem("parallel", f"the job fixes {given} ({counted(product, 'GPU')}), which {counted(world, 'GPU')} cannot hold: "
                                             f"leave them out of the job to let the plan choose them "
                                             f"({auto_flags(f'parallel.{key}' for key in degrees)}), or plan for "
                                             f"a multiple of {product} GPUs"))
    if fixed.pp is not None and fixed.num_microbatches is not None and fixed.num_microbatches < fixed.pp > 1:
        raise InputError(Problem("parallel", f"the job fixes parallel.pp = {fixed.pp} x parallel.num_microbatches = "
                                             f"{fixed.num_microbatches}, and a pipeline of {fixed.pp} stages needs at "
                                             f"least {fixed.pp} microbatches: leave them out of the job to let the plan "
                                             f"choose them ({auto_flags(['parallel.pp', 'parallel.num_microbatches'])})"))
    per_step = [(f"parallel.{key} = {value}", value) for key, value in
                (("dp", fixed.dp), ("micro_batch_size", fixed.micro_batch), ("num_microbatches", fixed.num_microbatches))
                if value is not None]
    freed = auto_flags(text.split(" = ")[0] for text, _ in per_step)
    share = 1
    for _, value in per_step:
        share *= value
    given = " x ".join(text for text, _ in per_step)
    if len(per_step) == 3 and share != batch:
        raise InputError(Problem("parallel", f"the job fixes {given} ({share} sequences per step), which is not the "
                                             f"global batch of {batch} sequences: leave them out of the job to let the "
                                             f"plan choose them ({freed}), or give that batch (--global-batch {share})"))
    if per_step and batch % share:
        raise InputError(Problem("parallel", f"the job fixes {given}, which does not divide the global batch of "
                                             f"{batch} sequences: leave them out of the job to let the plan choose "
                                             f"them ({freed}), or give a global batch they divide (--global-batch)"))
    if fixed.dp is None and fixed.micro_batch is not None and fixed.num_microbatches is not None:
        dp = batch // share  # the data-parallel degree the batch then asks for
        if world % dp:
            raise InputError(Problem("parallel", f"the job fixes {given}, which leaves {dp} data-parallel ranks for "
                                                 f"the global batch of {batch} sequences, and {dp} does not divide "
                                                 f"{world} GPUs: leave them out of the job to let the plan choose them "
                                                 f"({freed}), or give a global batch that makes a divisor of the GPUs (--global-batch)"))


def _blame_fixed(base: EstimateInputs, space: Space, fixed: Fixed, timer, ranking: dict,
                 locate: Callable[[list[Problem]], list[Problem]]) -> None:
    """The search found no candidate at all: when a key the job fixes is why (a plan of the
    space exists without it), that is bad input, named (exit 2), not a plan that does not
    fit. Each fixed key is let go alone, then all together; a search that evaluates nothing
    is quick, so this costs little."""
    # `offload` stands for the offload keys written, not a job key: it only narrows the search.
    given = {name: value for name, value in vars(fixed).items() if value is not None and name != "offload"}
    if not given:
        return

    def searches(relaxed: Fixed) -> bool:
        return search(base, space, relaxed, timer, top_k=1, **ranking).evaluated > 0

    alone = [name for name in given if searches(replace(fixed, **{name: None}))]
    culprits = alone or (list(given) if searches(Fixed()) else [])
    if not culprits:
        return
    text = ", ".join(f"{FIXED_KEYS[name]} = {_value(given[name])}" for name in culprits)
    what = "the plans `shardplan run` executes" if space.runnable else "the plans of the job's framework"
    either = "it" if len(culprits) == 1 else ("one of them" if alone else "them")
    # A degree alone can say why: the rule of the search's degrees that refuses it.
    why = [reason for name in culprits if name in ("tp", "pp", "cp") and base.shape is not None
           for reason in [degree_refusal(base.shape, space, name, given[name], base.seq_len, base.lora)] if reason]
    reason = '; '.join(why) if why else None
    problem = Problem(FIXED_KEYS[culprits[0]] if len(culprits) == 1 else "",
                      _fixed_refused(text, space.world, reason, either, [FIXED_KEYS[name] for name in culprits], what))
    # At the key's flag or file line when one key is to blame; keys from several places stay unplaced.
    raise InputError(locate([problem]) if len(culprits) == 1 else [problem])


def _fixed_refused(text: str, world: int, why: str | None, either: str, keys: list[str], what: str = "") -> str:
    """The message for keys the job fixes that no plan keeps: the rule that refuses them, or
    the space searched."""
    said = (f"the job fixes {text}, which no plan of {counted(world, 'GPU')} keeps: {why}" if why else
            f"the job fixes {text}, which no plan of {counted(world, 'GPU')} keeps (among {what}, for this model "
            "and batch)")
    return f"{said}: leave {either} out of the job and the command line to let the plan choose ({auto_flags(keys)})"


def _chosen(name: str, inputs: EstimateInputs, batch: int) -> str:
    """The value the search chose for a Fixed field, as the plan's job tables write it (a key
    they leave out keeps its default)."""
    table, key = FIXED_KEYS[name].split(".")
    value = plan_tables(inputs, batch).get(table, {}).get(key)
    return f"{FIXED_KEYS[name]} = {_value(value)}" if value is not None else f"{FIXED_KEYS[name]} left at its default"


def _value(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else f'"{value}"' if isinstance(value, str) else str(value)


class _Progress:
    """A rich progress bar on stderr, shown only when the search takes longer than a moment."""

    def __init__(self, enabled: bool):
        self.enabled = enabled and sys.stderr.isatty()
        self.start = time.perf_counter()
        self.bar = None
        self.task = None

    def __call__(self, evaluated: int) -> None:
        if not self.enabled or time.perf_counter() - self.start < PROGRESS_AFTER:
            return
        if self.bar is None:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("searching plans: {task.fields[n]:,} evaluated"),
                                TimeElapsedColumn(), console=Console(file=sys.stderr), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("plan", n=0, total=None)
        self.bar.update(self.task, n=evaluated)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


@contextmanager
def collector_paused():
    """Python's cyclic garbage collector paused for a search. A search allocates hundreds of
    thousands of short-lived objects (plans, terms, cached parts) that hold no cycles:
    reference counting frees them, and the collector's passes over them free nothing and cost
    10-20% of the search (benchmarks/bench_plan.py; the peak resident memory is the same).
    Restored on the way out, whatever happens inside. What survives the search (the caches)
    moves to the oldest generation first (freeze, then unfreeze), as it would have after
    surviving collections: else the first young collection after it scans all of it."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


def search_ranking(hardware, lora) -> tuple[Callable[[EstimateInputs], float], dict]:
    """The step timer on `hardware` and what a search ranks by beside it (core/search.py
    `search`): the offload strategy's decisions and the time bounds, on the same hardware."""
    from ..core.step_time import step_time, step_time_bound, step_time_group_bound, step_time_refined_bound

    def timer(inputs: EstimateInputs) -> float:
        return step_time(inputs, hardware, lora=lora).step_seconds

    def bound(inputs: EstimateInputs) -> float:
        return step_time_bound(inputs, hardware, lora=lora)

    def refine(inputs: EstimateInputs) -> float:
        return step_time_refined_bound(inputs, hardware, lora=lora)

    def group_bound(group: Group) -> float:
        return step_time_group_bound(group[0], tuple(group.batches), hardware, lora=lora)

    return timer, dict(resolve=resolve_offload, bound=bound, refine=refine, group_bound=group_bound)


def run_plan_search(resolved: ResolvedJob, gpus: int | None, nodes: int | None, global_batch: int | None,
                    top: int, progress: bool = True, overrides=None) -> PlanOutcome:
    with collector_paused():
        return _run_plan_search(resolved, gpus, nodes, global_batch, top, progress, overrides)


def _run_plan_search(resolved: ResolvedJob, gpus: int | None, nodes: int | None, global_batch: int | None,
                     top: int, progress: bool, overrides) -> PlanOutcome:
    from ..core.step_time import step_time
    from .hardware import hardware_of, lora_of

    job, shape = resolved.job, resolved.shape
    if shape is None:
        what = "not a bare parameter count" if job.model.params is not None else "and the job names no model"
        raise InputError(Problem("model", "plan needs the model's architecture (a preset, hf_config or inline "
                                          f"shape), {what}"))
    if "gpu_memory" not in job.cluster.model_fields_set:
        raise InputError(Problem("cluster.gpu_memory", "plan needs the GPU memory: set [cluster] gpu_memory or a "
                                                       "cluster preset (--set cluster.preset=h100-80gb)"))
    hardware = hardware_of(job.cluster)
    if hardware is None:
        raise InputError(Problem("cluster.gpu", "plan ranks plans by predicted step time and needs the GPU: set "
                                                "[cluster] gpu (e.g. --set cluster.gpu=h100-sxm) or a cluster preset"))
    if job.lora is not None and job.lora.base_dtype == "nf4" and job.zero.framework == "fsdp2":
        from ..core.lora import nf4_problems

        bad = nf4_problems(shape, 1, 1)
        if bad:
            name, _, numel = bad[0]
            raise InputError(Problem("lora.base_dtype", f"plan searches the plans `run` executes, and torchao stores "
                                                        f"NF4 weights only in whole blocks of 64 * 256 elements: "
                                                        f"{name} has {numel:,} (plan it with base_dtype = \"bf16\", "
                                                        "or estimate the NF4 plan you have in mind)"))
    fixed = fixed_keys(job)
    world = _world(resolved, gpus, nodes, fixed)
    batch = _global_batch(resolved, global_batch, fixed)
    lora = lora_of(job.lora)
    base = inputs_from_job(job, shape, True).with_(degrees=Degrees(dp=world))
    space = Space.of_framework(job.zero.framework, world, batch)
    _check_fixed(fixed, world, batch, base, space, resolved.locate)

    timer, ranking = search_ranking(hardware, lora)
    bar = _Progress(progress)
    try:
        result = search(base, space, fixed, timer, top_k=top, progress=bar, **ranking)
    finally:
        bar.close()
    document, folders = _plan_document(resolved.file, overrides or [])
    entries = []
    for found in result.plans:
        estimate = estimate_memory(found.asked)  # what `estimate` does with the written job
        timing = step_time(estimate.inputs, hardware, lora=lora)
        entries.append(PlanEntry(estimate.inputs, plan_tables(found.asked, batch), estimate, timing))
    if not result.evaluated:
        _blame_fixed(base, space, fixed, timer, ranking, resolved.locate)
    outcome = PlanOutcome(resolved, document, world, batch, job.cluster.gpu_memory, entries, result, fixed, hardware,
                          folders=folders)
    if space.runnable and fixed.schedule == "zero-bubble" and fixed.pp is None:
        outcome.notes.append(ZERO_BUBBLE_LEFT_OUT)
    if entries and space.runnable:
        outcome.notes += _refused_by_run(resolved, entries[0].tables)
    if not entries:
        if result.batch_unsplit():
            outcome.notes += _batch_that_splits(base, space, fixed, timer, ranking)
        else:
            outcome.notes += _what_it_would_take(base, space, fixed, timer, ranking)
    return outcome


# A job of the `fsdp2` space that fixes the zero-bubble schedule, which `run` refuses with
# more than one stage (runtime/capabilities.py): the search keeps the plans of one stage.
ZERO_BUBBLE_LEFT_OUT = (
    "parallel.pipeline_schedule: `shardplan run` does not execute zero-bubble pipelines (torch 2.13's "
    "ScheduleInterleavedZeroBubble diverges under FSDP2), so only plans of one stage, where no schedule runs, "
    f"were searched: --framework zero-paper plans zero-bubble pipelines, --set parallel.pipeline_schedule={AUTO} "
    "lets the search choose the schedule")


def _refused_by_run(resolved: ResolvedJob, tables: dict[str, dict[str, object]]) -> list[str]:
    """What `run` refuses of the best plan (runtime/capabilities.py). The search's space under
    fsdp2 holds only what `run` executes, so what is left comes from keys the job fixes
    (fp16-mixed, NF4 weights or 8-bit AdamW states offloaded as written): the plans are
    estimated all the same, and the user is told that `run` will not execute them."""
    from ..runtime.capabilities import unsupported

    job = resolved.job
    update = {name: getattr(job, name).model_copy(update=keys) for name, keys in tables.items()
              if getattr(job, name, None) is not None}
    planned = replace(resolved, job=job.model_copy(update=update))
    return [f"{p.path}: `shardplan run` would refuse these plans: {p.message}" for p in unsupported(planned)]


def _with_nf4_offload(base: EstimateInputs, space: Space, fixed: Fixed, timer, ranking: dict) -> list[str]:
    """QLoRA that fits nowhere in `run`'s space: the fastest plan of these GPUs with its NF4
    weights offloaded to the CPU, which `run` does not execute and FSDP+QLoRA trainers do
    (Answer.AI's fsdp_qlora, `--use_cpu_offload`: Llama-2 70B on two 24 GB GPUs), as the flags
    that make `estimate` show it."""
    if not (space.runnable and space.offload and fixed.offload is None and base.lora is not None and base.lora.nf4):
        return []
    asked = base.with_(strategy="balanced") if base.strategy == "conservative" else base
    found = search(asked, replace(space, nf4_offload=True), fixed, timer, top_k=1, **ranking).plans
    if not found:
        return []
    best = found[0]
    defaults = JobSpec()  # keys at their default need no flag
    settings = {f"{table}.{key}": value for table, keys in plan_tables(best.asked, space.global_batch).items()
                for key, value in keys.items() if getattr(getattr(defaults, table, None), key, None) != value}
    if asked is not base:
        settings["offload.strategy"] = "balanced"
    d = best.inputs.degrees
    return [f"outside the plans `run` executes, with NF4 weights offloaded to the CPU as FSDP+QLoRA trainers do "
            f"(fsdp_qlora's --use_cpu_offload), a plan fits {counted(space.world, 'GPU')}: dp {d.dp} tp {d.tp} pp {d.pp}, "
            f"ZeRO {best.inputs.zero_stage}, {best.seconds:.3g} s per step; `shardplan estimate` shows it with: "
            f"{set_flags(settings)}"]


# Batches `_batch_that_splits` tries with a search of the structures, at most: each costs no
# more than the search that found no split.
SPLIT_TRIES = 16


def _batch_that_splits(base: EstimateInputs, space: Space, fixed: Fixed, timer, ranking: dict) -> list[str]:
    """No plan splits the global batch (every data-parallel rank takes whole sequences, a
    pipeline of pp stages needs at least pp microbatches): the nearest larger batch that a
    plan splits, up to 64 times the batch, and whether a plan of it fits (if not, what would
    make one fit at it). More GPUs only make the split harder.

    Each structure's nearest larger batch is arithmetic (core/search.py `next_split_batch`); the
    candidates check
    only those, in increasing order and at most SPLIT_TRIES of them: bounded work, whatever
    the batch."""
    given = space.global_batch
    head = (f"no plan of {counted(space.world, 'GPU')} splits a global batch of {given} (each data-parallel rank takes "
            "whole sequences; a pipeline of pp stages needs at least pp microbatches)")
    limit = 64 * given
    nearest = set()
    for degrees in degree_options(base.shape, space, fixed, base.seq_len, base.lora):
        for schedule, _, _ in schedule_options(base.shape, degrees.pp, space, fixed):
            batch = next_split_batch(given, degrees.dp, degrees.pp, schedule, space, fixed)
            if batch is not None and batch <= limit:
                nearest.add(batch)
    fewer = _fewer_gpus(base, space, fixed, timer, ranking)
    for batch in sorted(nearest)[:SPLIT_TRIES]:
        larger = replace(space, global_batch=batch)
        if not any(True for _ in candidates(base, larger, fixed, Counter())):
            continue
        if search(base, larger, fixed, timer, top_k=1, **ranking).plans:
            return [f"{head}: with a global batch of {batch} (--global-batch {batch}) a plan fits"] + fewer
        return ([f"{head}: a global batch of {batch} splits, but no plan of it fits; at that batch:"]
                + _what_it_would_take(base, larger, fixed, timer, ranking) + fewer)
    return [f"{head}, nor one up to {limit}"] + (fewer or ["plan fewer GPUs (--gpus)"])


def _fewer_gpus(base: EstimateInputs, space: Space, fixed: Fixed, timer, ranking: dict) -> list[str]:
    """The most GPUs among `fewer_worlds`, fewer than the job's, with a plan that splits and
    fits this global batch: the answer when the batch is set for convergence, not for these
    GPUs."""
    free = Fixed(**{**fixed.__dict__, "dp": None})
    for world in fewer_worlds(space.world, base.gpus_per_node):
        if search(base.with_(degrees=Degrees(dp=world)), replace(space, world=world), free, timer, top_k=1,
                  **ranking).plans:
            return [f"with {world:,} GPUs (--gpus {world}) a plan fits this global batch of {space.global_batch:,}"]
    return []


# The plans of the search with room on the host (core/memory.py HOST_WITHOUT_LIMIT) whose host
# memory `_what_it_would_take` compares.
HOST_TRIES = 5

# Counts `_what_it_would_take` tries between a world that fits nothing and twice it that fits.
BETWEEN_TRIES = 3


def next_regular_world(world: int, gpus_per_node: int) -> int:
    """The GPU count above `world` that the more-GPU trials start from: twice it when it is a
    count machines come in (whole nodes, or a power of two within one node), else the next
    such count (7 GPUs, a node with one GPU out, gives 8; 12 on nodes of 8 gives 16), where
    doubling an odd count would only reach counts few degrees divide."""
    if world >= gpus_per_node:
        return 2 * world if world % gpus_per_node == 0 else -(-world // gpus_per_node) * gpus_per_node
    if world & (world - 1) == 0:
        return 2 * world
    return min(1 << world.bit_length(), gpus_per_node)


# Whole-node counts `fewer_worlds` tries one by one below the job's, before it halves.
FEWER_NODES = 8


def fewer_worlds(world: int, gpus_per_node: int) -> list[int]:
    """GPU counts below `world` to try, most first: the FEWER_NODES whole-node counts below it,
    then halving in whole nodes; within one node, every count below the job's (or, past one
    node, halving from a node)."""
    counts: list[int] = []
    if world > gpus_per_node:
        nodes = (world - 1) // gpus_per_node  # whole nodes strictly below the world
        while nodes >= 1:
            counts.append(nodes * gpus_per_node)
            nodes = nodes - 1 if len(counts) < FEWER_NODES else nodes // 2
        count = gpus_per_node
        while count > 1:
            count //= 2
            counts.append(count)
    else:
        counts = list(range(world - 1, 0, -1))
    return counts


def between(low: int, high: int, gpus_per_node: int) -> list[int]:
    """Up to BETWEEN_TRIES GPU counts strictly between `low` and `high`, evenly spaced and
    increasing: whole nodes once past one node, single GPUs within one."""
    unit = gpus_per_node if high > gpus_per_node else 1
    counts = {-(-(low + (high - low) * i // (BETWEEN_TRIES + 1)) // unit) * unit for i in range(1, BETWEEN_TRIES + 1)}
    return sorted(c for c in counts if low < c < high)



def host_to_ask(base: EstimateInputs, need: int) -> tuple[EstimateInputs, dict[str, str]]:
    """The job with the host memory that gives the offload `need` bytes per node, and the
    `--set` keys that make it: the smallest node in whole GiB whose default budget (its memory
    less the reserve) reaches `need`; a budget the job states is raised to `need` instead, on
    a node at least that large."""
    explicit = base.cpu_memory_per_node is not None and base.cpu_memory_budget != default_cpu_budget(
        base.cpu_memory_per_node)
    if explicit:
        budget = max(base.cpu_memory_budget, -(-need // GIB) * GIB)
        ram = max(base.cpu_memory_per_node, budget)
    else:
        ram = -(-need // GIB) * GIB
        while default_cpu_budget(ram) < need:
            ram += GIB
        ram = max(ram, base.cpu_memory_per_node or 0)
        budget = default_cpu_budget(ram)
    keys = {"cluster.cpu_memory_per_node": f"{-(-ram // GIB)}GiB"} if ram != base.cpu_memory_per_node else {}
    if budget != default_cpu_budget(ram):
        keys["offload.cpu_memory_budget"] = f"{-(-budget // GIB)}GiB"
    return base.with_(cpu_memory_per_node=ram, cpu_memory_budget=budget), keys


def _what_it_would_take(base: EstimateInputs, space: Space, fixed: Fixed, timer, ranking: dict) -> list[str]:
    """Nothing fits: what would, at this global batch. Offload first when the job's strategy
    forbids it (the same GPUs), or the host memory per node the offload needs when the host
    stops it, then more GPUs: doubling, up to 64 times as many and never more
    than the largest supported world, and then the fewest of a few counts between the last
    doubling that fit nothing and the first that fits (`between`)."""
    notes = []

    def searched(inputs: EstimateInputs, world: int, dp_fixed: bool, top_k: int = 1) -> SearchResult:
        keep = fixed if dp_fixed else Fixed(**{**fixed.__dict__, "dp": None})
        return search(inputs.with_(degrees=Degrees(dp=world)), replace(space, world=world), keep, timer, top_k=top_k,
                      **ranking)

    if base.strategy == "conservative" and fixed.offload is None and space.offload:
        if searched(base.with_(strategy="balanced"), space.world, True).plans:
            notes.append(f'with offload (--set offload.strategy=balanced) a plan fits {space.world} GPUs')
    elif space.offload and base.cpu_memory_budget is not None:
        # The strategy may offload, but the host memory it may use can be what stops it: the
        # same search with room on the host, and the least host memory of its fastest plans.
        roomy = base.with_(cpu_memory_per_node=HOST_WITHOUT_LIMIT, cpu_memory_budget=HOST_WITHOUT_LIMIT)
        found = searched(roomy, space.world, True, top_k=HOST_TRIES).plans
        if found:
            # The least host limit with which the strategy still brings each under the GPU.
            needs = [offload_host_need(plan.asked, strategy_capacity(base)) for plan in found]
            need = min((n for n in needs if n is not None), default=None)
            asked, keys = host_to_ask(base, need) if need is not None else (base, {})
            if need is not None and searched(asked, space.world, True).plans:
                notes.append(f"with {format_bytes(need)} of host memory per node for the offload (it may use "
                             f"{format_bytes(cpu_limit(base))} now) a plan fits {counted(space.world, 'GPU')}: "
                             + " ".join(f"--set {key}={value}" for key, value in keys.items()))
    notes += _with_nf4_offload(base, space, fixed, timer, ranking)
    # A key the job fixes (other than the degrees, which more GPUs relax below): a plan of these
    # GPUs that fits once the search may choose it.
    for name, value in vars(fixed).items():
        if value is None or name in ("dp", "tp", "pp", "cp", "offload"):
            continue
        relaxed = search(base, space, replace(fixed, **{name: None}), timer, top_k=1, **ranking)
        if relaxed.plans:
            chosen = relaxed.plans[0].asked
            notes.append(f"with {FIXED_KEYS[name]} left to the search instead of {_value(value)} "
                         f"({auto_flags([FIXED_KEYS[name]])}) a plan fits {counted(space.world, 'GPU')}: {_chosen(name, chosen, space.global_batch)}")
    first = next_regular_world(space.world, base.gpus_per_node)
    worlds = [first * factor for factor in (1, 2, 4, 8, 16, 32) if first * factor <= MAX_WORLD_SIZE]
    if not worlds:
        return notes + [f"more GPUs cannot be planned ({space.world:,} GPUs is over half the largest supported world, "
                        f"{MAX_WORLD_SIZE:,}): lower the sequence length, or plan a smaller model"]
    unsplit = True  # no larger world splits the global batch either
    below = space.world  # the largest world tried that fits nothing
    for world in worlds:
        result = searched(base, world, False)
        if result.plans:
            # Fitting is not monotonic in the GPUs (the degrees must divide them), so the
            # counts between the last miss and this one are tried too, a few, in whole nodes.
            fewest = next((w for w in between(below, world, base.gpus_per_node)
                           if searched(base, w, False).plans), world)
            return notes + [f"with {fewest:,} GPUs (--gpus {fewest}) a plan fits at this global batch"]
        unsplit = unsplit and result.batch_unsplit()
        below = world
    if unsplit:
        return notes + [f"more GPUs do not help: no plan of {worlds[0]:,} to {worlds[-1]:,} GPUs splits a "
                        f"global batch of {space.global_batch:,} (raise --global-batch)"]
    most = f" (the most that can be planned: {MAX_WORLD_SIZE:,} at most)" if len(worlds) < 6 else ""
    kept = " with the job's keys as written" if notes else ""
    return notes + [f"not even {worlds[-1]:,} GPUs{most} fit this global batch{kept}: lower the sequence length, "
                    "or plan a smaller model"]
