"""How fast the time model answers, for the planner that calls it per candidate plan: the pure
core's `step_time` per plan, as a ratio of the memory figures of the same plans measured in
the same run (the planner's `plan_figures` and the explained `estimate_memory`), warm (caches
filled, as in a search that revisits shapes) and cold (every cache cleared before each plan).

Run: python benchmarks/bench_time.py [--seconds S]
Prints medians and ratios measured in this run; no thresholds are asserted.
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import time

from shardplan.core.collectives import spans_nodes
from shardplan.core.degrees import Degrees
from shardplan.core.estimate_inputs import EstimateInputs
from shardplan.core.layer_time import layer_costs
from shardplan.core.memory import estimate_memory, plan_figures
from shardplan.core.pipeline_time import _simulate_units
from shardplan.core.stage_time import edge_costs
from shardplan.core.step_time import step_time
from shardplan.io.hardware import hardware_of
from shardplan.io.job import load_job


def plans() -> list[EstimateInputs]:
    shape = load_job(None, [("model.preset", "llama-3-70b")], env={}).shape
    found = []
    for dp, tp, pp, stage, schedule, recompute in itertools.product(
            (1, 2, 4, 8, 16), (1, 2, 4, 8), (1, 2, 4, 8), (0, 1, 3), ("1f1b", "zero-bubble"), ("selective", "full")):
        found.append(EstimateInputs(shape=shape, params=None, degrees=Degrees(dp=dp, tp=tp, pp=pp), zero_stage=stage,
                                    seq_len=4096, num_microbatches=max(16, pp), schedule=schedule if pp > 1 else "1f1b",
                                    recompute=recompute, gpu_memory=80 * 2**30))
    return found


def per_call(function, items, seconds: float) -> float:
    """Median seconds of one call over rounds through `items`."""
    rounds, start = [], time.perf_counter()
    while time.perf_counter() - start < seconds or len(rounds) < 3:
        begin = time.perf_counter()
        for item in items:
            function(item)
        rounds.append((time.perf_counter() - begin) / len(items))
    return statistics.median(rounds)


def clear_caches() -> None:
    for cached in (layer_costs, _simulate_units, spans_nodes, edge_costs):
        cached.cache_clear()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    hardware = hardware_of(load_job(None, [("cluster.gpu", "h100-sxm")], env={}).job.cluster)
    items = plans()
    decided = [estimate_memory(p).inputs for p in items]  # what the planner passes on
    memory = per_call(estimate_memory, items, args.seconds)
    figures = per_call(plan_figures, decided, args.seconds)
    warm = per_call(lambda p: step_time(p, hardware), decided, args.seconds)

    def cold(plan):
        clear_caches()
        step_time(plan, hardware)

    cold_time = per_call(cold, decided[::8], args.seconds)
    print(f"{len(items)} distinct plans of llama-3-70b (dp, tp, pp, ZeRO stage, schedule, recompute)")
    print(f"estimate_memory per plan       median {memory * 1e6:8.1f} us  (baseline)")
    print(f"plan_figures per plan          median {figures * 1e6:8.1f} us  (baseline: the planner's memory path)")
    for label, seconds in (("warm", warm), ("cold", cold_time)):
        print(f"step_time per plan, {label}       median {seconds * 1e6:8.1f} us  ratio {seconds / memory:.2f}x "
              f"estimate_memory, {seconds / figures:.2f}x plan_figures")


if __name__ == "__main__":
    main()
