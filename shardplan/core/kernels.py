"""How long one GPU takes for a kernel: matmuls on the roofline, streaming kernels on HBM.

A matmul of (m x k) by (k x n) does 2mnk FLOPs and moves e(mk + kn + mn) bytes; it takes the
longer of its FLOPs at `matmul_efficiency` of the peak and its bytes at `memory_efficiency`
of the HBM bandwidth (the roofline, Williams et al. 2009), plus a fixed per-kernel cost
(TimeConstants.matmul_overhead_seconds). Small matmuls, like those left on a rank after a wide
tensor-parallel split, therefore run below the large-matmul efficiency. Elementwise kernels
(norms, activations, dropout, softmax) and the optimizer are bound by their bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from .hardware import Hardware, TimeConstants


@dataclass(frozen=True)
class Work:
    """A sum of kernels: seconds, and the FLOPs and bytes they were timed from."""

    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    kernels: int = 0

    def __add__(self, other: Work) -> Work:
        return Work(self.seconds + other.seconds, self.flops + other.flops, self.bytes + other.bytes,
                    self.kernels + other.kernels)

    def times(self, count: float) -> Work:
        return Work(self.seconds * count, self.flops * count, self.bytes * count, int(self.kernels * count))


NONE = Work()


def matmul(m: float, n: float, k: float, e: int, peak: float, hw: Hardware, c: TimeConstants,
           batch: int = 1, extra_bytes: float = 0.0) -> Work:
    """`batch` matmuls of (m x k)(k x n) in one kernel; `extra_bytes` beyond A, B and C."""
    if m <= 0 or n <= 0 or k <= 0 or batch <= 0:
        return NONE
    flops = 2.0 * m * n * k * batch
    moved = e * (m * k + k * n + m * n) * batch + extra_bytes
    compute = flops / (peak * hw.matmul_efficiency)
    memory = moved / (hw.memory_bandwidth * hw.memory_efficiency)
    return Work(max(compute, memory) + c.matmul_overhead_seconds, flops, moved, 1)


def streaming(moved: float, hw: Hardware, kernels: int = 1) -> Work:
    """Memory-bound kernels moving `moved` bytes in all."""
    if moved <= 0:
        return NONE
    return Work(moved / (hw.memory_bandwidth * hw.memory_efficiency), 0.0, moved, kernels)


def fused_attention(flops: float, efficiency: float, peak: float) -> Work:
    """A flash-attention kernel: its FLOPs at `efficiency` of the peak (it keeps its tiles in
    on-chip memory, so HBM traffic does not bound it)."""
    if flops <= 0:
        return NONE
    return Work(flops / (peak * efficiency), flops, 0.0, 1)
