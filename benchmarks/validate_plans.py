"""Print, as a Markdown table, what the search finds for each row of Narayanan et al. 2021
Table 1 in the space Megatron-LM had then, against the published tensor x pipeline split
(docs/plan.md, "Held against published plans", records the output; tests/test_plan.py holds it).

Run: python benchmarks/validate_plans.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from published_plans import table_1_plans  # noqa: E402  (the same search the test runs)
from time_references import narayanan_table_1  # noqa: E402


def describe(plan) -> str:
    i = plan.inputs
    schedule = f"{i.schedule} v{i.virtual}" if i.virtual > 1 else i.schedule
    return f"{i.degrees.tp} x {i.degrees.pp}, {schedule}, micro batch {i.micro_batch}"


def main() -> None:
    print("| row | published tp x pp | best found | step s | best with the published split | step s | ratio |")
    print("|---|---|---|---:|---|---:|---:|")
    met = 0
    for run in narayanan_table_1():
        base, best, same = table_1_plans(run)
        d = base.degrees
        in_top = any((p.inputs.degrees.tp, p.inputs.degrees.pp) == (d.tp, d.pp) for p in best)
        ratio = same[0].seconds / best[0].seconds
        met += in_top or ratio <= 1.05
        note = " (in the top 5)" if in_top and ratio > 1.05 else ""
        print(f"| {run.name}, {run.gpus} GPUs | {d.tp} x {d.pp} | {describe(best[0])} | {best[0].seconds:.2f} "
              f"| {describe(same[0])} | {same[0].seconds:.2f} | {ratio:.3f}{note} |")
    print(f"\nthe published split in the top 5 or within 5% of the best: {met} of 10 rows")


if __name__ == "__main__":
    main()
