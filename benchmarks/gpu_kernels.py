"""What the GPU gives the GPT-2 ladder's kernels (benchmarks/gpu_ladder.py): bf16 matrix
products of each linear layer's shape at a micro batch's tokens, against the device's dense
bf16 peak, and the bandwidth of the elementwise kernels around them. These are the two
efficiencies the time model assumes (hardware presets' `efficiencies`: matmul, memory).

Run: python benchmarks/gpu_kernels.py   (needs a CUDA GPU; prints a Markdown table)
"""

from __future__ import annotations

import torch

# name: (hidden, tokens of one micro batch: mbs x 1,024)
MODELS = {"gpt2 (h 768), 8 x 1024 tokens": (768, 8 * 1024),
          "gpt2-medium (h 1024), 16 x 1024": (1024, 16 * 1024),
          "gpt2-xl (h 1600), 4 x 1024": (1600, 4 * 1024),
          "gpt2-xl (h 1600), 12 x 1024": (1600, 12 * 1024)}
VOCAB = 50257


def timed(fn, repeat: int = 20) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / repeat


def main() -> None:
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}\n")
    print("| shapes | qkv | proj | fc | fc2 | head | layer linears (fwd) | LayerNorm GB/s | GELU GB/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for label, (h, n) in MODELS.items():
        x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16)
        cells, flops, seconds = [], 0.0, 0.0
        for k, m in (("qkv", 3 * h), ("proj", h), ("fc", 4 * h), ("fc2", h), ("head", VOCAB)):
            inner = 4 * h if k == "fc2" else h
            a = x if inner == h else torch.randn(n, inner, device="cuda", dtype=torch.bfloat16)
            w = torch.randn(m, inner, device="cuda", dtype=torch.bfloat16)
            t = timed(lambda a=a, w=w: torch.nn.functional.linear(a, w))
            f = 2.0 * n * inner * m
            cells.append(f"{f / t / 1e12:.0f}")
            if k != "head":
                flops, seconds = flops + f, seconds + t
        norm = torch.nn.LayerNorm(h, device="cuda", dtype=torch.bfloat16)
        t_norm = timed(lambda: norm(x))
        big = torch.randn(n, 4 * h, device="cuda", dtype=torch.bfloat16)
        t_gelu = timed(lambda: torch.nn.functional.gelu(big, approximate="tanh"))
        print(f"| {label} | " + " | ".join(cells) + f" | {flops / seconds / 1e12:.0f} TFLOP/s "
              f"| {2 * x.numel() * 2 / t_norm / 1e9:,.0f} | {2 * big.numel() * 2 / t_gelu / 1e9:,.0f} |")
    print("\nMatrix products in TFLOP/s (bf16, dense); bandwidth counts bytes read and written.")


if __name__ == "__main__":
    main()
