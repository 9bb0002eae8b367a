"""The search over the published runs of tests/time_references.py, in the space each ran in:
shared by tests/test_plan.py and benchmarks/validate_plans.py (docs/plan.md, "Held against
published plans")."""

from __future__ import annotations

from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs, default_cpu_budget
from shardplan.core.hardware import TimeConstants
from shardplan.core.search import Fixed, Found, Space, search
from shardplan.core.step_time import step_time, step_time_bound, step_time_refined_bound
from time_references import A100_80GB

GiB = 1024 ** 3
DGX_HOST = 2048 * GiB  # DGX A100 80GB: 2 TB of system memory (NVIDIA DGX A100 datasheet)

# The space of Megatron-LM as Table 1 ran it (NVIDIA/Megatron-LM at 6fd781891c, April 2021): full
# recomputation, no ZeRO, no sequence or context parallel; the layers split evenly over the
# stages ("num_layers must be divisible by pipeline_model_parallel_size",
# megatron/model/transformer.py:551; it had no first or last stage layer options); the
# interleaved schedule only above 2 stages ("pipeline-model-parallel size should be greater
# than 2 with interleaved schedule", megatron/arguments.py:119).
MEGATRON_2021 = dict(recompute="full", zero_stage=0, sequence_parallel=False, first_stage_layers=0,
                     last_stage_layers=0)


def timers(constants: TimeConstants | None = None):
    """The step time, its lower bound and its sharper bound on a DGX A100, as `plan` ranks."""
    constants = constants or TimeConstants()
    return (lambda i: step_time(i, A100_80GB, constants).step_seconds,
            lambda i: step_time_bound(i, A100_80GB, constants),
            lambda i: step_time_refined_bound(i, A100_80GB, constants))


def published_search(run, fixed: Fixed, runnable: bool = True, top_k: int = 5):
    """The published run on DGX A100 80GB nodes, and the search over its GPUs and global batch."""
    base = run.inputs.with_(gpu_memory=80 * GiB, gpus_per_node=8, cpu_memory_per_node=DGX_HOST,
                            cpu_memory_budget=default_cpu_budget(DGX_HOST))
    timer, bound, refine = timers(run.constants)
    batch = base.degrees.dp * base.micro_batch * base.num_microbatches
    # Megatron-LM splits tied embeddings over tensor parallel (its vocabulary-parallel embedding).
    space = Space(world=run.gpus, global_batch=batch, runnable=runnable, offload=False, tied_tp=True)
    result = search(base.with_(degrees=Degrees(dp=run.gpus)), space, fixed, timer, top_k=top_k, bound=bound,
                    refine=refine)
    return base, timer, result


def megatron_2021_runs(inputs: EstimateInputs) -> bool:
    """Whether Megatron-LM of April 2021 runs this plan of the MEGATRON_2021 search: the layers
    split evenly over the stages and, interleaved, over every stage's chunks."""
    pp, chunks = inputs.degrees.pp, inputs.degrees.pp * inputs.virtual
    return (inputs.stage_split == (0, 0) and inputs.shape.num_layers % chunks == 0
            and (inputs.schedule != "interleaved-1f1b" or pp > 2))


def table_1_plans(run) -> tuple[EstimateInputs, list[Found], list[Found]]:
    """The published plan of a Narayanan et al. 2021 Table 1 row, the five fastest plans
    Megatron-LM of 2021 runs on its GPUs and global batch, and the fastest of them with the
    published tensor x pipeline split. The search keeps more than five, so that five remain
    once the plans Megatron-LM then refused are left out."""
    base, _, result = published_search(run, Fixed(**MEGATRON_2021), top_k=12)
    best = [plan for plan in result.plans if megatron_2021_runs(plan.inputs)][:5]
    d = base.degrees
    _, _, same = published_search(run, Fixed(tp=d.tp, pp=d.pp, schedule="1f1b" if d.pp <= 2 else None,
                                             **MEGATRON_2021), top_k=1)
    return base, best, same.plans


def _described(plan: Found) -> str:
    i = plan.inputs
    schedule = f"{i.schedule} v{i.virtual}" if i.virtual > 1 else i.schedule
    return f"{i.degrees.tp} x {i.degrees.pp}, {schedule}, micro batch {i.micro_batch}"


def table_1_row(run, base: EstimateInputs, best: list[Found], same: list[Found]) -> tuple[str, bool]:
    """The Markdown row docs/plan.md records for a Table 1 row (benchmarks/validate_plans.py
    prints them all), and whether the published split is in the top 5 or within 5% of the best."""
    d = base.degrees
    in_top = any((p.inputs.degrees.tp, p.inputs.degrees.pp) == (d.tp, d.pp) for p in best)
    ratio = same[0].seconds / best[0].seconds
    note = " (in the top 5)" if in_top and ratio > 1.05 else ""
    row = (f"| {run.name}, {run.gpus} GPUs | {d.tp} x {d.pp} | {_described(best[0])} | {best[0].seconds:.2f} "
           f"| {_described(same[0])} | {same[0].seconds:.2f} | {ratio:.3f}{note} |")
    return row, in_top or ratio <= 1.05
