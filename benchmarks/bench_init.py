"""Time the drawing of a large model's initial weights (runtime/model.py `init_parameter`):
one layer of Llama-3 70B's shapes (q, k, v, o, gate, up, down: 856M values), drawn as `run`
draws them (tensors above DRAW_CHUNK in chunks on the process's torch threads) and, as the
baseline in the same run, from one serial generator per tensor. The two alternate in every
repeat so a busy machine slows them alike. Prints the minimum seconds of each and the ratio.

usage: python benchmarks/bench_init.py [--repeats R] [--threads T]
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from shardplan.runtime.model import INIT_STD, _name_seed, init_parameter

# Llama-3 70B: hidden 8192, 64 heads of 128, 8 KV heads, SwiGLU of 28672.
LAYER = {"q_proj": (8192, 8192), "k_proj": (1024, 8192), "v_proj": (1024, 8192), "o_proj": (8192, 8192),
         "gate_proj": (28672, 8192), "up_proj": (28672, 8192), "down_proj": (8192, 28672)}


def chunked(seed: int) -> None:
    for name, shape in LAYER.items():
        init_parameter(torch.empty(shape), f"layers.0.{name}.weight", seed)


def serial(seed: int) -> None:
    for name, shape in LAYER.items():
        generator = torch.Generator().manual_seed(_name_seed(seed, f"layers.0.{name}.weight"))
        torch.empty(shape).copy_(torch.randn(shape, generator=generator) * INIT_STD)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    best = {"serial": float("inf"), "chunked": float("inf")}
    for _ in range(args.repeats):
        for label, fn in (("serial", serial), ("chunked", chunked)):
            start = time.perf_counter()
            fn(1)
            best[label] = min(best[label], time.perf_counter() - start)
    values = sum(a * b for a, b in LAYER.values())
    print(json.dumps({"machine": platform.machine(), "threads": args.threads, "values": values,
                      "seconds": {k: round(v, 3) for k, v in best.items()},
                      "values_per_second": {k: round(values / v) for k, v in best.items()},
                      "speedup": round(best["serial"] / best["chunked"], 2)}, indent=1))


if __name__ == "__main__":
    main()
