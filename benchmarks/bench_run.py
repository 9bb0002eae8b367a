"""Step time of `shardplan run` against a hand-written FSDP2 loop on the same model and batch.

Both are launched on the same job, one after the other, alternating the order each round
(run, minimal / minimal, run / ...) so drift in the machine's load hits both alike:
- `python -m shardplan run JOB --report R.json` (starts torchrun itself), per-step seconds from
  the report's `steps[i].seconds`;
- `torchrun benchmarks/fsdp2_minimal.py JOB --out M.json`: the same model class, weights,
  batches, fully_shard per block + root, AdamW, and nothing else.

What is compared: the median over all rounds of the steps from `--skip` on (default 2). Step 1
is warm-up in both; step 2 of `shardplan run` is instrumented with saved-tensor hooks (its
activation measurement), so it is left out of both and reported on its own. Losses of the two
are compared too: they must agree, or the two did not train the same thing.

With one rank per core, any other process on the machine shows in step times. Each launch
records how many cores other processes kept busy meanwhile (/proc/stat less this run's own
children); rounds above NOISY_FOREIGN_CORES are flagged, and the ratio over the quiet rounds
alone is printed beside the one over all rounds.

The default job is an inline GPT-2-style model (written to a temporary file) sized for
~0.1-0.5 s per step with 2 CPU ranks; `--job` takes any job file or preset that
fsdp2_minimal.py mirrors (dp only, ZeRO 2/3, synthetic data). CPU/gloo or CUDA/NCCL, as
`shardplan run` picks; on CUDA the inline job uses min(2, GPUs) ranks.

usage: python benchmarks/bench_run.py [--job JOB] [--rounds 3] [--steps 12] [--skip 2] [--dp N]
           [--set section.key=value ...] [--out summary.json] [--logs DIR]
Prints medians and the ratio run / minimal measured in this run (target <= 1.05); no
thresholds are asserted, the exit status is 0 whenever both ran.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MINIMAL = ROOT / "benchmarks" / "fsdp2_minimal.py"
TARGET_RATIO = 1.05  # the target for run / minimal
# Rounds during which other processes used more than this many cores are flagged: with one
# rank per core, a quarter of a core taken by someone else already shows in step times.
NOISY_FOREIGN_CORES = 0.25
# fp32 on CPU gives identical losses; CUDA kernels may differ in the last bits run to run.
LOSS_TOLERANCE = 1e-3

# 4 layers x hidden 256, vocab 2048, seq 128, micro batch 4 per rank: about 0.25 s per step
# with 2 gloo ranks on a 2-core CPU, long enough that timer noise is small, short enough
# that per-step overheads of a few ms still show.
INLINE_JOB = """\
[model]
name = "bench-gpt2"
family = "gpt2"
num_layers = 4
hidden_size = 256
num_heads = 4
vocab_size = 2048
max_seq_len = 256

[parallel]
dp = {dp}
micro_batch_size = 4

[zero]
stage = 3

[train]
seq_len = 128
precision = "fp32"
steps = 12
lr = 1e-3

[cluster]
nodes = 1
gpus_per_node = {dp}
gpu_memory = "16GiB"
cpu_memory_per_node = "16GiB"
"""


def default_dp() -> int:
    """2 ranks; on CUDA no more than the GPUs there are (NCCL needs one GPU per rank)."""
    import torch

    return min(2, torch.cuda.device_count()) if torch.cuda.is_available() else 2


def job_world(job: str, sets: list[str]) -> int:
    sys.path.insert(0, str(ROOT))
    from shardplan.io.job import load_job
    from shardplan.io.overrides import parse_set

    return load_job(job, [parse_set(s) for s in sets]).world


def torchrun() -> list[str]:
    found = shutil.which("torchrun")
    return [found] if found else [sys.executable, "-m", "torch.distributed.run"]


def busy_cpu_seconds() -> float | None:
    """CPU seconds spent by every process on this machine since boot (Linux /proc/stat)."""
    try:
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    times = os.times()
    return times.children_user + times.children_system


def launch(kind: str, job: str, sets: list[str], world: int, out: Path, log: Path,
           minimal_args: list[str]) -> tuple[float, float | None]:
    """Run one launch to completion; returns its wall-clock seconds and the CPU cores that
    other processes kept busy meanwhile (None where /proc/stat is missing)."""
    set_args = [arg for s in sets for arg in ("--set", s)]
    if kind == "run":
        command = [sys.executable, "-m", "shardplan", "run", job, *set_args, "--report", str(out)]
    else:
        command = [*torchrun(), "--standalone", f"--nproc_per_node={world}", str(MINIMAL), job,
                   *set_args, "--out", str(out), *minimal_args]
    sys.path.insert(0, str(ROOT))
    from shardplan.cli.run_cmd import threads_per_worker

    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(threads_per_worker(world)))  # what `shardplan run` gives its workers
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out.unlink(missing_ok=True)  # a report left by an earlier run in --logs must not count
    busy, ours = busy_cpu_seconds(), children_cpu_seconds()
    start = time.perf_counter()
    with log.open("w") as handle:
        code = subprocess.run(command, cwd=ROOT, env=env, stdout=handle, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if code and not out.exists():
        sys.exit(f"{kind} failed with exit status {code}; its output:\n{log.read_text()[-4000:]}")
    if code:  # the report is written after the last step: the failure came in teardown
        lines = log.read_text().splitlines()
        cause = next((line for line in lines if "terminate called" in line or "Error" in line), "see --logs")
        print(f"  note: {kind} exited with status {code} after writing its report ({cause.strip()[:100]})",
              file=sys.stderr)
    after = busy_cpu_seconds()
    if busy is None or after is None:
        return wall, None
    foreign = (after - busy) - (children_cpu_seconds() - ours)
    return wall, max(0.0, foreign / wall)


def steps_of(path: Path) -> tuple[list[float], list[float], str, str]:
    report = json.loads(path.read_text())
    return ([s["seconds"] for s in report["steps"]], [s["loss"] for s in report["steps"]], report["device"],
            report["torch_version"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", help="job file or preset (default: the inline bench-gpt2 job)")
    parser.add_argument("--rounds", type=int, default=3, help="launches of each, alternating")
    parser.add_argument("--steps", type=int, default=12, help="train.steps of every launch")
    parser.add_argument("--skip", type=int, default=2, help="leading steps left out (warm-up, instrumented)")
    parser.add_argument("--dp", type=int, help="parallel.dp (default: the job's; inline job: 2, or the GPUs)")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="more job overrides")
    parser.add_argument("--out", help="write the summary and every step time as JSON here")
    parser.add_argument("--logs", help="keep every launch's output and report in this folder")
    parser.add_argument("--minimal-prefetch", type=int, default=0,
                        help="diagnosis: give the minimal loop explicit prefetch of N blocks, as "
                             "`shardplan run` sets from offload.prefetch_layers (default 0: FSDP2's own)")
    args = parser.parse_args()
    if args.steps <= args.skip:
        parser.error(f"--steps {args.steps} leaves no step after --skip {args.skip}")

    launches = {"run": [], "minimal": []}
    with tempfile.TemporaryDirectory(prefix="bench_run_") as tmp:
        tmpdir = Path(args.logs or tmp)
        tmpdir.mkdir(parents=True, exist_ok=True)
        job, dp = args.job, args.dp
        if job is None:
            dp = dp or default_dp()
            job = str(tmpdir / "bench-gpt2.toml")
            Path(job).write_text(INLINE_JOB.format(dp=dp), encoding="utf-8")
        sets = [f"train.steps={args.steps}", *([f"parallel.dp={dp}"] if dp else []), *args.sets]
        world = job_world(job, sets)
        name = args.job or "bench-gpt2 (inline)"
        print(f"{name}: {world} ranks, {args.rounds} rounds x {args.steps} steps", file=sys.stderr)
        for round_index in range(args.rounds):
            order = ("run", "minimal") if round_index % 2 == 0 else ("minimal", "run")
            for kind in order:
                out = tmpdir / f"{kind}-{round_index}.json"
                wall, foreign = launch(kind, job, sets, world, out, tmpdir / f"{kind}-{round_index}.log",
                                       [f"--prefetch={args.minimal_prefetch}"] if args.minimal_prefetch else [])
                seconds, loss, device, torch_version = steps_of(out)
                launches[kind].append({"seconds": seconds, "loss": loss, "wall": wall, "foreign_cores": foreign,
                                       "device": device})
                busy = "" if foreign is None else f", other processes busy {foreign:.2f} cores"
                print(f"  round {round_index + 1} {kind:8s} median {statistics.median(seconds[args.skip:]):.4f} s/step "
                      f"({wall:.1f} s launch{busy})", file=sys.stderr)

    summary = summarize(launches, args.skip)
    summary.update(job=name, world=world, device=launches["run"][0]["device"], rounds=args.rounds,
                   steps=args.steps, skip=args.skip, minimal_prefetch=args.minimal_prefetch,
                   machine=f"{os.cpu_count()} CPU cores, torch {torch_version}", launches=launches)
    report(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2) + "\n", encoding="utf-8")


def quiet(one: dict) -> bool:
    return (one["foreign_cores"] or 0.0) <= NOISY_FOREIGN_CORES


def pooled_ratio(launches: dict[str, list[dict]], skip: int, rounds: list[int]) -> tuple[dict, float]:
    """Medians of the steps from `skip` on of the given rounds, and their ratio run / minimal."""
    steady = {k: [s for i in rounds for s in v[i]["seconds"][skip:]] for k, v in launches.items()}
    medians = {k: statistics.median(v) for k, v in steady.items()}
    return medians, medians["run"] / medians["minimal"]


def summarize(launches: dict[str, list[dict]], skip: int) -> dict:
    steady = {k: [s for one in v for s in one["seconds"][skip:]] for k, v in launches.items()}
    medians = {k: statistics.median(v) for k, v in steady.items()}
    quiet_rounds = [i for i, pair in enumerate(zip(launches["run"], launches["minimal"])) if all(map(quiet, pair))]
    per_round = [statistics.median(r["seconds"][skip:]) / statistics.median(m["seconds"][skip:])
                 for r, m in zip(launches["run"], launches["minimal"])]
    summary = {
        "median_seconds": medians,
        "quartiles_seconds": {k: statistics.quantiles(v, n=4) if len(v) > 1 else [v[0]] * 3 for k, v in steady.items()},
        "ratio": medians["run"] / medians["minimal"],
        "ratio_per_round": per_round,
        "max_loss_difference": max(abs(a - b) for r, m in zip(launches["run"], launches["minimal"])
                                   for a, b in zip(r["loss"], m["loss"])),
        "median_wall_seconds": {k: statistics.median(one["wall"] for one in v) for k, v in launches.items()},
        "noisy_rounds": [i + 1 for i in range(len(per_round)) if i not in quiet_rounds],
    }
    if quiet_rounds and len(quiet_rounds) < len(per_round):
        medians_quiet, ratio_quiet = pooled_ratio(launches, skip, quiet_rounds)
        summary["quiet"] = {"rounds": [i + 1 for i in quiet_rounds], "median_seconds": medians_quiet,
                            "ratio": ratio_quiet}
    if skip >= 2:  # step 2 of `shardplan run` carries the saved-tensor hooks
        summary["step2_median_seconds"] = {k: statistics.median(one["seconds"][1] for one in v)
                                           for k, v in launches.items()}
    return summary


def report(s: dict) -> None:
    med, q = s["median_seconds"], s["quartiles_seconds"]
    n = s["rounds"] * (s["steps"] - s["skip"])
    print(f"{s['job']} on {s['world']} {s['device']} ranks ({s['machine']}): {s['rounds']} launches each, "
          f"steps {s['skip'] + 1}-{s['steps']} of each ({n} steps per side)")
    if s["minimal_prefetch"]:
        print(f"  (minimal loop with explicit prefetch of {s['minimal_prefetch']} blocks)")
    for kind, label in (("run", "shardplan run"), ("minimal", "fsdp2_minimal.py")):
        print(f"  {label:17s} median {med[kind]:.4f} s/step  (quartiles {q[kind][0]:.4f} .. {q[kind][2]:.4f})")
    met = "meets" if s["ratio"] <= TARGET_RATIO else "above"
    rounds = ", ".join(f"{r:.3f}" for r in s["ratio_per_round"])
    print(f"  ratio run / minimal {s['ratio']:.3f}  ({met} the target {TARGET_RATIO}); per round: {rounds}")
    if "step2_median_seconds" in s:
        step2 = s["step2_median_seconds"]
        print(f"  step 2, run's saved-tensor hooks on (not compared): {step2['run']:.4f} s vs {step2['minimal']:.4f} s "
              f"(ratio {step2['run'] / step2['minimal']:.2f})")
    walls = s["median_wall_seconds"]
    print(f"  whole launch (start-up, report included): median {walls['run']:.1f} s vs {walls['minimal']:.1f} s")
    same = "the same training" if s["max_loss_difference"] < LOSS_TOLERANCE else "LOSSES DIFFER: not the same training"
    print(f"  max |loss run - loss minimal| over all steps {s['max_loss_difference']:.1e} ({same})")
    if s["noisy_rounds"]:
        print(f"  warning: other processes kept more than {NOISY_FOREIGN_CORES} cores busy in round(s) "
              f"{', '.join(map(str, s['noisy_rounds']))}; these timings share the CPU with them")
    if "quiet" in s:
        qm = s["quiet"]["median_seconds"]
        print(f"  quiet rounds only ({', '.join(map(str, s['quiet']['rounds']))}): run {qm['run']:.4f} s/step, "
              f"minimal {qm['minimal']:.4f} s/step, ratio {s['quiet']['ratio']:.3f}")


if __name__ == "__main__":
    main()
