"""Run the validation plans of tests/test_run.py and print, as a Markdown table, how each
rank's measured bytes and losses compare with the estimate and the single-process reference.

Run: python benchmarks/validate_runs.py            (CPU/gloo here; CUDA/NCCL where GPUs exist)
The output is what docs/validation.md records, with the machine and the date.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from test_run import (  # noqa: E402  (the same plans the tests check)
    COMMON,
    MIXED_PLANS,
    PLANS,
    SEQUENCE_PARALLEL,
    gathered_inputs_bytes,
)


def run(model: str, mbs: int, m: int, flags: list[str], folder: Path, name: str) -> dict:
    job = folder / f"{name}.toml"
    job.write_text(f'[model]\npreset = "{model}"\n' + COMMON.format(mbs=mbs, m=m), encoding="utf-8")
    report = folder / f"{name}.json"
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "shardplan", "run", str(job), "--report", str(report), *flags],
                          capture_output=True, text=True, cwd=ROOT, env=env)
    if proc.returncode:
        raise SystemExit(f"{name} failed:\n{proc.stderr[-2000:]}")
    return json.loads(report.read_text())


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        references = {model: run(model, 8, 1, [], folder, f"ref-{model}") for model in ("tiny-gpt2", "tiny-llama")}
        print(f"Measured {date.today().isoformat()} on {platform.machine()} {platform.processor() or ''}"
              f" ({os.cpu_count()} cores), device {references['tiny-gpt2']['device']}, "
              f"torch {references['tiny-gpt2']['torch_version']}\n")
        print("| plan | ranks | params, grads, optimizer | saved activations (est / meas, worst rank) "
              "| max loss difference vs 1 process |")
        print("|---|---|---|---|---|")
        for plan in [*PLANS, *MIXED_PLANS, SEQUENCE_PARALLEL]:
            name, model, mbs, m, flags = plan
            report = run(model, mbs, m, flags, folder, name)
            exact = all(r["measured"][k] == r["estimated"][k] for r in report["ranks"]
                        for k in ("params", "grads", "optimizer"))
            # torch's sequence parallel keeps the gathered linear inputs the paper (the
            # estimate) divides by tp: the row adds them (docs/estimate.md).
            extra = gathered_inputs_bytes(model, mbs, 2) if plan == SEQUENCE_PARALLEL else 0
            worst = max(report["ranks"], key=lambda r: abs(r["measured"]["activations"] - r["estimated"]["activations"]
                                                           - extra) / r["measured"]["activations"])
            est, meas = worst["estimated"]["activations"], worst["measured"]["activations"]
            shown_est = f"{est:,} + {extra:,} gathered = {est + extra:,}" if extra else f"{est:,}"
            paper_gap = f"; estimate alone {(est - meas) / meas:+.2%}" if extra else ""
            est += extra
            reference = [s["loss"] for s in references[model]["steps"]]
            loss = max(abs(s["loss"] - r) / abs(r) for s, r in zip(report["steps"], reference))
            # Mixed precision is not compared with the fp32 reference's losses.
            shown = "(bf16: not compared)" if "bf16" in name else f"{loss:.1e}"
            print(f"| {name} | {report['world_size']} | {'equal to the byte' if exact else 'DIFFER'} "
                  f"| {shown_est} / {meas:,} ({(est - meas) / meas:+.2%}{paper_gap}) | {shown} |")


if __name__ == "__main__":
    main()
