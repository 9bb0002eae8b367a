"""How fast `estimate` answers: a whole process on a preset against `python -c pass`, and the
pure core's estimates per second (the planner search will call it in a loop).

Run: python benchmarks/bench_estimate.py [--repeats N]
Prints medians and ratios measured in this run; no thresholds are asserted.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time


def wall(command: list[str], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def core_rate(seconds: float) -> tuple[float, int]:
    from shardplan.core.degrees import Degrees
    from shardplan.core.estimate_inputs import EstimateInputs
    from shardplan.core.memory import estimate_memory
    from shardplan.io.job import load_job

    shape = load_job(None, [("model.preset", "llama-3-70b")], env={}).shape
    plans = [
        (Degrees(dp=dp, tp=tp, pp=pp), stage)
        for dp in (1, 2, 4, 8, 16) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) for stage in (0, 1, 2, 3)
    ]
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        degrees, stage = plans[count % len(plans)]
        inputs = EstimateInputs(shape=shape, params=None, degrees=degrees, zero_stage=stage,
                                seq_len=4096, num_microbatches=16, gpu_memory=80 * 2**30)
        estimate_memory(inputs)
        count += 1
    elapsed = time.perf_counter() - start
    return count / elapsed, len(plans)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    baseline = wall([sys.executable, "-c", "pass"], args.repeats)
    estimate = wall([sys.executable, "-m", "shardplan", "estimate", "llama-3-8b-h100", "--json"], args.repeats)
    print(f"python -c pass                              median {baseline * 1000:7.1f} ms")
    print(f"shardplan estimate llama-3-8b-h100 --json   median {estimate * 1000:7.1f} ms "
          f"(ratio {estimate / baseline:.1f}x the bare interpreter; {estimate - baseline:.3f} s of work)")
    rate, distinct = core_rate(3.0)
    print(f"core estimate_memory, llama-3-70b, {distinct} distinct plans: {rate:,.0f} estimates/s")


if __name__ == "__main__":
    main()
