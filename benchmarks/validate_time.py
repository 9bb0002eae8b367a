"""Print, as Markdown tables, the time model's predictions for the published runs of
tests/time_references.py against what the papers measured (docs/time.md records the output).

Run: python benchmarks/validate_time.py [--fit]
--fit also repeats the grid search that chose the default matmul, memory and NVLink
efficiencies (core/hardware.py): over all rows, and over each paper alone predicting the other.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from time_references import (  # noqa: E402  (the same runs the tests check)
    A100_80GB, BLOOM_SECONDS, JEAN_ZAY_A100, NARAYANAN_TABLE_1, NARAYANAN_TABLE_2, TORCHTITAN_FSDP_TOKENS_PER_GPU,
    TORCHTITAN_H100, bloom_176b, korthikanti_table_5, narayanan_table_1, narayanan_table_2, torchtitan_fsdp,
)

from shardplan.core.hardware import TimeConstants  # noqa: E402
from shardplan.core.step_time import step_time  # noqa: E402


def errors(runs, hardware=A100_80GB) -> list[float]:
    return [step_time(run.inputs, hardware, run.constants).step_seconds / run.measured_seconds - 1 for run in runs]


def seconds_table(title: str, runs) -> None:
    print(f"\n{title}\n")
    print("| run | measured s | predicted s | error | bottleneck |")
    print("|---|---:|---:|---:|---|")
    found = []
    for run in runs:
        timing = step_time(run.inputs, A100_80GB, run.constants)
        error = timing.step_seconds / run.measured_seconds - 1
        found.append(abs(error))
        print(f"| {run.name} | {run.measured_seconds:.2f} | {timing.step_seconds:.2f} | {error:+.1%} | {timing.bottleneck} |")
    print(f"| **mean absolute error** | | | **{sum(found) / len(found):.1%}** | max {max(found):.1%} |")


def tflops_table() -> None:
    print("\nNarayanan et al. 2021, Table 1 (teraFLOP/s per GPU, their FLOPs count)\n")
    print("| model | GPUs | TP x PP | measured | predicted | error |")
    print("|---|---:|---|---:|---:|---:|")
    for row, run in zip(NARAYANAN_TABLE_1, narayanan_table_1()):
        name, _, hidden, layers, tp, pp, gpus, batch, tflops = row[:9]
        predicted = run.measured_seconds * tflops / step_time(run.inputs, A100_80GB, run.constants).step_seconds
        print(f"| {name} | {gpus} | {tp} x {pp} | {tflops} | {predicted:.0f} | {predicted / tflops - 1:+.1%} |")


def ranking_table() -> None:
    print("\nNarayanan et al. 2021, Table 2 (teraFLOP/s per GPU)\n")
    print("| model | scheme | GPUs | measured | predicted | error |")
    print("|---|---|---:|---:|---:|---:|")
    for row, run in zip(NARAYANAN_TABLE_2, narayanan_table_2()):
        model, _, _, _, scheme, gpus, _, _, tflops = row
        predicted = run.measured_seconds * tflops / step_time(run.inputs, A100_80GB, run.constants).step_seconds
        print(f"| {model} | {scheme} | {gpus} | {tflops} | {predicted:.0f} | {predicted / tflops - 1:+.1%} |")


def torchtitan_ratio(constants: TimeConstants = TimeConstants()) -> tuple[float, float]:
    """(predicted, measured) tokens/s per GPU on 128 GPUs over 8, torchtitan's FSDP2 runs."""
    tokens = {gpus: 1 / step_time(torchtitan_fsdp(gpus), TORCHTITAN_H100, constants).step_seconds
              for gpus in TORCHTITAN_FSDP_TOKENS_PER_GPU}
    return tokens[128] / tokens[8], TORCHTITAN_FSDP_TOKENS_PER_GPU[128] / TORCHTITAN_FSDP_TOKENS_PER_GPU[8]


def scaling_table() -> None:
    print("\ntorchtitan Llama 3.1 8B, FSDP2, Tables 1 and 3 (tokens/s per GPU, 128 GPUs over 8)\n")
    print("| | measured | predicted | error |")
    print("|---|---:|---:|---:|")
    predicted, measured = torchtitan_ratio()
    print(f"| 128 / 8 GPUs | {measured:.3f} | {predicted:.3f} | {predicted / measured - 1:+.1%} |")


def held_out_table() -> None:
    """Runs the constants were not fitted on."""
    print("\nHeld out: BLOOM-176B, Megatron-DeepSpeed on Jean Zay (iteration seconds)\n")
    print("| run | measured s | predicted s | error | bottleneck |")
    print("|---|---:|---:|---:|---|")
    timing = step_time(bloom_176b(), JEAN_ZAY_A100, TimeConstants(overlap_grad_reduce=False))
    error = timing.step_seconds / BLOOM_SECONDS - 1
    print(f"| 176B, 384 GPUs, tp 4 x pp 12 | {BLOOM_SECONDS:.2f} | {timing.step_seconds:.2f} | {error:+.1%} | "
          f"{timing.bottleneck} |")


def fit_overlap() -> None:
    """`overlap_efficiency` over the runs whose sharded data parallelism overlaps its
    collectives: Table 2's six ZeRO-3 runs and torchtitan's FSDP2 scaling ratio, together."""
    zero3 = [run for run in narayanan_table_2() if "ZeRO-3" in run.name]
    print("\n| overlap_efficiency | ZeRO-3 mean (max) | torchtitan ratio | all seven, mean |")
    print("|---:|---:|---:|---:|")
    for efficiency in (0.5, 0.6, 0.7, 0.8, 0.85, 0.9, 1.0):
        rows = [abs(step_time(run.inputs, A100_80GB, dataclasses.replace(run.constants, overlap_efficiency=efficiency))
                    .step_seconds / run.measured_seconds - 1) for run in zero3]
        predicted, measured = torchtitan_ratio(TimeConstants(overlap_efficiency=efficiency))
        ratio = predicted / measured - 1
        print(f"| {efficiency} | {sum(rows) / len(rows):.1%} ({max(rows):.1%}) | {ratio:+.1%} | "
              f"{(sum(rows) + abs(ratio)) / (len(rows) + 1):.1%} |")


def fit() -> None:
    """The grid that chose the defaults (the optimum is flat; the defaults are its rounded centre)."""
    table_1, table_5 = narayanan_table_1(), korthikanti_table_5()
    grid = [(m, e, n) for m in (0.68, 0.70, 0.72, 0.74, 0.76, 0.78) for e in (0.55, 0.6, 0.65, 0.7, 0.75, 0.8)
            for n in (0.65, 0.75, 0.85)]
    mean = lambda values: sum(map(abs, values)) / len(values)
    scores = {}
    for matmul, memory, nvlink in grid:
        hardware = dataclasses.replace(A100_80GB, matmul_efficiency=matmul, memory_efficiency=memory,
                                       intra_node_efficiency=nvlink)
        scores[(matmul, memory, nvlink)] = (errors(table_1, hardware), errors(table_5, hardware))
    both = min(grid, key=lambda g: mean(scores[g][0] + scores[g][1]))
    only_1 = min(grid, key=lambda g: mean(scores[g][0]))
    only_5 = min(grid, key=lambda g: mean(scores[g][1]))
    print("\n| fitted on | matmul, memory, NVLink | Table 1 mean | Table 5 mean |")
    print("|---|---|---:|---:|")
    for label, g in (("both papers", both), ("Table 1 only", only_1), ("Table 5 only", only_5)):
        print(f"| {label} | {g} | {mean(scores[g][0]):.1%} | {mean(scores[g][1]):.1%} |")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--fit", action="store_true")
    args = parser.parse_args()
    seconds_table("Narayanan et al. 2021, Table 1 (iteration seconds)", narayanan_table_1())
    tflops_table()
    seconds_table("Korthikanti et al. 2022, Table 5 (iteration seconds)", korthikanti_table_5())
    ranking_table()
    scaling_table()
    held_out_table()
    if args.fit:
        fit()
        fit_overlap()


if __name__ == "__main__":
    main()
