"""Start-up of the planning commands, whole process, as ratios against importing the CLI's
libraries (`python -c "import typer, rich, pydantic"`) measured in the same run.

Two reference points beside the baseline: the bare interpreter, and the smallest typer
program with one command and three typed options (typer builds a pydantic TypeAdapter per
parameter, so every typer command pays for pydantic's models, which `import pydantic`
alone defers). `--compare DIR` times another checkout of shardplan in the same run (e.g. a
clone of the previous release), so before/after ratios share one baseline.

usage: python benchmarks/bench_startup.py [--repeats N] [--compare DIR] [--tty]
Prints medians and ratios (each against the baseline of its own round); no thresholds are
asserted. `--tty` also times `estimate` with
stdout on a pseudo-terminal (styled output through rich).
"""

from __future__ import annotations

import argparse
import os
import pty
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ["-c", "import typer, rich, pydantic"]
# The smallest typer program with a command and typed options, run once.
TYPER_MINIMUM = """
from typing import Annotated, Optional
import typer
app = typer.Typer(add_completion=False)
@app.command()
def hello(name: Annotated[Optional[str], typer.Argument()] = None,
          count: Annotated[int, typer.Option("--count")] = 1,
          json_out: Annotated[bool, typer.Option("--json")] = False) -> None:
    print(name, count, json_out)
@app.callback()
def root() -> None:
    pass
app(["hello", "x", "--count", "3"], standalone_mode=False)
"""
COMMANDS = [
    ["--version"],
    ["validate", "llama-3-8b-h100"],
    ["layout", "--dp", "2", "--tp", "4", "--pp", "2"],
    ["shards", "--numel", "1000", "--world", "3"],
    ["estimate", "llama-3-8b-h100"],
    ["estimate", "llama-3-8b-h100", "--json"],
    ["schedule", "--pp", "4", "--microbatches", "8", "--schedule", "1f1b"],
    ["presets"],
    ["schema"],
    ["--help"],
]


def timed(args: list[str], env: dict, tty: bool = False) -> float:
    """Seconds for one whole process in the checkout `env` names (`python -m` puts the
    working directory first on sys.path); stdout to /dev/null, or to a pseudo-terminal."""
    cwd = env["PYTHONPATH"]
    if tty:
        leader, follower = pty.openpty()
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, *args], stdout=follower, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
        os.close(follower)
        while True:  # drain the terminal so the child never blocks on a full buffer
            try:
                if not os.read(leader, 65536):
                    break
            except OSError:
                break
        proc.wait()
        elapsed = time.perf_counter() - start
        os.close(leader)
        return elapsed
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                   cwd=cwd, check=False)
    return time.perf_counter() - start


def environment(checkout: Path) -> dict:
    env = dict(os.environ, PYTHONPATH=str(checkout))
    for name in ("WORLD_SIZE", "SHARDPLAN_DEBUG", "COLUMNS", "FORCE_COLOR"):
        env.pop(name, None)
    return env


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=9, help="rounds (medians reported)")
    parser.add_argument("--compare", type=Path, help="another shardplan checkout to time in the same run")
    parser.add_argument("--tty", action="store_true", help="also time estimate on a pseudo-terminal")
    args = parser.parse_args()
    checkouts = [("this checkout", ROOT)] + ([("compared", args.compare.resolve())] if args.compare else [])
    # Every measurement of a round runs back to back with its own baseline, and each ratio is
    # taken within its round: load from other processes that drifts over the run cancels.
    cases = [("baseline", BASELINE, ROOT, False), ("bare", ["-c", "pass"], ROOT, False),
             ("typer", ["-c", TYPER_MINIMUM], ROOT, False)]
    for name, checkout in checkouts:
        for command in COMMANDS:
            cases.append(((name, " ".join(command)), ["-m", "shardplan", *command], checkout, False))
        if args.tty:
            cases.append(((name, "estimate llama-3-8b-h100 (on a terminal)"),
                          ["-m", "shardplan", "estimate", "llama-3-8b-h100"], checkout, True))
    for _, argv, checkout, tty in cases:  # bytecode and file cache warm
        timed(argv, environment(checkout), tty)
    seconds: dict[object, list[float]] = {key: [] for key, *_ in cases}
    ratios: dict[object, list[float]] = {key: [] for key, *_ in cases}
    for _ in range(args.repeats):
        round_times = {key: timed(argv, environment(checkout), tty) for key, argv, checkout, tty in cases}
        for key, value in round_times.items():
            seconds[key].append(value)
            ratios[key].append(value / round_times["baseline"])

    def cell(key) -> str:
        return f"{statistics.median(seconds[key]) * 1000:7.1f} ms {statistics.median(ratios[key]):5.2f}x"

    print(f"baseline python -c 'import typer, rich, pydantic': {cell('baseline')}")
    print(f"python -c pass:                                    {cell('bare')}")
    print(f"smallest typer command (3 typed options):          {cell('typer')}")
    labels = [" ".join(c) for c in COMMANDS] + (["estimate llama-3-8b-h100 (on a terminal)"] if args.tty else [])
    header = "".join(f"  {name:>20}" for name, _ in checkouts)
    print(f"\n{'shardplan ...':52}{header}   (median ms, median ratio to its round's baseline)")
    for label in labels:
        print(f"{label:52}" + "".join(f"  {cell((name, label)):>20}" for name, _ in checkouts))


if __name__ == "__main__":
    main()
