"""How fast `shardplan plan` answers, end to end and inside the search.

1. The whole command (a fresh process, as a user types it, its bytecode compiled as pip
   installs it) for four searches: Llama-3 8B on 8 H100s, Llama-3 70B on 64 A100s (8 nodes),
   Llama-3.1 405B on 2048 H100s and 70B on 16 A100s (offload), each as a ratio of
   `shardplan validate` on the same job measured in the same run (start-up and loading the
   job, which every planning command pays).
2. The search alone (in process), branch and bound against the same search with no bound
   (every structurally valid plan that fits is timed): the ratio is what the bound saves.

Run: python benchmarks/bench_plan.py [--repeat N] [--skip-exhaustive]
Prints medians and ratios measured in this run; no thresholds are asserted.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

CASES = {
    "llama-3-8b, 8 x H100, seq 8192, batch 64": ("llama-3-8b", "h100-80gb", 8192, 8, 64),
    "llama-3-70b, 64 x A100 80GB, seq 4096, batch 512": ("llama-3-70b", "a100-80gb", 4096, 64, 512),
    "llama-3.1-405b, 2048 x H100, seq 8192, batch 2048": ("llama-3.1-405b", "h100-80gb", 8192, 2048, 2048),
    "llama-3-70b, 16 x A100 80GB, seq 4096, batch 64 (needs offload)": ("llama-3-70b", "a100-80gb", 4096, 16, 64),
}


def job_text(model: str, cluster: str, seq: int) -> str:
    return f'[model]\npreset = "{model}"\n[train]\nseq_len = {seq}\n[cluster]\npreset = "{cluster}"\n'


def wall(args: list[str], repeat: int) -> float:
    """Median seconds of a fresh process, after one untimed run that writes the package's
    bytecode (an installed package has it: pip compiles on install). Where the environment
    forbids writing bytecode (PYTHONDONTWRITEBYTECODE), every process of a source checkout
    recompiles shardplan's modules, about 0.13 s more on a 2-core machine."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    subprocess.run([sys.executable, "-m", "shardplan", *args], check=True, capture_output=True, env=env)
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "shardplan", *args], check=True, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def in_process(path: str, gpus: int, batch: int, bounded: bool) -> tuple[float, int, int]:
    """(search seconds, plans evaluated, plans timed) of one search in this process."""
    from shardplan.core import search as search_module
    from shardplan.io.job import load_job
    from shardplan.io.plan_search import run_plan_search

    resolved = load_job(path, [], env={})
    original = search_module.search
    if not bounded:
        def unbounded(*args, **kwargs):
            kwargs.update(bound=None, refine=None)
            return original(*args, **kwargs)

        from shardplan.io import plan_search
        plan_search.search = unbounded
    try:
        outcome = run_plan_search(resolved, gpus=gpus, nodes=None, global_batch=batch, top=5, progress=False)
    finally:
        from shardplan.io import plan_search
        plan_search.search = original
    return outcome.result.seconds, outcome.result.evaluated, outcome.result.fitting


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--skip-exhaustive", action="store_true", help="leave out the unbounded searches")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        print("whole command (median wall seconds of a fresh process; ratio to `validate` of the same job)")
        for name, (model, cluster, seq, gpus, batch) in CASES.items():
            path = str(Path(folder) / f"{model}-{gpus}.toml")
            Path(path).write_text(job_text(model, cluster, seq))
            base = wall(["validate", path], args.repeat)
            plan = wall(["plan", path, "--gpus", str(gpus), "--global-batch", str(batch)], args.repeat)
            print(f"  {name}: plan {plan:.3f} s, validate {base:.3f} s, ratio {plan / base:.2f}x")
        print("search alone (in process): branch and bound against no bound")
        for name, (model, cluster, seq, gpus, batch) in CASES.items():
            path = str(Path(folder) / f"{model}-{gpus}.toml")
            seconds, evaluated, timed = in_process(path, gpus, batch, True)
            line = f"  {name}: {seconds:.2f} s, {evaluated:,} plans, {timed:,} timed"
            if not args.skip_exhaustive:
                full, _, full_timed = in_process(path, gpus, batch, False)
                line += f"; no bound {full:.2f} s, {full_timed:,} timed: the bound is {full / seconds:.1f}x faster"
            print(line)


if __name__ == "__main__":
    main()
