"""What a rank really holds, measured the way the estimate counts it.

Bytes of parameters, gradients and optimizer states: for each tensor its local shard
(`DTensor.to_local()`), then the unique storages it lives in, `untyped_storage().nbytes()`
(FSDP2's padded shards and its shared reduce-scatter buffers count as allocated). Saved
activations: every tensor autograd saves for backward is tracked from the moment it is saved
until autograd releases it; the measurement is the peak of the bytes of the distinct live
storages, leaving out parameters (and views of them) and 16-bit casts of parameters (counted
as buffers by the estimate).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .lora import inner_tensors, is_quantized


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding the data: a DTensor's local shard, the result inside a
    functional collective's AsyncCollectiveTensor (tensor-parallel outputs)."""
    if isinstance(tensor, DTensor):
        tensor = tensor.to_local()
    while type(tensor).__name__ == "AsyncCollectiveTensor":
        tensor = tensor.elem
    return tensor


def _plain(tensors: Iterable[torch.Tensor | None]) -> Iterator[torch.Tensor]:
    """The plain tensors holding the data: local shards, and the inner tensors of quantized
    tensors (torchao's NF4Tensor and OptimState8bit: codes, scales, maps)."""
    for tensor in tensors:
        if tensor is None:
            continue
        local = _local(tensor)
        if is_quantized(local):
            yield from inner_tensors(local)
        else:
            yield local


def unique_storage_bytes(tensors: Iterable[torch.Tensor | None]) -> dict[str, int]:
    """Bytes of the distinct storages behind `tensors`, by device type ("cpu", "cuda")."""
    seen: dict[tuple[str, int], int] = {}
    for local in _plain(tensors):
        storage = local.untyped_storage()
        key = (local.device.type, storage.data_ptr() or id(storage))
        seen[key] = max(seen.get(key, 0), storage.nbytes())
    totals: dict[str, int] = {}
    for (device, _), nbytes in seen.items():
        totals[device] = totals.get(device, 0) + nbytes
    return totals


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Every state tensor of an optimizer (ZeroRedundancyOptimizer: its local optimizer)."""
    inner = getattr(optimizer, "optim", optimizer)
    return [value for state in inner.state.values() for value in state.values() if torch.is_tensor(value)]


def _total(found: dict[str, int]) -> int:
    return sum(found.values())


def placement_bytes(params: list[nn.Parameter], on_host: frozenset, optimizers: list[torch.optim.Optimizer],
                    engine=None) -> dict[str, dict[str, int]]:
    """Bytes of parameters, gradients and optimizer states, by placement: `host` is what the
    plan keeps in host memory (parameters of CPU-offloaded blocks, their gradients, the
    offload engine's store), `device` the rest. Placement is known, not inferred from
    `tensor.device`, so it holds on a CPU-only machine too, where both are CPU tensors."""
    host_params = [p for p in params if p in on_host]
    device_params = [p for p in params if p not in on_host]
    stored = engine.host_tensors() if engine is not None else {"grads": [], "optimizer": []}
    device_optimizers = [o for o in optimizers if o is not engine]
    return {
        "params": {"device": _total(unique_storage_bytes(device_params)),
                   "host": _total(unique_storage_bytes(host_params))},
        "grads": {"device": _total(unique_storage_bytes(p.grad for p in device_params)),
                  "host": _total(unique_storage_bytes([p.grad for p in host_params] + stored["grads"]))},
        "optimizer": {"device": _total(unique_storage_bytes(t for o in device_optimizers for t in optimizer_tensors(o))),
                      "host": _total(unique_storage_bytes(stored["optimizer"]))},
    }


def _is_parameter_copy(tensor: torch.Tensor) -> bool:
    """A cast of a parameter (autocast's or a mixed-precision copy): ToCopy on a leaf."""
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    return any(type(fn).__name__ == "AccumulateGrad" for fn, _ in node.next_functions if fn is not None)


class SavedTensorTracker:
    """Peak bytes of live saved-for-backward storages (see the module docstring)."""

    def __init__(self, params: list[nn.Parameter]):
        self.param_storages = {t.untyped_storage().data_ptr() for t in _plain(params)}
        self.live: dict[int, list[int]] = {}  # storage ptr -> [count, nbytes]
        self.current = 0
        self.peak = 0
        self.copies_peak = 0
        self._copies = 0

    def _release(self, key: int, copy: bool, nbytes: int) -> None:
        if copy:
            self._copies -= nbytes
            return
        entry = self.live.get(key)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[key]

    def pack(self, tensor: torch.Tensor) -> object:
        holder = _Saved(tensor)
        # Parameters and views of them (F.linear saves weight.t(), a view of FSDP2's
        # unsharded parameter) are weights, not activations.
        if isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter) or tensor.device.type == "meta":
            return holder
        local = _local(tensor)
        if is_quantized(local):  # a quantized weight (NF4) saved by its linear: a parameter
            return holder
        try:
            storage = local.untyped_storage()
            key, nbytes = storage.data_ptr(), storage.nbytes()
        except RuntimeError as exc:
            raise RuntimeError(f"saved {type(tensor).__name__} {tuple(tensor.shape)} {tensor.grad_fn}: {exc}") from None
        if key in self.param_storages or nbytes == 0:
            return holder
        copy = _is_parameter_copy(tensor) or (tensor._base is not None and _is_parameter_copy(tensor._base))
        if copy:
            self._copies += nbytes
            self.copies_peak = max(self.copies_peak, self._copies)
        else:
            entry = self.live.setdefault(key, [0, nbytes])
            if entry[0] == 0:
                self.current += nbytes
            entry[0] += 1
            self.peak = max(self.peak, self.current)
        weakref.finalize(holder, self._release, key, copy, nbytes)
        return holder

    @staticmethod
    def unpack(holder: object) -> torch.Tensor:
        return holder.tensor  # type: ignore[attr-defined]

    @contextmanager
    def tracking(self) -> Iterator[SavedTensorTracker]:
        with torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack):
            yield self


class _Saved:
    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class ProcessMemory:
    """The process's resident memory (Linux): its growth from a starting point to the high
    water mark, the measure of a rank's peak where host and device memory are one (CPU).

    Writing 5 to /proc/self/clear_refs resets the high water mark `VmHWM` to the current
    resident size (Linux 4.0+, Documentation/filesystems/proc.rst, "clear_refs"); elsewhere
    nothing is measured."""

    def __init__(self) -> None:
        self.baseline: int | None = None

    @staticmethod
    def _status(key: str) -> int | None:
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith(key + ":"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            return None
        return None

    def start(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w", encoding="ascii") as refs:
                refs.write("5")
        except OSError:
            return
        self.baseline = self._status("VmRSS")

    def growth(self) -> int | None:
        """Bytes the high water mark rose above the start (None where not measurable)."""
        if self.baseline is None:
            return None
        peak = self._status("VmHWM")
        return None if peak is None else peak - self.baseline


class CudaMemory:
    """The caching allocator's figures on CUDA (torch.cuda memory statistics), kept across the
    phases of one step: the peak allocated bytes of each phase (forward, backward, optimizer
    step), the peaks over the whole run, and the device memory the process uses beside its
    tensors (the CUDA context: driver, kernels, NCCL and cuBLAS workspaces).

    A phase's peak is read with `max_memory_allocated` and the counter reset for the next
    phase (`reset_peak_memory_stats`); the run's peaks are the largest of what was read, so
    resetting loses nothing."""

    def __init__(self, device: torch.device):
        self.device = device
        self.phases: dict[str, int] = {}
        self.allocated = 0
        self.reserved = 0
        self._current: str | None = None

    def _read(self) -> int:
        allocated = torch.cuda.max_memory_allocated(self.device)
        self.allocated = max(self.allocated, allocated)
        self.reserved = max(self.reserved, torch.cuda.max_memory_reserved(self.device))
        return allocated

    def enter(self, phase: str | None) -> None:
        """Close the phase in progress (its peak) and start `phase` (None: no phase)."""
        torch.cuda.synchronize(self.device)
        allocated = self._read()
        if self._current is not None:
            self.phases[self._current] = max(self.phases.get(self._current, 0), allocated)
            torch.cuda.reset_peak_memory_stats(self.device)
        self._current = phase
        if phase is not None:
            torch.cuda.reset_peak_memory_stats(self.device)

    def figures(self) -> dict:
        """Peak allocated and reserved bytes of the run, the process's device memory now
        (the device's used memory by `cudaMemGetInfo`, one process per GPU), the part of it
        the allocator does not hold (the context), the allocator's retries, and each measured
        phase's peak."""
        torch.cuda.synchronize(self.device)
        self._read()
        free, total = torch.cuda.mem_get_info(self.device)
        used = total - free
        stats = torch.cuda.memory_stats(self.device)
        return {
            "peak_device": self.allocated,
            "reserved_device": self.reserved,
            "device_used": used,
            "context": used - torch.cuda.memory_reserved(self.device),
            "device_capacity": total,
            # times an allocation failed, the allocator freed its cached blocks and retried:
            # each costs a device synchronisation and cudaFree/cudaMalloc calls
            "alloc_retries": stats.get("num_alloc_retries", 0),
            "phases": dict(self.phases),
        }


# `SHARDPLAN_PROFILE=FILE`: rank 0 profiles one step (the one after the measured step) with
# torch.profiler and writes each kernel's and operator's self time on the device as JSON, a
# list of {"name", "count", "device_seconds", "cpu_seconds"}, largest first. A diagnostic:
# the profiled step is left out of the timed steps.
PROFILE_ENV = "SHARDPLAN_PROFILE"


def profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def write_profile(prof, path: str) -> None:
    import json

    rows = [{"name": e.key, "count": e.count, "device_seconds": e.self_device_time_total / 1e6,
             "cpu_seconds": e.self_cpu_time_total / 1e6} for e in prof.key_averages()]
    rows.sort(key=lambda r: (r["device_seconds"], r["cpu_seconds"]), reverse=True)
    with open(path, "w", encoding="utf-8") as out:
        json.dump(rows, out, indent=1)
