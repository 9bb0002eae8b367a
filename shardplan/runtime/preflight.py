"""Refuse, before building the model, a plan whose estimate does not fit this machine.

Each rank compares its own estimate (core.estimate.rank_estimate, the figures `estimate`
prints) with its device: the GPU's total memory under CUDA; on a CPU-only node the node's
available RAM, shared by the ranks running on it. The CPU side (offloaded states) of all
ranks of a node is compared with the node's RAM too. Every rank learns the verdict (one
all-reduce), so all stop together; `--force` runs anyway.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from ..core.estimate import DeviceEstimate
from ..core.host import node_host
from ..spec.errors import InfeasibleError
from ..spec.units import format_bytes


def available_ram() -> int | None:
    """MemAvailable of /proc/meminfo (Linux), else total physical memory, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def check(device: DeviceEstimate, on_gpu: bool, device_index: int | None, local_world: int, force: bool) -> str | None:
    """Raise InfeasibleError on every rank when any rank's plan does not fit (unless
    `force`); returns this rank's finding (None when it fits)."""
    finding = None
    if on_gpu:
        capacity = torch.cuda.get_device_properties(device_index).total_memory
        need = device.gpu["total"]
        if need > capacity:
            finding = f"needs {format_bytes(need)} on its GPU, which has {format_bytes(capacity)}"
    ram = available_ram()
    if ram is not None:
        per_rank = node_host([(device.host, device.startup)], on_gpu)[0] + (0 if on_gpu else device.gpu["total"])
        need = per_rank * local_world
        if need > ram and finding is None:
            finding = (f"its node needs {format_bytes(need)} of RAM ({local_world} ranks x "
                       f"{format_bytes(per_rank)}), about {ram // 2**30} GiB available")
    verdict = torch.tensor([0 if finding else 1], dtype=torch.int64, device="cuda" if on_gpu else "cpu")
    dist.all_reduce(verdict, op=dist.ReduceOp.MIN)
    if int(verdict.item()) == 0 and not force:
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in device.gpu.items() if k != "total")
        mine = finding or "another rank does not fit"
        raise InfeasibleError(f"preflight: the plan does not fit: {mine}; estimate per device: {parts}; "
                              "run `shardplan estimate` for the breakdown, or pass --force")
    return finding
