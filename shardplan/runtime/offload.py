"""The offload engine: optimizer states (and fp32 master weights) in host memory, the step on
the CPU, the rank's local shards only. What it holds is what core/offload.py and core/states.py
count, byte for byte.

Design (read from torchao's CPUOffloadOptimizer, torchao/optim/cpu_offload.py, and
Megatron-core's HybridDeviceOptimizer, megatron/core/optimizer/cpu_offloading/): each
gradient is copied to a pinned host buffer on a side stream as soon as it exists (FSDP2
calls post-accumulate-grad hooks on the sharded parameter after its reduce-scatter; DDP's
comm hook after a bucket's all-reduce); the step runs group by group in the order the
gradients arrived, with torch's fused CPU AdamW (`torch.optim.adamw.adamw(fused=True)`),
while the updated parameters of the previous groups travel host-to-device on another
stream; the compute stream waits for them (GPU-side) before the next forward.
torchao's class asserts a CUDA/XPU device, keeps one optimizer per tensor, no fp32 master and
a state_dict that torch.distributed.checkpoint cannot map to parameter names; this module
is the narrow piece it lacks: CPU support, groups, compression (runtime/offload_codec.py),
DCP-compatible states and placement that can be measured.

On a CPU-only machine the same code runs: streams, events and pinning are skipped and the
copies are synchronous (TORCH-NOTES); the host store is still separate from the "device"
tensors, so placement is measurable anywhere.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

from .offload_codec import StoredState, padded, rounding_bits

# torch.optim.AdamW's defaults: the device path (runtime/parallel.py) uses them unchanged.
ADAMW_DEFAULTS = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2}
MOMENT_NAMES = {"adamw": ("exp_avg", "exp_avg_sq"), "sgd": ()}


@dataclass(frozen=True)
class EngineConfig:
    """The plan's offload settings, as the engine needs them."""

    optimizer: str = "adamw"  # adamw | sgd
    free_device_grads: bool = False  # offload.grads (core/offload.py frees_device_grads)
    compression: str = "none"
    pin: bool = False  # pinned host buffers (only with an accelerator)
    prefetch: int = 1  # offload.prefetch_layers: staging slots beyond the one in use
    seed: int = 0
    rank: int = 0


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


class Copies:
    """Side streams, events and pinned buffers on an accelerator; plain synchronous copies on
    the CPU, where none of them exists."""

    def __init__(self, device: torch.device, pin: bool):
        self.gpu = device.type != "cpu"
        self.module = torch.get_device_module(device) if self.gpu else None
        self.d2h = self.module.Stream(device) if self.gpu else None
        self.h2d = self.module.Stream(device) if self.gpu else None
        self.pin = pin and self.gpu
        self.exposed_seconds = 0.0  # copy time the compute had to wait for
        self._marks: list[tuple[object, object]] = []

    def empty(self, numel: int, dtype: torch.dtype, pinned: bool = True) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype, pin_memory=self.pin and pinned)

    def on(self, stream):
        return self.module.stream(stream) if self.gpu else contextlib.nullcontext()

    def follow_compute(self, stream) -> None:
        """`stream` starts after the work queued so far on the compute stream."""
        if self.gpu:
            stream.wait_stream(self.module.current_stream())

    def record(self, stream):
        return stream.record_event() if self.gpu else None

    def wait_host(self, event) -> None:
        """Block the host until a copy is done, counting the wait as exposed copy time."""
        if event is not None:
            started = time.perf_counter()
            event.synchronize()
            self.exposed_seconds += time.perf_counter() - started

    def compute_waits(self, stream) -> None:
        """The compute stream waits (on the device) for `stream`; the stall is measured
        between two events around the wait and collected by `settle`."""
        if not self.gpu:
            return
        current = self.module.current_stream()
        before = current.record_event(self.module.Event(enable_timing=True))
        current.wait_stream(stream)
        after = current.record_event(self.module.Event(enable_timing=True))
        self._marks.append((before, after))

    def settle(self) -> None:
        for before, after in self._marks:
            after.synchronize()
            self.exposed_seconds += before.elapsed_time(after) / 1000
        self._marks.clear()


class _Entry:
    """One parameter the engine steps."""

    def __init__(self, param: nn.Parameter, on_host: bool, offset: int, stored_offset: int):
        self.param, self.on_host = param, on_host
        local = _local(param.detach())
        self.shape, self.numel, self.dtype = local.shape, local.numel(), local.dtype
        self.offset, self.stored_offset = offset, stored_offset
        self.has_master = not on_host or local.dtype != torch.float32
        self.master: torch.Tensor | None = None
        self.host_grad: torch.Tensor | None = None
        self.step: torch.Tensor | None = None
        self.received = False  # a gradient arrived on the host this step


class _Group:
    """The parameters of one FSDP module (a block, a stage's root) or DDP's of one module:
    one flat host buffer per kind, so each is one (pinned) allocation."""

    def __init__(self, name: str, entries: list[_Entry], config: EngineConfig, copies: Copies):
        self.name, self.entries = name, entries
        numel = sum(e.numel for e in entries)
        self.stored_numel = sum(padded(e.numel, config.compression) for e in entries)
        masters = [e for e in entries if e.has_master]
        on_device = [e for e in entries if not e.on_host]
        # Pinned only where it is copied to the device (the estimate rounds those alone).
        self.master = copies.empty(numel, torch.float32, pinned=bool(on_device)) if masters else None
        grad_dtype = on_device[0].dtype if on_device else torch.float32
        self.grads = copies.empty(numel, grad_dtype) if on_device else None
        self.states = {name: StoredState(self.stored_numel, config.compression, name)
                       for name in MOMENT_NAMES[config.optimizer]}
        self.steps = torch.zeros(len(entries), dtype=torch.float32) if config.optimizer == "adamw" else None
        for index, e in enumerate(entries):
            view = slice(e.offset, e.offset + e.numel)
            if e.has_master:
                e.master = self.master[view].view(e.shape)
                e.master.copy_(_local(e.param.detach()))
            if not e.on_host:
                e.host_grad = self.grads[view].view(e.shape)
            if self.steps is not None:
                e.step = self.steps[index]
        self.event = None  # the last gradient copy of this step

    def tensors(self) -> dict[str, list[torch.Tensor]]:
        optimizer = [t for state in self.states.values() for t in state.tensors()]
        optimizer += [t for t in (self.master, self.steps) if t is not None]
        return {"grads": [self.grads] if self.grads is not None else [], "optimizer": optimizer}


class _Staging:
    """`1 + prefetch` pinned slots for gradients that must be added on the host (a later
    microbatch's, when the device copy is freed after each): a slot is reused once its copy
    is done and its sum taken."""

    def __init__(self, slots: int, numel: int, dtype: torch.dtype, copies: Copies):
        self.copies, self.slots, self.numel, self.dtype = copies, slots, numel, dtype
        self.buffers: list[torch.Tensor] = []  # allocated on first use: only accumulation needs them
        self.pending: list[tuple[_Entry, object] | None] = [None] * slots
        self.next = 0

    def _settle(self, index: int) -> None:
        if self.pending[index] is not None:
            entry, event = self.pending[index]
            self.copies.wait_host(event)
            entry.host_grad.add_(self.buffers[index][:entry.numel].view(entry.shape))
            self.pending[index] = None

    def copy(self, entry: _Entry, grad: torch.Tensor) -> None:
        if not self.buffers:
            self.buffers = [self.copies.empty(self.numel, self.dtype) for _ in range(self.slots)]
        index = self.next
        self.next = (index + 1) % len(self.buffers)
        self._settle(index)
        with self.copies.on(self.copies.d2h):
            self.buffers[index][:entry.numel].view(entry.shape).copy_(grad, non_blocking=True)
        self.pending[index] = (entry, self.copies.record(self.copies.d2h))

    def drain(self) -> None:
        if not self.buffers:
            return
        for offset in range(len(self.buffers)):
            self._settle((self.next + offset) % len(self.buffers))


class HostOptimizer(torch.optim.Optimizer):
    """AdamW or SGD whose states live in host memory and whose step runs on the CPU.

    `group_of` names the group of each parameter (its FSDP module); `on_host` holds the
    parameters that already live on the host (FSDP2 CPUOffloadPolicy blocks), stepped in
    place. Every other parameter keeps an fp32 master copy here; its gradient is copied here
    by `watch_fsdp` / `watch_ddp`. Usable as ZeroRedundancyOptimizer's `optimizer_class`
    (through functools.partial) at zero.stage 1."""

    def __init__(self, params, lr: float, *, config: EngineConfig, device: torch.device,
                 group_of: dict[nn.Parameter, str], on_host: frozenset = frozenset()):
        defaults = {"lr": lr, **(ADAMW_DEFAULTS if config.optimizer == "adamw" else {})}
        super().__init__(params, defaults)
        self.config, self.copies = config, Copies(device, config.pin)
        self._lock = threading.Lock()
        ordered: dict[str, list[nn.Parameter]] = {}
        for group in self.param_groups:
            for p in group["params"]:
                ordered.setdefault(group_of.get(p, "other"), []).append(p)
        self.groups: list[_Group] = []
        self._entries: dict[nn.Parameter, tuple[_Group, _Entry]] = {}
        for name, params_of in ordered.items():
            entries, offset, stored = [], 0, 0
            for p in params_of:
                entries.append(_Entry(p, p in on_host, offset, stored))
                offset += entries[-1].numel
                stored += padded(entries[-1].numel, config.compression)
            group = _Group(name, entries, config, self.copies)
            self.groups.append(group)
            for e in entries:
                self._entries[e.param] = (group, e)
                # torch.distributed.checkpoint initialises an empty optimizer by stepping it
                # with zero gradients; a non-empty `state` says it is initialised.
                self.state[e.param] = {"step": e.step} if e.step is not None else {"initialised": True}
        self._arrived: dict[_Group, None] = {}
        self.copy_grads = True  # False while microbatches accumulate on the device (mode without grads)
        largest = max((e.numel for _, e in self._entries.values()), default=0)
        grad_dtype = next((e.dtype for _, e in self._entries.values() if not e.on_host), torch.float32)
        self._staging = _Staging(1 + config.prefetch, largest, grad_dtype, self.copies) \
            if config.free_device_grads and largest else None
        casts = [e for _, e in self._entries.values() if e.has_master and e.dtype != torch.float32]
        self._cast = [self.copies.empty(largest, casts[0].dtype) for _ in range(1 + config.prefetch)] if casts else []
        self._cast_events: list[object] = [None] * len(self._cast)
        working = max((g.stored_numel for g in self.groups), default=0) if config.compression != "none" else 0
        self._working = {name: torch.zeros(working) for name in MOMENT_NAMES[config.optimizer]} if working else {}
        self._bits = rounding_bits(working) if config.compression == "bf16" and working else None

    # -- gradients arriving -----------------------------------------------------------------
    def watch_fsdp(self) -> None:
        """Copy each sharded gradient to the host when FSDP2 has reduced it."""
        for group, entry in self._entries.values():
            if not entry.on_host:
                entry.param.register_post_accumulate_grad_hook(self._on_grad)

    def watch_ddp(self, model: nn.Module, process_group) -> None:
        """Copy each DDP bucket's gradients to the host after its all-reduce (a comm hook
        doing what DDP does by default: divide by the group's size, all-reduce)."""
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        def hook(engine: HostOptimizer, bucket):
            def copy_out(done):
                with engine._lock:
                    for param, grad in zip(bucket.parameters(), bucket.gradients()):
                        if param in engine._entries:
                            engine._receive(param, grad)
                return done.value()

            return allreduce_hook(process_group, bucket).then(copy_out)

        model.register_comm_hook(self, hook)

    def set_final_microbatch(self, final: bool) -> None:
        """Gradients kept on the device accumulate there: copy them after the last microbatch only."""
        self.copy_grads = final or self.config.free_device_grads

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.copy_grads or param.grad is None:
            return
        grad = _local(param.grad)
        self._receive(param, grad)
        if self.config.free_device_grads:
            if self.copies.gpu:
                grad.record_stream(self.copies.d2h)  # freed only once the copy has read it
            param.grad = None

    def _receive(self, param: nn.Parameter, grad: torch.Tensor) -> None:
        group, entry = self._entries[param]
        self.copies.follow_compute(self.copies.d2h)
        if entry.received and self._staging is not None:
            self._staging.copy(entry, grad)
        else:
            with self.copies.on(self.copies.d2h):
                entry.host_grad.copy_(grad.view(entry.shape), non_blocking=True)
        entry.received = True
        group.event = self.copies.record(self.copies.d2h)
        self._arrived.pop(group, None)
        self._arrived[group] = None

    # -- the step -------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        if self._staging is not None:
            self._staging.drain()
        self.copies.follow_compute(self.copies.h2d)  # backward has read the parameters
        ordered = list(self._arrived) + [g for g in self.groups if g not in self._arrived]
        for group in ordered:
            self._step_group(group)
        self._arrived.clear()
        self.copies.compute_waits(self.copies.h2d)
        return loss

    def _grads(self, group: _Group) -> list[tuple[_Entry, torch.Tensor]]:
        found = []
        for e in group.entries:
            if e.on_host:
                if e.param.grad is not None:
                    found.append((e, _local(e.param.grad)))
            elif e.received:
                found.append((e, e.host_grad))
            e.received = False
        return found

    def _step_group(self, group: _Group) -> None:
        self.copies.wait_host(group.event)
        group.event = None
        live = self._grads(group)
        if not live:
            return
        hyper = self.param_groups[0]
        params = [e.master if e.has_master else _local(e.param.detach()) for e, _ in live]
        grads = [g if g.dtype == torch.float32 else g.float() for _, g in live]
        if self.config.optimizer == "sgd":
            sgd(params, grads, [None] * len(params), fused=True, weight_decay=0.0, momentum=0.0, lr=hyper["lr"],
                dampening=0.0, nesterov=False, maximize=False)
        else:
            moments = self._moments(group, [e for e, _ in live])
            beta1, beta2 = hyper["betas"]
            adamw(params, grads, moments["exp_avg"], moments["exp_avg_sq"], [], [e.step for e, _ in live],
                  fused=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=hyper["lr"],
                  weight_decay=hyper["weight_decay"], eps=hyper["eps"], maximize=False)
            self._store(group)
        self._publish(group, [e for e, _ in live])

    def _values(self, group: _Group, name: str) -> torch.Tensor:
        """The group's fp32 moment `name`: the store itself, or its decompressed copy."""
        state = group.states[name]
        if self.config.compression == "none":
            return state.codes
        out = self._working[name][:group.stored_numel]
        state.decode(out)
        return out

    def _moments(self, group: _Group, entries: list[_Entry]) -> dict[str, list[torch.Tensor]]:
        moments = {}
        for name in MOMENT_NAMES[self.config.optimizer]:
            values = self._values(group, name)
            moments[name] = [values[e.stored_offset:e.stored_offset + e.numel].view(e.shape) for e in entries]
        return moments

    def _seed(self, group: _Group) -> int:
        """Stochastic rounding's seed: the plan's seed, this rank, the step (from the
        checkpointed step counter, so a resumed run rounds alike) and the group."""
        step = int(group.steps[0]) if group.steps is not None else 0
        index = self.groups.index(group)
        return ((self.config.seed * 1_000_003 + self.config.rank) * 1_000_003 + step) * 10_007 + index

    def _store(self, group: _Group) -> None:
        if self.config.compression == "none":
            return
        for name, state in group.states.items():
            state.encode(self._working[name][:group.stored_numel], self._seed(group) * 2 + (name == "exp_avg_sq"),
                         self._bits)

    def _publish(self, group: _Group, entries: list[_Entry]) -> None:
        """Updated masters to the parameters: host-to-device on the copy stream, through a
        host staging slot when the parameter's dtype is not fp32."""
        for e in entries:
            if not e.has_master:
                continue
            target = _local(e.param.detach())
            source = e.master
            if e.dtype != torch.float32:
                index = self._next_cast()
                source = self._cast[index][:e.numel].view(e.shape)
                source.copy_(e.master)
            with self.copies.on(self.copies.h2d):
                target.copy_(source, non_blocking=True)
            if e.dtype != torch.float32:
                self._cast_events[index] = self.copies.record(self.copies.h2d)

    def _next_cast(self) -> int:
        index = getattr(self, "_cast_next", 0)
        self._cast_next = (index + 1) % len(self._cast)
        self.copies.wait_host(self._cast_events[index])
        return index

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Device gradients only: the host copies are overwritten by the next copy."""
        for p in self._entries:
            p.grad = None

    # -- what is where ----------------------------------------------------------------------
    def host_tensors(self) -> dict[str, list[torch.Tensor]]:
        """Every tensor of the host store, by the kind the estimate counts it as."""
        found: dict[str, list[torch.Tensor]] = {"grads": [], "optimizer": []}
        for group in self.groups:
            for kind, tensors in group.tensors().items():
                found[kind] += tensors
        return found

    def exposed_copy_seconds(self) -> float | None:
        if not self.copies.gpu:
            return None
        self.copies.settle()
        return self.copies.exposed_seconds

    # -- checkpoints ------------------------------------------------------------------------
    def _ordered(self) -> list[nn.Parameter]:
        return [p for group in self.param_groups for p in group["params"]]

    def _wrap(self, entry: _Entry, values: torch.Tensor) -> torch.Tensor:
        """A state shaped like the parameter: a DTensor with its placements when it is one
        (what AdamW's `zeros_like(param)` would be), so checkpoints reshard by name."""
        p = entry.param
        if isinstance(p, DTensor):
            return DTensor.from_local(values, p.device_mesh, p.placements, run_check=False,
                                      shape=p.shape, stride=p.stride())
        return values

    def state_dict(self) -> dict:
        """torch's optimizer state_dict layout (AdamW's keys, fp32 moments, decompressed),
        plus `master` where the parameters are not fp32."""
        state: dict[int, dict] = {}
        decoded = {g: {name: self._values(g, name).clone() if self.config.compression != "none"
                       else self._values(g, name) for name in g.states} for g in self.groups}
        for index, p in enumerate(self._ordered()):
            group, e = self._entries[p]
            entry: dict[str, torch.Tensor] = {}
            if e.step is not None:
                entry["step"] = e.step
            for name, values in decoded[group].items():
                entry[name] = self._wrap(e, values[e.stored_offset:e.stored_offset + e.numel].view(e.shape))
            if e.has_master and e.dtype != torch.float32:
                entry["master"] = self._wrap(e, e.master)
            state[index] = entry
        groups, start = [], 0
        for group in self.param_groups:
            count = len(group["params"])
            groups.append({**{k: v for k, v in group.items() if k != "params"},
                           "params": list(range(start, start + count))})
            start += count
        return {"state": state, "param_groups": groups}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        by_param = dict(zip(self._ordered(), saved))
        for group in self.groups:
            for name in group.states:
                values = self._working[name][:group.stored_numel] if self._working else group.states[name].codes
                for e in group.entries:
                    loaded = state_dict["state"].get(by_param[e.param], {})
                    if name in loaded:
                        values[e.stored_offset:e.stored_offset + e.numel].view(e.shape).copy_(_local(loaded[name]))
                if self._working:
                    group.states[name].encode(values, self._seed(group) * 2 + (name == "exp_avg_sq"), self._bits)
            for e in group.entries:
                loaded = state_dict["state"].get(by_param[e.param], {})
                if e.step is not None and "step" in loaded:
                    e.step.copy_(loaded["step"])
                if e.has_master:  # the model was loaded first (set_state_dict): its values, or the saved master
                    e.master.copy_(_local(loaded["master"]) if "master" in loaded else _local(e.param.detach()))
        for group, saved_group in zip(self.param_groups, state_dict["param_groups"]):
            group.update({k: v for k, v in saved_group.items() if k != "params"})

    def exact_state(self) -> dict[str, list[torch.Tensor]]:
        """The compressed store as it is: kept beside a checkpoint so that resuming on the same
        layout continues bit for bit (re-quantising decompressed int8 values need not give the
        same codes)."""
        return {group.name: [t for state in group.states.values() for t in state.tensors()] for group in self.groups}

    @torch.no_grad()
    def load_exact_state(self, saved: dict[str, list[torch.Tensor]]) -> None:
        for group in self.groups:
            for mine, theirs in zip((t for state in group.states.values() for t in state.tensors()), saved[group.name]):
                mine.copy_(theirs)


class OptimizerSet:
    """Optimizers stepped as one: a device optimizer for the states kept on the GPU and the
    host optimizer; checkpoints take their list (torch.distributed.checkpoint accepts one)."""

    def __init__(self, members: list[torch.optim.Optimizer]):
        self.members = members

    def step(self) -> None:
        for member in self.members:  # the device's first: its kernels run while the CPU steps
            member.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for member in self.members:
            member.zero_grad(set_to_none=set_to_none)


def members(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers behind the runtime's optimizer (a set, ZeRO's local one, or itself)."""
    found = optimizer.members if isinstance(optimizer, OptimizerSet) else [optimizer]
    return [getattr(m, "optim", m) for m in found]


def host_optimizer(optimizer) -> HostOptimizer | None:
    return next((m for m in members(optimizer) if isinstance(m, HostOptimizer)), None)
