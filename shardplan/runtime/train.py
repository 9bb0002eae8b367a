"""`shardplan run` on one rank: build the planned model, train it, measure it, report.

Every decision (layer split, schedule, resident layers under offload, shard sizes) comes from
`shardplan.core`, the same functions `shardplan estimate` uses; this module only executes.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor.parallel import loss_parallel

from ..core.buffers import allowances_in
from ..core.estimate import DeviceEstimate
from ..core.estimate_inputs import EstimateInputs
from ..core.flops import model_flops_per_token
from ..core.precision import uses_autocast
from ..core.timeline import BACKWARD, BACKWARD_END, FORWARD, LOSS, STEP
from ..io.job import ResolvedJob
from ..spec.errors import RunFailure
from . import data as data_mod
from .dist import Runtime
from .lora import add_adapters
from .measure import CudaMemory, SavedTensorTracker, placement_bytes
from .model import Transformer, loss_fn
from .offload import host_optimizer, members
from .parallel import (COMPUTE_DTYPES, ParallelPlan, build_optimizer, host_parameters, offloaded_block, parallelize,
                       unwrapped)
from .pipeline import build_schedule, build_stages

# The GPU preset (presets/gpus/) of each device name torch reports, most specific first:
# its datasheet peak is MFU's denominator when the job's [cluster] names no hardware.
DEVICE_PRESETS = (("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("H200", "h200"), ("B200", "b200"),
                  ("A100-SXM4-40GB", "a100-sxm-40gb"), ("A100", "a100-sxm-80gb"), ("V100", "v100-sxm2-32gb"),
                  ("L40S", "l40s"), ("MI300X", "mi300x"))


def build_model(resolved: ResolvedJob) -> nn.Module:
    """The whole model on the meta device: no memory until `parallelize` materializes it a
    block at a time (runtime/model.py `materialize`)."""
    job = resolved.job
    try:
        with torch.device("meta"):
            model = Transformer(resolved.shape, dropout=job.model.dropout, attention=job.train.attention)
    except ValueError as exc:
        raise RunFailure(str(exc)) from None
    if job.lora is not None:
        add_adapters(model, job.lora)
    return model


def _autocast(runtime: Runtime, plan: ParallelPlan):
    """DDP runs (ZeRO stage 1) keep fp32 parameters and compute in 16 bits under autocast."""
    if not uses_autocast("fsdp2", plan.zero_stage, plan.precision):
        return contextlib.nullcontext()
    return torch.autocast(runtime.device.type, dtype=COMPUTE_DTYPES[plan.precision])


class Trainer:
    """Owns the model(s), optimizer, data and the per-step work of one rank."""

    def __init__(self, resolved: ResolvedJob, runtime: Runtime, decided: EstimateInputs, resident: int):
        """`decided` (what is offloaded) and `resident` (layers of this rank kept on the GPU,
        over all its chunks) are the estimate's decision for this rank
        (core.memory.estimate_memory)."""
        self.resolved, self.runtime = resolved, runtime
        job = resolved.job
        par = job.parallel
        self.coords = runtime.coords()
        self.plan = ParallelPlan(
            zero_stage=job.zero.stage, precision=job.train.precision, optimizer=job.train.optimizer,
            lr=job.train.lr, recompute=job.train.activation_checkpointing, resident_layers=resident,
            offload_params=decided.offload_params, prefetch_layers=job.offload.prefetch_layers,
            offload_optimizer=decided.offload_optimizer, offload_grads=decided.offload_grads,
            compression=decided.compression,
            pin_memory=job.offload.pin_memory, sequence_parallel=par.sequence_parallel and par.tp > 1,
            seed=job.train.seed, tied_head=resolved.shape.tie_embeddings and par.pp > 1, lora=job.lora,
        )
        self.batching = data_mod.Batching(par.dp, par.micro_batch_size, par.num_microbatches, job.train.seq_len)
        self.source = self._source()
        full = build_model(resolved)
        self.pp = par.pp
        self.tp = par.tp
        self.schedule_name = None
        if self.pp > 1:
            stages = build_stages(full, par.pp, par.virtual_stages, self.coords["pp"],
                                  (par.first_stage_layers, par.last_stage_layers))
            self.modules = []
            left = resident  # the rank's resident layers, its first chunks' first
            for index, module in stages:
                kept = min(len(module.layers), left)
                left -= kept
                self.modules.append((index, parallelize(module, runtime, replace(self.plan, resident_layers=kept))))
            self.schedule, self.schedule_name = build_schedule(
                par.pipeline_schedule, self.modules, par.pp * par.virtual_stages, par.num_microbatches,
                runtime.device, runtime.group("pp"), self._loss,
            )
            self.model = None
        else:
            self.model = parallelize(full, runtime, self.plan)
            self.modules = [(0, self.model)]
        self.params = [p for _, m in self.modules for p in m.parameters()]
        self.optimizer = build_optimizer([m for _, m in self.modules], runtime, self.plan)
        self.engine = host_optimizer(self.optimizer)
        self.on_host = host_parameters([m for _, m in self.modules])
        self.embedding_group = self._embedding_group()

    # -- data ----------------------------------------------------------------------------
    def _source(self):
        job = self.resolved.job
        vocab, seq, seed = self.resolved.shape.vocab_size, job.train.seq_len, job.train.seed
        if job.data.path:
            return data_mod.FileTokens(self.resolved.data_file or job.data.path, job.data.dtype, vocab, seq, seed)
        return data_mod.SyntheticTokens(vocab, seq, seed)

    def _local_batch(self, step: int, microbatches: range) -> tuple[torch.Tensor, torch.Tensor]:
        indices = [i for mb in microbatches for i in self.batching.indices(step, mb, self.coords["dp"])]
        return data_mod.batch(self.source, indices, self.runtime.device)

    # -- loss and tied embeddings ----------------------------------------------------------
    def _loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits, targets)

    def _loss_context(self):
        """Vocabulary-parallel cross entropy: forward and backward both run inside it."""
        return loss_parallel() if self.tp > 1 else contextlib.nullcontext()

    def _embedding_group(self):
        """Tied embeddings over several stages: the first and last stage of each pipeline sum
        their two copies' gradients (Megatron-LM's embedding group)."""
        shape = self.resolved.shape
        if self.pp == 1 or not shape.tie_embeddings:
            return None
        mine = None
        for ranks in self.runtime.layout.groups("embedding"):
            group = dist.new_group(ranks)
            if self.runtime.rank in ranks:
                mine = group
        return mine

    def _sync_tied_embeddings(self) -> None:
        if self.embedding_group is None:
            return
        for _, module in self.modules:
            for name in ("embed", "lm_head"):
                part = getattr(unwrapped(module), name, None)
                if part is not None and part.weight.grad is not None:
                    grad = part.weight.grad
                    local = grad.to_local() if hasattr(grad, "to_local") else grad
                    dist.all_reduce(local, group=self.embedding_group)

    # -- one step ----------------------------------------------------------------------------
    def step(self, step: int, tracker: SavedTensorTracker | None, phases: CudaMemory | None = None) -> torch.Tensor:
        """One optimizer step over the global batch; returns this rank's loss contribution.
        With `phases` (CUDA, no pipeline), the allocator's peak of each phase is read."""
        self.optimizer.zero_grad(set_to_none=True)
        def phase(name: str | None) -> None:
            if phases is not None:
                phases.enter(name)

        def tracking():
            return tracker.tracking() if tracker else contextlib.nullcontext()

        m = self.batching.microbatches
        if self.pp > 1:
            tokens, targets = self._local_batch(step, range(m))
            losses: list[torch.Tensor] = []
            last = self.is_last_stage()
            with tracking(), self._loss_context():
                if self.is_first_stage():
                    self.schedule.step(tokens, target=targets if last else None, losses=losses)
                else:
                    self.schedule.step(target=targets if last else None, losses=losses)
            total = torch.stack([l.detach().float() for l in losses]).mean() if losses else torch.zeros(())
        else:
            total = torch.zeros((), device=self.runtime.device)
            for mb in range(m):
                tokens, targets = self._local_batch(step, range(mb, mb + 1))
                sync = self.model.no_sync() if hasattr(self.model, "no_sync") and mb < m - 1 else contextlib.nullcontext()
                if self.engine is not None:
                    self.engine.set_final_microbatch(mb == m - 1)
                with sync, tracking(), self._loss_context():
                    phase("forward")
                    with _autocast(self.runtime, self.plan):
                        logits = self.model(tokens)
                    loss = self._loss(logits, targets) / m
                    del logits  # backward needs only the log-probabilities (as torchtitan does)
                    phase("backward")
                    loss.backward()
                total = total + loss.detach().float()
        self._sync_tied_embeddings()
        phase("step")
        self.optimizer.step()
        phase(None)
        return total.to(self.runtime.device)

    def measure_states(self) -> dict[str, dict[str, int]]:
        """Bytes of parameters, gradients and optimizer states by placement (device / host)."""
        return placement_bytes(self.params, self.on_host, members(self.optimizer), self.engine)

    def resident_blocks(self) -> int:
        """Transformer blocks whose parameters stay on the device (not CPU-offloaded)."""
        return sum(not offloaded_block(block) for _, module in self.modules
                   for block in unwrapped(module).layers.values())

    # The rank's stage indices (core.stages.rank_chunks: rank r holds r, r + pp, ...) say
    # whether it holds the embedding (stage 0) and the head (the last stage).
    def is_first_stage(self) -> bool:
        return any(index == 0 for index, _ in self.modules)

    def is_last_stage(self) -> bool:
        last = self.pp * self.resolved.job.parallel.virtual_stages - 1 if self.pp > 1 else 0
        return any(index == last for index, _ in self.modules)


def global_loss(local: torch.Tensor, trainer: Trainer) -> float:
    """The step's loss over the whole global batch: last-stage ranks contribute, the others 0."""
    d = trainer.runtime.layout.degrees
    if hasattr(local, "full_tensor"):  # a DTensor loss under loss_parallel
        local = local.full_tensor()
    value = local.detach().float().reshape(()).clone() if trainer.is_last_stage() else torch.zeros((), device=local.device)
    dist.all_reduce(value)
    return float(value) / (d.dp * d.tp * d.cp)


def rank_estimates(device: DeviceEstimate, on_gpu: bool) -> dict[str, int]:
    """This rank's estimate (devices GPU + CPU together), and the peak to compare with what
    the rank measures: on a GPU, torch.cuda.max_memory_allocated against the peak moment less
    the allowances for the CUDA context and fragmentation, which the allocator does not count;
    on the CPU, where host and device memory are one, the process's growth from before the
    model is built against the larger of the start-up copy and the peak moment with the host
    terms beside it."""
    allowances = allowances_in(device.terms["gpu.buffers"])
    peak = device.gpu["total"] - sum(allowances.values())
    if not on_gpu:
        peak = max(sum(t.bytes for t in device.startup), peak + sum(t.bytes for t in device.host))
    return {
        "params": device.states["params"] + device.cpu["params"],
        "grads": device.states["grads"] + device.cpu["grads"],
        "optimizer": device.states["optimizer"] + device.cpu["optimizer"],
        "placement": {kind: {"device": device.states[kind], "host": device.cpu[kind]}
                      for kind in ("params", "grads", "optimizer")},
        "activations": device.saved_activations,
        "peak_device": peak,
        "peak_moment": device.peak_moment,
        "resident_layers": device.resident_layers,
        "allowances": allowances,
        "phases": estimated_phases(device),
    }


def estimated_phases(device: DeviceEstimate) -> dict[str, int]:
    """The estimate's moments as the phases a CUDA run reads its allocator's peak in
    (CudaMemory), allowances left out: the forward; the backward, which holds the loss
    moment, each layer's backward and the backward's end; the optimizer step."""
    totals = {m.name: m.total - sum(allowances_in(m.terms["buffers"]).values()) for m in device.moments}
    phases = {"forward": totals.get(FORWARD, 0),
              "backward": max(totals.get(name, 0) for name in (LOSS, BACKWARD, BACKWARD_END)),
              "step": totals.get(STEP, 0)}
    return {name: value for name, value in phases.items() if value}


def mfu(tokens_per_second: float, resolved: ResolvedJob, runtime: Runtime) -> float | None:
    """Model FLOPs utilisation on CUDA, as `estimate` defines it (core/flops.py: Megatron-LM's
    model FLOPs, causal attention counted half, no recomputation) against the peak of the
    job's hardware ([cluster] gpu / peak_tflops), else of the preset matching the device."""
    if not runtime.on_gpu:
        return None
    from ..io.hardware import hardware_of
    from ..io.job import load_job

    hardware = hardware_of(resolved.job.cluster)
    if hardware is None:
        name = torch.cuda.get_device_name(runtime.device)
        preset = next((preset for key, preset in DEVICE_PRESETS if key in name), None)
        if preset is None:
            return None
        hardware = hardware_of(load_job(None, [("cluster.gpu", preset)], env={}).job.cluster)
    job = resolved.job
    per_token = model_flops_per_token(resolved.shape, job.train.seq_len, frozen_weights=job.lora is not None)
    return tokens_per_second * per_token / (hardware.peak_for(job.train.precision) * runtime.world)
