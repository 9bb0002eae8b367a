"""Time `shardplan layout --dp 64 --tp 8 --pp 32 --json` (16,384 ranks) as a whole process.

It is compared with `python -c pass` (the interpreter's own start-up) on the same machine:
both medians, their ratio, and whether the layout meets its target of 1 s. The JSON goes to
a file, as a user would redirect it, and is checked once for completeness.

usage: python benchmarks/bench_layout.py [--repeats N]
Exit status: 0 when the median meets the target, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUT = ["-m", "shardplan", "layout", "--dp", "64", "--tp", "8", "--pp", "32", "--json"]
# The same command on one rank: the CLI's fixed start-up cost (imports, job loading).
ONE_RANK = ["-m", "shardplan", "layout", "--json"]
WORLD = 64 * 8 * 32
TARGET_SECONDS = 1.0


def timed(args: list[str], out_path: str, env: dict) -> float:
    with open(out_path, "wb") as out:
        start = time.perf_counter()
        subprocess.run([sys.executable, *args], stdout=out, stderr=subprocess.DEVNULL, env=env, cwd=ROOT, check=True)
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="runs of each command (median reported)")
    args = parser.parse_args()
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "layout.json")
        timed(LAYOUT, out_path, env)  # warm the file cache and bytecode once
        document = json.loads(Path(out_path).read_text())
        assert document["world_size"] == WORLD and len(document["ranks"]) == WORLD, "incomplete layout"
        size_mib = os.path.getsize(out_path) / 2**20
        baseline = [timed(["-c", "pass"], os.devnull, env) for _ in range(args.repeats)]
        one_rank = [timed(ONE_RANK, os.devnull, env) for _ in range(args.repeats)]
        layout = [timed(LAYOUT, out_path, env) for _ in range(args.repeats)]
    base, small, full = (statistics.median(t) for t in (baseline, one_rank, layout))

    def runs(times: list[float]) -> str:
        return ", ".join(f"{t:.3f}" for t in times)

    print(f"python -c pass:                           median {base:.3f} s  (runs: {runs(baseline)})")
    print(f"shardplan layout --json (1 rank):         median {small:.3f} s  (runs: {runs(one_rank)})")
    print(f"shardplan layout --dp 64 --tp 8 --pp 32:  median {full:.3f} s  (runs: {runs(layout)})")
    print(f"ratio layout / python: {full / base:.1f}x; the 16,384 ranks add {full - small:.3f} s to the "
          f"CLI's start-up; JSON {size_mib:.1f} MiB")
    met = full < TARGET_SECONDS
    print(f"target < {TARGET_SECONDS:.1f} s: {'met' if met else 'MISSED'}")
    return 0 if met else 1


if __name__ == "__main__":
    sys.exit(main())
