"""Step time of each offload mode as a ratio to the same plan without offload, measured in the
same torchrun launch (tests/dist/run_many.py), and on a GPU the copy time not hidden behind
compute. tiny-gpt2 by default (CPU/gloo); `--model gpt2 --seq 512 --precision bf16-mixed` on
a GPU.

Run: python benchmarks/bench_offload.py [--model M] [--seq S] [--precision P] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

JOB = """
[model]
preset = "{model}"
[parallel]
dp = 2
micro_batch_size = 4
[zero]
stage = {stage}
[train]
seq_len = {seq}
precision = "{precision}"
steps = {steps}
[offload]
{offload}
"""
MODES = {
    "none": "",
    "optimizer": "optimizer = true",
    "grads + optimizer": "optimizer = true\ngrads = true",
    "grads + optimizer, bf16": 'optimizer = true\ngrads = true\ncpu_compression = "bf16"',
    "grads + optimizer, int8": 'optimizer = true\ngrads = true\ncpu_compression = "int8"',
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="tiny-gpt2")
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--stage", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        plan = []
        for index, (name, offload) in enumerate(MODES.items()):
            job = tmp / f"{index}.toml"
            job.write_text(JOB.format(model=args.model, stage=args.stage, seq=args.seq, precision=args.precision,
                                      steps=args.steps, offload=offload), encoding="utf-8")
            plan.append({"job": str(job), "report": str(tmp / f"{index}.json")})
        (tmp / "plan.json").write_text(json.dumps(plan), encoding="utf-8")
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        subprocess.run(["torchrun", "--nproc_per_node", "2", str(ROOT / "tests" / "dist" / "run_many.py"),
                        str(tmp / "plan.json")], check=True, cwd=ROOT, env=env, capture_output=True)
        reports = [json.loads(Path(item["report"]).read_text()) for item in plan]
    base = reports[0]["step_seconds"]
    print(f"{args.model}, dp 2, ZeRO {args.stage}, seq {args.seq}, {args.precision}; {reports[0]['device']}, "
          f"{platform.machine()}, {date.today()}")
    print("| mode | step time / no offload | exposed copy s/step (slowest rank) |")
    print("|---|---|---|")
    for name, report in zip(MODES, reports):
        exposed = [r.get("exposed_copy_seconds") for r in report["ranks"]]
        copy = "n/a (CPU)" if exposed[0] is None else f"{max(exposed) / len(report['steps']):.4f}"
        print(f"| {name} | {report['step_seconds'] / base:.2f} | {copy} |")


if __name__ == "__main__":
    main()
