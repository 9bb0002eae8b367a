"""Time the host-state codec (runtime/offload_codec.py): encoding and decoding one optimizer
state of N elements with each compression, in one process, the compressions interleaved in
every repeat so a busy machine slows them alike. Prints the minimum seconds of each and the
encodes as ratios to int8's.

usage: python benchmarks/bench_codec.py [--elements N] [--repeats R]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from shardplan.runtime.offload_codec import StoredState, rounding_bits

COMPRESSIONS = ("int8", "bf16", "fp16")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 26, help="elements of the state (whole blocks of 256)")
    parser.add_argument("--repeats", type=int, default=5, help="rounds over the compressions (minimum reported)")
    args = parser.parse_args()
    numel = -(-args.elements // 256) * 256
    values = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * 1e-3  # first-moment-like
    bits = rounding_bits(numel)  # kept by the engine for bf16 (runtime/offload.py)
    out = torch.empty(numel)
    states = {c: StoredState(numel, c, "exp_avg") for c in COMPRESSIONS}
    for state in states.values():
        state.encode(values, seed=0, bits=bits)  # tables and threads made before timing
    seconds = {(c, op): [] for c in COMPRESSIONS for op in ("encode", "decode")}
    for repeat in range(args.repeats):
        for compression, state in states.items():
            start = time.perf_counter()
            state.encode(values, seed=repeat + 1, bits=bits)
            seconds[compression, "encode"].append(time.perf_counter() - start)
            start = time.perf_counter()
            state.decode(out)
            seconds[compression, "decode"].append(time.perf_counter() - start)
    best = {f"{c} {op}": round(min(times), 4) for (c, op), times in seconds.items()}
    print(json.dumps({
        "machine": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
        "elements": numel, "seconds": best,
        "encode / int8 encode": {c: round(best[f"{c} encode"] / best["int8 encode"], 3) for c in COMPRESSIONS},
    }, indent=2))


if __name__ == "__main__":
    main()
