"""The estimate and the time model against `shardplan run` on one CUDA GPU.

A ladder of GPT-2 sizes (tiny, 124M, 355M, 774M, 1.56B), bf16-mixed with AdamW, one rank,
sequences of 1,024 tokens (256 for the tiny model), micro batches chosen so the estimated peak fills the GPU from about
10% to 90%; activation recomputation none / selective / full; optimizer offload and parameter
offload. For each run it records, beside the estimate of the same job file:

- the allocator's peak (`torch.cuda.max_memory_allocated`) of the run and of each phase of one
  step (forward, backward, optimizer step), against the estimate's moments with the
  allowances left out (runtime/measure.py `CudaMemory`, runtime/train.py `estimated_phases`);
- the allocator's reserved peak (`max_memory_reserved`) and the process's device memory
  (`cudaMemGetInfo`), from which the CUDA context (device memory the allocator does not
  hold) and the fragmentation (reserved over allocated) are measured: the two allowances the
  estimate adds (core/buffers.py);
- the step time and MFU against the time model's prediction (`estimate`'s "time").

Last, it finds the largest micro batch of GPT-2 1.56B whose estimated peak, allowances
included, is at most 95% of the GPU's memory as torch reports it, and runs it: a plan the
estimate calls "fits" at 95% must run.

Run: python benchmarks/gpu_ladder.py [--out results.json] [--only NAME ...] [--budget SECONDS]
Needs a CUDA GPU; `--from results.json` prints a recorded run's table anywhere, each job
estimated anew. Prints a Markdown table (docs/validation.md records it, with the machine
and the date); `--out` keeps every figure as JSON (benchmarks/data/ holds the recorded ones).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 2**30

# name: (model preset, micro batch, recomputation, offload: "" | "optimizer" | "params"), in the
# order they run; the estimated share of an 80 GB H100 in the names' order: 1%, 12%, 19%, 34%,
# 34%, 39%, 40%, 40%, 55%, 71%, 76%, 91%, 75% and 21%.
CASES = {
    "tiny-gpt2 mbs 8": ("tiny-gpt2", 8, "none", ""),
    "gpt2 mbs 8": ("gpt2", 8, "none", ""),
    "gpt2-medium mbs 16 full": ("gpt2-medium", 16, "full", ""),
    "gpt2-medium mbs 16": ("gpt2-medium", 16, "none", ""),
    "gpt2-medium mbs 16 selective": ("gpt2-medium", 16, "selective", ""),
    "gpt2 mbs 32": ("gpt2", 32, "none", ""),
    "gpt2-xl mbs 4": ("gpt2-xl", 4, "none", ""),
    "gpt2-xl mbs 16 full": ("gpt2-xl", 16, "full", ""),
    "gpt2-xl mbs 8 selective": ("gpt2-xl", 8, "selective", ""),
    "gpt2-xl mbs 12 selective": ("gpt2-xl", 12, "selective", ""),
    "gpt2-large mbs 24": ("gpt2-large", 24, "none", ""),
    "gpt2-medium mbs 48": ("gpt2-medium", 48, "none", ""),
    "gpt2-xl mbs 16 optimizer offload": ("gpt2-xl", 16, "none", "optimizer"),
    "gpt2-xl mbs 16 full, params offload": ("gpt2-xl", 16, "full", "params"),
}
# The tiny model has 256 learned positions; the others 1,024.
SEQ = {"tiny-gpt2": 256}

def job_text(model: str, mbs: int, recompute: str, offload: str, gpu: str, capacity: int, host: int) -> str:
    stage = {"": 0, "optimizer": 2, "params": 3}[offload]
    lines = [
        f'[model]\npreset = "{model}"',
        f'[cluster]\ngpu = "{gpu}"\ngpus_per_node = 1\ngpu_memory = {capacity}\ncpu_memory_per_node = {host}',
        f"[parallel]\ndp = 1\nmicro_batch_size = {mbs}\nnum_microbatches = 1",
        f"[zero]\nstage = {stage}",
        f'[train]\nseq_len = {SEQ.get(model, 1024)}\nprecision = "bf16-mixed"\nsteps = 6\nactivation_checkpointing = "{recompute}"',
    ]
    if offload == "optimizer":
        lines.append("[offload]\noptimizer = true")
    elif offload == "params":
        lines.append('[offload]\nparams = true\ngpu_param_budget = "1GiB"')
    else:  # only what the job asks: the default strategy would offload a plan over the GPU
        lines.append('[offload]\nstrategy = "conservative"')
    return "\n".join(lines) + "\n"


def shardplan(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    return subprocess.run([sys.executable, "-m", "shardplan", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def estimate(job: Path) -> dict:
    proc = shardplan(["estimate", str(job), "--json"], 120)
    document = json.loads(proc.stdout)
    if "error" in document:
        raise SystemExit(f"{job.name}: {proc.stderr.strip()}")
    return document


def measure(name: str, text: str, folder: Path) -> dict:
    job = folder / f"{name.replace(' ', '_').replace(',', '')}.toml"
    job.write_text(text, encoding="utf-8")
    est = estimate(job)
    report = job.with_suffix(".json")
    started = time.perf_counter()
    proc = shardplan(["run", str(job), "--report", str(report)], 600)
    record = {"name": name, "job": text, "estimate": {
        "peak_gpu_bytes": est["peak_gpu_bytes"], "fits": est["fits"], "gpu_memory": est["gpu_memory"],
        "peak_moment": est["devices"][0]["peak_moment"], "moments": est["devices"][0]["moments"],
        "time": {k: est["time"][k] for k in ("step_seconds", "mfu", "hfu", "tokens_per_second", "breakdown")},
    }, "wall_seconds": time.perf_counter() - started, "returncode": proc.returncode}
    if proc.returncode:
        record["error"] = proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "no output"
        record["stderr_tail"] = proc.stderr[-3000:]
        return record
    document = json.loads(report.read_text())
    rank = document["ranks"][0]
    record["run"] = {k: document[k] for k in ("device", "torch_version", "steps", "step_seconds",
                                              "tokens_per_second", "mfu")}
    record["run"]["measured"] = rank["measured"]
    record["run"]["estimated"] = rank["estimated"]
    return record


def largest_fitting(folder: Path, gpu: str, capacity: int, host: int, share: float = 0.95) -> tuple[int, float]:
    """The largest micro batch of GPT-2 1.56B (no recomputation, no offload: the strategy is
    conservative) whose estimated peak is at most `share` of the GPU, and that share."""
    low, high, best = 1, 64, (0, 0.0)
    while low <= high:
        mbs = (low + high) // 2
        job = folder / f"probe-{mbs}.toml"
        job.write_text(job_text("gpt2-xl", mbs, "none", "", gpu, capacity, host), encoding="utf-8")
        used = estimate(job)["peak_gpu_bytes"] / capacity
        if used <= share:
            best, low = (mbs, used), mbs + 1
        else:
            high = mbs - 1
    return best


def pct(a: float, b: float) -> str:
    return f"{(a - b) / b:+.1%}"


def table(records: list[dict], capacity: int, totals: dict[str, int] | None = None) -> str:
    """The Markdown table of docs/validation.md. `totals`: the estimated GPU totals
    (allowances included) by run name, where they were estimated anew."""
    rows = ["| run | estimated total (share) | device used: reserved + context | allocated peak: est / meas "
            "| phases forward / backward / step: est vs meas | reserved / allocated "
            "| step time: predicted / measured | MFU: predicted / measured |",
            "|---|---|---|---|---|---|---|---|"]
    for r in records:
        e = r["estimate"]
        total = (totals or {}).get(r["name"], e["peak_gpu_bytes"])
        share = f"{total / GIB:.2f} GiB ({total / capacity:.1%})"
        if "run" not in r:
            rows.append(f"| {r['name']} | {share} | failed: {r.get('error', '')} | | | | | |")
            continue
        meas, est = r["run"]["measured"], r["run"]["estimated"]
        used = meas["reserved_device"] + meas["context"]
        phases = " / ".join(pct(est["phases"][p], meas["phases"][p]) for p in ("forward", "backward", "step")
                            if p in est.get("phases", {}) and p in meas.get("phases", {}))
        rows.append(
            f"| {r['name']} | {share} | {used / GIB:.2f} GiB ({used / capacity:.1%}) "
            f"| {est['peak_device'] / GIB:.2f} / {meas['peak_device'] / GIB:.2f} GiB "
            f"({pct(est['peak_device'], meas['peak_device'])}) | {phases} "
            f"| {meas['reserved_device'] / meas['peak_device']:.3f} "
            f"| {e['time']['step_seconds'] * 1e3:.0f} / {r['run']['step_seconds'] * 1e3:.0f} ms "
            f"({r['run']['step_seconds'] / e['time']['step_seconds']:.2f}x) "
            f"| {e['time']['mfu']:.1%} / {(r['run']['mfu'] or 0):.1%} |")
    return "\n".join(rows)


def from_record(path: Path) -> None:
    """The table of a recorded run (no GPU needed), each job estimated anew with this code."""
    document = json.loads(path.read_text())
    totals = {}
    with tempfile.TemporaryDirectory() as tmp:
        for record in document["records"]:
            job = Path(tmp) / "job.toml"
            job.write_text(record["job"], encoding="utf-8")
            totals[record["name"]] = estimate(job)["peak_gpu_bytes"]
    print(f"Measured {document['date']} on {document['device']} ({document['capacity'] / GIB:.2f} GiB as "
          f"torch reports it), torch {document['torch']}, CUDA {document['cuda']}\n")
    print(table(document["records"], document["capacity"], totals))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write every figure as JSON")
    parser.add_argument("--only", nargs="*", help="the cases to run (names as in CASES)")
    parser.add_argument("--budget", type=float, default=1e9, help="start no case after this many seconds")
    parser.add_argument("--skip-fit-check", action="store_true", help="run the ladder only")
    parser.add_argument("--fit-check-only", action="store_true", help="run the 95%% check only")
    parser.add_argument("--from", dest="recorded", type=Path, help="print the table of a recorded --out file")
    args = parser.parse_args()
    if args.recorded:
        from_record(args.recorded)
        return
    import torch  # only the runs need it; the estimates run in their own processes

    from shardplan.runtime.train import DEVICE_PRESETS  # the GPU preset of a device name, as `run`'s MFU

    if not torch.cuda.is_available():
        raise SystemExit("gpu_ladder needs a CUDA GPU")
    name = torch.cuda.get_device_name(0)
    gpu = next((preset for key, preset in DEVICE_PRESETS if key in name), None)
    if gpu is None:
        raise SystemExit(f"no GPU preset matches {name!r}")
    capacity = torch.cuda.get_device_properties(0).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    start = time.perf_counter()
    document = {"date": date.today().isoformat(), "device": name, "preset": gpu, "capacity": capacity,
                "host_memory": host, "machine": f"{platform.machine()} ({os.cpu_count()} cores)",
                "torch": torch.__version__, "cuda": torch.version.cuda, "records": []}
    cases = {k: v for k, v in CASES.items() if (not args.only or k in args.only) and not args.fit_check_only}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        todo = [(label, job_text(*spec, gpu, capacity, host)) for label, spec in cases.items()]
        if not args.skip_fit_check:
            mbs, share = largest_fitting(folder, gpu, capacity, host)
            todo.append((f"gpt2-xl mbs {mbs} (estimated {share:.1%} of the GPU)",
                         job_text("gpt2-xl", mbs, "none", "", gpu, capacity, host)))
        for label, text in todo:
            if time.perf_counter() - start > args.budget:
                print(f"budget spent: {label} not run", file=sys.stderr)
                continue
            record = measure(label, text, folder)
            document["records"].append(record)
            if len(document["records"]) == 1 and "run" not in record:
                print(record.get("stderr_tail", ""), file=sys.stderr)
                raise SystemExit(f"the first run failed ({record.get('error')}): stopping")
            print(f"{label}: {'ok' if 'run' in record else record.get('error')} ({record['wall_seconds']:.0f} s)",
                  file=sys.stderr, flush=True)
            if args.out:
                args.out.write_text(json.dumps(document, indent=1) + "\n", encoding="utf-8")
    print(f"Measured {document['date']} on {name} ({capacity / GIB:.2f} GiB as torch reports it), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    print(table(document["records"], capacity))


if __name__ == "__main__":
    main()
