"""What would make a plan that does not fit fit: the cheapest changes, found by the planner.

`estimate` on a plan over the GPU (or host) memory asks the same search `shardplan plan`
runs, once per lever, with every other plan key held at the job's value: recomputation, the
micro batch (the global batch kept), both, the sharding, the sharding with both, offload
(when the job's strategy forbids it; a strategy that offloads does so in every lever's
search, as in the estimate of the changed job), the layout (degrees, sequence parallel, schedule, micro
batch), and every plan key at once, always on the same GPUs and global batch. Each lever's
fastest fitting plan is one suggestion, written as the `--set` flags that turn the job into
it. The fastest suggestions are shown (by predicted step time with the cluster's GPU, else
ranked with the H100 figures and shown without times), and the one that changes the fewest
keys among them when it is not.

Without an architecture (`--params`) there is nothing to search: the levers of the model
states are tried directly (ZeRO stage, offload, more data-parallel GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.degrees import Degrees
from ..core.estimate_inputs import EstimateInputs
from ..core.memory import estimate_memory, offload_host_need
from ..core.search import Fixed, Space, search
from .plan_job import plan_tables

# (lever, the Fixed fields it frees)
_BATCH = ("micro_batch", "num_microbatches")
_LAYOUT = ("dp", "tp", "pp", "cp", "sequence_parallel", "schedule", "virtual", "first_stage_layers",
           "last_stage_layers") + _BATCH
LEVERS = (
    ("recomputation", ("recompute",)),
    ("micro batch", _BATCH),
    ("recomputation and micro batch", ("recompute",) + _BATCH),
    ("sharding", ("zero_stage", "hybrid")),
    ("sharding, recomputation and micro batch", ("zero_stage", "hybrid", "recompute") + _BATCH),
    ("offload", ()),
    ("offload, sharding, recomputation and micro batch", ("zero_stage", "hybrid", "recompute") + _BATCH),
    ("layout", _LAYOUT),
    ("every plan key", _LAYOUT + ("zero_stage", "hybrid", "recompute")),
)


@dataclass(frozen=True)
class Change:
    """A suggestion: the job keys to set, and the plan's figures after it."""

    lever: str
    settings: dict[str, object]  # dotted job key -> value
    peak_gpu_bytes: int
    cpu_bytes_per_node: int
    step_seconds: float | None  # None when the cluster's GPU is unknown

    def flags(self) -> str:
        return set_flags(self.settings)


def set_flags(settings: dict[str, object]) -> str:
    """Dotted job keys and values as the `--set` flags that give them (TOML's booleans, a
    string as the bare word `--set` reads as one)."""
    def text(value: object) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return " ".join(f"--set {key}={text(value)}" for key, value in settings.items())


def _fixed_as_job(inputs: EstimateInputs) -> Fixed:
    d = inputs.degrees
    first, last = inputs.stage_split
    return Fixed(dp=d.dp, tp=d.tp, pp=d.pp, cp=d.cp, sequence_parallel=inputs.sequence_parallel,
                 schedule=inputs.schedule, virtual=inputs.virtual, first_stage_layers=first,
                 last_stage_layers=last, micro_batch=inputs.micro_batch, num_microbatches=inputs.num_microbatches,
                 zero_stage=inputs.zero_stage, hybrid=inputs.hybrid, recompute=inputs.recompute, offload=True)


def _settings(before: EstimateInputs, after: EstimateInputs, global_batch: int) -> dict[str, object]:
    """The job keys whose values differ between the two plans, with the new values."""
    old, new = plan_tables(before, global_batch), plan_tables(after, global_batch)
    out: dict[str, object] = {}
    for table, keys in new.items():
        for key, value in keys.items():
            if old.get(table, {}).get(key) != value:
                out[f"{table}.{key}"] = value
    return out


def changes_to_fit(asked: EstimateInputs, hardware, lora=None, limit: int = 3) -> list[Change]:
    """Up to `limit` changes, each of one lever, that make the plan fit; fastest first."""
    if asked.gpu_memory is None:
        return []
    if asked.shape is None:
        return _state_levers(asked, limit)
    from .hardware import FALLBACK_GPU, _preset_cluster, hardware_of
    from .plan_search import collector_paused, search_ranking

    known = hardware is not None
    timer, ranking = search_ranking(hardware if known else hardware_of(_preset_cluster(FALLBACK_GPU)), lora)
    with collector_paused():
        found = _levers_searched(asked, timer, ranking, known)
    host = _more_host(asked, timer if known else None)
    if host is not None:
        found[tuple(host.settings.items())] = host
    # A change that adds keys to another with the same figures says nothing more (a lever that
    # may also offload finds the plan that fits without): the fewer keys are kept.
    found = {key: change for key, change in found.items() if not any(
        other is not change and set(other.settings.items()) < set(change.settings.items())
        and (other.peak_gpu_bytes, other.step_seconds) == (change.peak_gpu_bytes, change.step_seconds)
        for other in found.values())}
    ordered = sorted(found.values(), key=lambda c: (timer_of(c), len(c.settings)))[:limit]
    smallest = min(found.values(), key=lambda c: (len(c.settings), timer_of(c)), default=None)
    if smallest is not None and smallest not in ordered:
        ordered[-1] = smallest  # the fastest changes, and the smallest one
    return ordered


def _more_host(asked: EstimateInputs, timer) -> Change | None:
    """The same plan on nodes with the host memory its offload needs, when the host limit is
    what stops it: the offload strategy's plan with room on the host fits the GPU."""
    from .plan_search import host_to_ask

    need = offload_host_need(asked, asked.gpu_memory)
    if need is None:
        return None
    more, settings = host_to_ask(asked, need)
    estimate = estimate_memory(more)
    if not settings or not estimate.fits:
        return None
    return Change("host memory", settings, estimate.peak_gpu_bytes, estimate.cpu_bytes_per_node,
                  timer(estimate.inputs) if timer is not None else None)


def _levers_searched(asked: EstimateInputs, timer, ranking: dict, known: bool) -> dict[tuple, Change]:
    """Each lever's fastest fitting plan (`LEVERS`), one per distinct change of settings."""
    d = asked.degrees
    world = d.dp * d.tp * d.pp * d.cp
    global_batch = d.dp * asked.micro_batch * asked.num_microbatches
    job_fixed = _fixed_as_job(asked)
    # A strategy that offloads does so for every lever's plans, as the estimate of the changed
    # job would: a plan that fits only once it offloads (ZeRO-3 lets it offload parameters) is
    # a suggestion. The offload the job writes stays as written.
    strategy_offloads = asked.strategy != "conservative"
    written = asked.offload_params or asked.offload_grads or asked.offload_optimizer
    found: dict[tuple, Change] = {}
    for lever, freed in LEVERS:
        base, fixed = asked, replace(job_fixed, **dict.fromkeys(freed))
        if lever.startswith("offload"):
            if strategy_offloads:
                continue  # the estimate's own strategy offloads in every lever's search
            base, fixed = asked.with_(strategy="balanced"), replace(fixed, offload=None)
        elif strategy_offloads and not written:
            fixed = replace(fixed, offload=None)
        if lever == "layout":
            base = base.with_(degrees=Degrees(dp=world))
        space = Space.of_framework(asked.framework, world, global_batch,
                                   offload=lever.startswith("offload") or strategy_offloads)
        result = search(base, space, fixed, timer, top_k=1, **ranking)
        if not result.plans:
            continue
        best = result.plans[0]
        settings = _settings(asked, best.asked, global_batch)
        if lever.startswith("offload"):
            settings["offload.strategy"] = "balanced"
        if not settings:
            continue
        key = tuple(sorted(settings.items(), key=lambda kv: kv[0]))
        change = Change(lever, settings, best.peak_gpu_bytes, best.cpu_bytes_per_node,
                        best.seconds if known else None)
        if key not in found:
            found[key] = change
    return found


def timer_of(change: Change) -> float:
    return change.step_seconds if change.step_seconds is not None else 0.0


def _state_levers(asked: EstimateInputs, limit: int) -> list[Change]:
    """No architecture: the model states' own levers, tried with the estimate itself."""
    trials: list[tuple[str, dict[str, object], EstimateInputs]] = []
    d = asked.degrees
    if d.dp > 1:
        for stage in range(asked.zero_stage + 1, 4):
            trials.append(("sharding", {"zero.stage": stage}, asked.with_(zero_stage=stage)))
    if asked.strategy == "conservative":
        trials.append(("offload", {"offload.strategy": "balanced"}, asked.with_(strategy="balanced")))
    for factor in (2, 4, 8):  # more GPUs shard the states only under ZeRO-3
        more = Degrees(dp=d.dp * factor, tp=d.tp, pp=d.pp, cp=d.cp)
        settings: dict[str, object] = {"parallel.dp": more.dp}
        if asked.zero_stage != 3:
            settings["zero.stage"] = 3
        trials.append(("more GPUs", settings, asked.with_(degrees=more, zero_stage=3)))
    host = _more_host(asked, None)
    changes = [host] if host is not None else []
    for lever, settings, inputs in trials:
        estimate = estimate_memory(inputs)
        if estimate.fits:
            changes.append(Change(lever, settings, estimate.peak_gpu_bytes, estimate.cpu_bytes_per_node, None))
            if lever == "more GPUs":
                break  # the fewest GPUs that fit
    return changes[:limit]
