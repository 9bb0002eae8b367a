"""Plans found by `shardplan plan` -> a table, or the contract's JSON."""

from __future__ import annotations

from ..core.collectives import spans_nodes
from ..core.pipeline import split_label
from ..spec.units import counted, format_bytes
from .output import Line


def _sharding(inputs) -> str:
    stage = f"ZeRO-{inputs.zero_stage}"
    return stage + " hybrid" if inputs.hybrid else stage


def _schedule(inputs) -> str:
    d = inputs.degrees
    if d.pp == 1:
        return "-"
    text = inputs.schedule + (f" v{inputs.virtual}" if inputs.virtual > 1 else "")
    split = split_label(inputs.shape.num_layers, d.pp * inputs.virtual, *inputs.stage_split)
    return text + (", " + split if split else "")


def _offload(entry) -> str:
    inputs = entry.inputs
    kinds = [k for k, on in (("params", inputs.offload_params), ("grads", inputs.offload_grads),
                             ("optimizer", inputs.offload_optimizer)) if on]
    if not kinds:
        return ""
    resident = entry.estimate.assumptions.get("offload", {}).get("resident_layers")
    if inputs.offload_params and resident:
        # The count belongs to the parameters: the layers whose parameters live on the host.
        layers = max(d.num_layers for d in entry.estimate.devices)
        kinds[0] = f"params ({layers - max(resident)} of {layers} layers)"
    return "+".join(kinds)


def _offload_document(entry) -> dict:
    """What the plan keeps on the CPU, as its estimate decided (the job file writes only the
    offload the job asked for: the strategy decides the rest again, docs/plan.md)."""
    inputs = entry.inputs
    resident = entry.estimate.assumptions.get("offload", {}).get("resident_layers")
    return {"params": inputs.offload_params, "grads": inputs.offload_grads, "optimizer": inputs.offload_optimizer,
            "resident_layers": list(resident) if inputs.offload_params and resident else None}


def plan_warnings(entry) -> list[str]:
    """What a plan does that an experienced user would not do without a reason: tensor
    parallel across nodes (its all-reduces on the network; `layout` warns the same)."""
    inputs = entry.inputs
    d = inputs.degrees
    if d.tp > 1 and spans_nodes(d, inputs.order, inputs.gpus_per_node, "tp"):
        return [f"tensor-parallel groups span nodes (tp {d.tp} on nodes of {inputs.gpus_per_node} GPUs): their "
                "all-reduces run at the inter-node bandwidth, as the step time counts them"]
    return []


def plan_rows(outcome) -> tuple[list[str], list[list[str]]]:
    headers = ["#", "dp", "tp", "pp", "cp", "sp", "sharding", "recompute", "mbs x acc", "schedule",
               "peak GPU", "step s", "tok/s/GPU", "MFU", "bottleneck"]
    if any(_offload(e) for e in outcome.entries):
        headers.insert(10, "offload")
    rows = []
    for index, entry in enumerate(outcome.entries, 1):
        inputs, t = entry.inputs, entry.timing
        d = inputs.degrees
        share = entry.estimate.peak_gpu_bytes / outcome.gpu_memory
        row = [str(index), str(d.dp), str(d.tp), str(d.pp), str(d.cp), "yes" if inputs.sequence_parallel else "-",
               _sharding(inputs), inputs.recompute, f"{inputs.micro_batch} x {inputs.num_microbatches}",
               _schedule(inputs), f"{format_bytes(entry.estimate.peak_gpu_bytes)} ({share:.0%})",
               f"{t.step_seconds:.3f}", f"{t.tokens_per_second_per_gpu:,.0f}", f"{t.mfu:.1%}", t.bottleneck.replace("_", " ")]
        if "offload" in headers:
            row.insert(10, _offload(entry) or "-")
        rows.append(row)
    return headers, rows


def print_plans(console, outcome) -> None:
    """The table of plans, best first, then what the search did."""
    result = outcome.result
    name = outcome.resolved.model_name or "model"
    lines = [Line(f"{name}: plans for {counted(outcome.world, 'GPU')} ({outcome.hardware.name}, "
                  f"{format_bytes(outcome.gpu_memory)} each), global batch {outcome.global_batch:,} x "
                  f"{outcome.resolved.job.train.seq_len:,} tokens, fastest first",
                  style="bold")]
    if outcome.entries:
        headers, rows = plan_rows(outcome)
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        right = {"#", "dp", "tp", "pp", "cp", "peak GPU", "step s", "tok/s/GPU", "MFU"}

        def line(cells: list[str]) -> str:
            return "  ".join(c.rjust(w) if headers[i] in right else c.ljust(w)
                             for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

        lines.append(Line(line(headers)))
        lines += [Line(line(r)) for r in rows]
    searched = f"evaluated {counted(result.evaluated, 'plan')} in {result.seconds:.2f} s"
    if result.rejected:
        searched += "; rejected: " + ", ".join(f"{n:,} {reason}" for reason, n in result.rejected.most_common())
    lines.append(Line(searched, style="dim"))
    said: dict[str, list[str]] = {}
    for index, entry in enumerate(outcome.entries, 1):
        for warning in plan_warnings(entry):
            said.setdefault(warning, []).append(str(index))
    for warning, plans in said.items():
        lines.append(Line(f"{'plan' if len(plans) == 1 else 'plans'} {', '.join(plans)}: "
                          f"{warning}; `shardplan layout` shows the groups", style="yellow"))
    if result.offloaded and outcome.entries:
        lines.append(Line("nothing fits without offload: these plans offload as the balanced strategy decides",
                          style="yellow"))
    for line_ in lines:
        console.print(line_, soft_wrap=True)


def plan_document(outcome) -> dict:
    """The contract's `plan` JSON: the plans best first, each with the job tables the search
    set, its figures and its time; what was evaluated and rejected."""
    from .time import time_document

    plans = []
    for entry in outcome.entries:
        plans.append({
            "job": entry.tables,
            "peak_gpu_bytes": entry.estimate.peak_gpu_bytes,
            "cpu_bytes_per_node": entry.estimate.cpu_bytes_per_node,
            "time": time_document(entry.timing, False),
            "offload": _offload_document(entry),
            "warnings": plan_warnings(entry),
        })
    result = outcome.result
    return {
        "plans": plans,
        "evaluated": result.evaluated,
        "fitting": result.fitting,
        "rejected": dict(result.rejected),
        "seconds": result.seconds,
        "world_size": outcome.world,
        "global_batch_size": outcome.global_batch,
        "offloaded": result.offloaded,
        "misses": [{"job_degrees": {"dp": m.inputs.degrees.dp, "tp": m.inputs.degrees.tp, "pp": m.inputs.degrees.pp,
                                    "cp": m.inputs.degrees.cp}, "zero_stage": m.inputs.zero_stage,
                    "hybrid": m.inputs.hybrid,
                    # A miss by its model states alone was measured for no recomputation or micro batch.
                    "activation_checkpointing": None if m.at_least else m.inputs.recompute,
                    "micro_batch_size": None if m.at_least else m.inputs.micro_batch,
                    "pipeline_schedule": None if m.at_least or m.inputs.degrees.pp == 1 else m.inputs.schedule,
                    "virtual_stages": None if m.at_least or m.inputs.degrees.pp == 1 else m.inputs.virtual,
                    "first_stage_layers": m.inputs.stage_split[0] or None,
                    "last_stage_layers": m.inputs.stage_split[1] or None,
                    "short_bytes": m.short_bytes, "at_least": bool(m.at_least), "reason": m.reason}
                   for m in outcome.closest()] if not plans else [],
        # What would make a plan fit, when none does: the `plan:` lines after the misses.
        "notes": list(outcome.notes),
    }
