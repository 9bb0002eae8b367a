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

from published_plans import table_1_plans, table_1_row  # noqa: E402  (the same search the test runs)
from time_references import narayanan_table_1  # noqa: E402


def main() -> None:
    print("| row | published tp x pp | best found | step s | best with the published split | step s | ratio |")
    print("|---|---|---|---:|---|---:|---:|")
    met = 0
    for run in narayanan_table_1():
        row, kept = table_1_row(run, *table_1_plans(run))
        met += kept
        print(row)
    print(f"\nthe published split in the top 5 or within 5% of the best: {met} of 10 rows")


if __name__ == "__main__":
    main()
