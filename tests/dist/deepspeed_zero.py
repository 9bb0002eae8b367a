"""Under torchrun (gloo, DeepSpeed's CPU accelerator): build the model of a shardplan job the
way `shardplan run` builds it (runtime/model.py `Transformer`: the parameter names `shardplan
shards` lists), hand it to real DeepSpeed at each ZeRO stage asked for with torch's AdamW over
two parameter groups (matrices, vectors: the weight-decay split shardplan's accounting
assumes), train, and write what DeepSpeed allocated on this rank to
OUT_DIR/<tag>_stage<S>_rank<R>.json.

ZeRO-3 (the model built inside `deepspeed.zero.Init`, as ZeRO-3 scripts do; two steps, since
the first records the module trace and releases even persistent parameters):
- per parameter: `ds_numel`, the partition `ds_tensor` (elements, element size), `ds_persist`
  after `zero.Init` and after `deepspeed.initialize` (which marks them), and what `param.data`
  holds after `zero.Init`;
- the parameters held whole after each forward and each step;
- the elements of non-persistent parameters held whole (gathered or in flight) after each
  forward and at their peak over each step (after every fetch and release of the coordinator);
- the optimizer's buffers: the 16-bit and fp32 partitions (one per sub-group), the gradient
  partitions' flat buffer, the IPG bucket(s) and AdamW's moments.

BF16_Optimizer (stage 1 with bf16 and data_types.grad_accum_dtype fp32): its flat bf16
parameters, fp32 partitions, AdamW's moments, the fp32 gradient-accumulation buffers, what
gradients are alive as the optimizer steps, and the copies of the engine's all-reduce.

ZeRO-1/2 (the model built plainly; one step): each group's flat 16-bit buffer (padded), this
rank's fp32 master partitions, AdamW's moments, and when backward ends `grads_in_partition`
and the IPG bucket buffers; with offload_optimizer, ZeRO-Offload's host buffers.

Every stage: the copies its gradient reductions make in backward (`Copies`).

usage: torchrun --standalone --nproc_per_node 2 tests/dist/deepspeed_zero.py OUT_DIR RUNS_JSON
RUNS_JSON: [{"tag": ..., "job": JOB_TOML, "stages": [3, 2, 1], "zero_optimization": {...}}, ...];
the DeepSpeed config of each stage is `shardplan export JOB --to deepspeed --zero S`, its
"zero_optimization" updated by the run's (keys shardplan has no setting for), without its
"optimizer" section: torch's AdamW is passed instead (DeepSpeedCPUAdam compiles an op).
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import sys

import torch

import deepspeed
from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator
from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

from shardplan.cli.app import main as shardplan_main
from shardplan.io.job import load_job
from shardplan.runtime.model import Transformer, loss_fn

# DeepSpeed's torch backend JIT-compiles its shared-memory all-reduce op (ShareMemCommBuilder,
# deepspeed/comm/torch.py `build_shm_op`) on first use: about 45 s with a C++ compiler, and it
# serves only `inference_all_reduce`. Without it the backend is plain torch.distributed (gloo);
# nothing ZeRO allocates depends on it. (The module by path: `deepspeed.comm.torch` as an
# attribute is torch itself, which deepspeed/comm/__init__.py re-exports.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


class Gathered:
    """The elements of non-persistent parameters held whole (gathered, or in flight: an
    all-gather's output is allocated when it is launched) right after every fetch and release
    of the ZeRO-3 coordinator, and their peak."""

    params: list = []
    peak = 0

    @classmethod
    def now(cls) -> int:
        return sum(int(p.data.numel()) for p in cls.params if not p.ds_persist)

    @classmethod
    def wrap(cls, method):
        def wrapped(self, *args, **kwargs):
            result = method(self, *args, **kwargs)
            cls.peak = max(cls.peak, cls.now())
            return result
        return wrapped


PartitionedParameterCoordinator.fetch_sub_module = Gathered.wrap(PartitionedParameterCoordinator.fetch_sub_module)
PartitionedParameterCoordinator.release_sub_module = Gathered.wrap(PartitionedParameterCoordinator.release_sub_module)


class BackwardEnd:
    """ZeRO-1/2 gradient buffers as they are when backward ends, just before
    `_release_ipg_buffers` frees them (stage_1_and_2.py 923-932): `grads_in_partition`
    (allocated at the first gradient copied into it, line 2192) and the IPG bucket buffers."""

    seen: dict = {}  # the last backward's (the constructor calls it too, line 619)

    @classmethod
    def wrap(cls, method):
        def wrapped(self, *args, **kwargs):
            held = getattr(self, "grads_in_partition", None)
            cpu = getattr(self, "accumulated_grads_in_cpu", {})
            cls.seen = {
                **cls.seen,
                "grads_in_partition": None if held is None else int(held.numel()),
                "grads_element_size": None if held is None else held.element_size(),
                "ipg_buffers": [int(t.numel()) for bucket in self.ipg_buckets.values() for t in bucket.buffer],
                "accumulated_grads_in_cpu": sorted(int(t.numel()) for t in cpu.values()),
            }
            return method(self, *args, **kwargs)
        return wrapped

    @classmethod
    def storages(cls, method):
        """At the epilogue's start (stage 2), the storages of gradient buffers held, in bytes:
        this microbatch's grads_in_partition and, when accumulating, the earlier one that
        `all_grad_tensors` still views (lines 1036-1045)."""
        def wrapped(self, *args, **kwargs):
            storages = {}
            for tensors in getattr(self, "all_grad_tensors", {}).values():
                for t in tensors or []:
                    storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            held = getattr(self, "grads_in_partition", None)
            if held is not None:
                storages[held.untyped_storage().data_ptr()] = held.untyped_storage().nbytes()
            cls.seen = {**cls.seen, "gradient_storages": sorted(storages.values())}
            return method(self, *args, **kwargs)
        return wrapped


DeepSpeedZeroOptimizer._release_ipg_buffers = BackwardEnd.wrap(DeepSpeedZeroOptimizer._release_ipg_buffers)
DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue = BackwardEnd.storages(
    DeepSpeedZeroOptimizer.independent_gradient_partition_epilogue)


class Copies:
    """The transient copies a gradient reduction makes, in elements, in call order: at ZeRO-1/2
    `allreduce_bucket` flattens the slices it reduces (stage_1_and_2.py 2367; a list of one
    tensor flattens to a view, two or more to a new tensor), at ZeRO-3 `reduce_scatter_coalesced`
    concatenates the padded partitions of the bucket's gradients (comm/coalesced_collectives.py
    122). Each entry: (elements copied or 0 for a view, elements of the tensors given)."""

    calls: list = []

    @classmethod
    def flatten(cls, method):
        def wrapped(tensors):
            out = method(tensors)
            given = sum(int(t.numel()) for t in tensors)
            shared = len(tensors) == 1 and out.data_ptr() == tensors[0].data_ptr()
            cls.calls.append((0 if shared else int(out.numel()), given))
            return out
        return wrapped

    @classmethod
    def concatenate(cls, instrument):
        def wrapped(fn):
            inner = instrument(fn)
            if fn is not torch.cat:
                return inner

            def cat(tensors, *args, **kwargs):
                out = inner(tensors, *args, **kwargs)
                cls.calls.append((int(out.numel()), sum(int(t.numel()) for t in tensors)))
                return out
            return cat
        return wrapped


_coalesced = importlib.import_module("deepspeed.runtime.comm.coalesced_collectives")
_coalesced.instrument_w_nvtx = Copies.concatenate(_coalesced.instrument_w_nvtx)


def exported_config(job: str, stage: int) -> dict:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        code = shardplan_main(["export", job, "--to", "deepspeed", "--zero", str(stage)])
    assert code == 0, f"shardplan export failed ({code})"
    config = json.loads(out.getvalue())
    config.pop("optimizer", None)
    # torch's AdamW instead of DeepSpeedCPUAdam (which compiles an op); allowed under ZeRO.
    config["zero_force_ds_cpu_optimizer"] = False
    config["zero_allow_untested_optimizer"] = True
    config["steps_per_print"] = 1 << 30
    return config


def whole(param) -> bool:
    return param.ds_status == ZeroParamStatus.AVAILABLE and param.data.numel() == param.ds_numel


def numels(tensors) -> list[int]:
    return [int(t.numel()) for t in tensors]


def moments(optimizer) -> dict:
    """AdamW's state tensors by name: element counts and element size."""
    found: dict[str, list[int]] = {}
    size = 0
    for state in optimizer.state.values():
        for key, value in state.items():
            if torch.is_tensor(value) and value.dim() > 0:
                found.setdefault(key, []).append(int(value.numel()))
                size = value.element_size()
    return {"numel": found, "element_size": size}


def weight_decay_groups(model) -> list[dict]:
    """Matrices, then vectors (biases, norms) without weight decay, each in module order: the
    split Megatron-LM and transformers' Trainer make, which shardplan's accounting assumes."""
    params = list(model.parameters())
    # Under zero.Init `param.data` is an empty 1-D tensor; `ds_shape` is the real shape.
    matrix = [len(getattr(p, "ds_shape", p.shape)) >= 2 for p in params]
    groups = [{"params": [p for p, m in zip(params, matrix) if m]},
              {"params": [p for p, m in zip(params, matrix) if not m], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def batch(resolved, rank: int):
    seq = resolved.job.train.seq_len
    micro = resolved.job.parallel.micro_batch_size
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, resolved.shape.vocab_size, (micro, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def stage3(resolved, config: dict, rank: int) -> dict:
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = Transformer(resolved.shape, dropout=resolved.job.model.dropout, attention=resolved.job.train.attention)
    params = dict(model.named_parameters())
    after_init = {
        name: {
            "shape": list(p.ds_shape),
            "ds_numel": int(p.ds_numel),
            "partition_numel": int(p.ds_tensor.numel()),
            "element_size": p.ds_tensor.element_size(),
            "persist": bool(p.ds_persist),
            "data_numel": int(p.data.numel()),
        }
        for name, p in params.items()
    }
    optimizer = torch.optim.AdamW(weight_decay_groups(model), lr=resolved.job.train.lr)
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    buffers = {
        "fp16_partitioned_groups_flat": numels(zero_opt.fp16_partitioned_groups_flat),
        "fp32_partitioned_groups_flat": numels(zero_opt.fp32_partitioned_groups_flat),
        "fp32_element_size": zero_opt.fp32_partitioned_groups_flat[0].element_size(),
        "grad_partitions_flat_buffer": int(zero_opt.grad_partitions_flat_buffer.numel()),
        "grad_element_size": zero_opt.grad_partitions_flat_buffer.element_size(),
        "ipg_buckets": {str(dtype): int(b.buffer.numel()) for dtype, b in zero_opt.ipg_buckets.items()
                        if b.buffer is not None},
    }
    if zero_opt.offload_optimizer:  # stage3.py 786-801, 1110-1176, 1337-1343, 888-911
        buffers["offload"] = {
            "fp32_device": sorted({str(t.device) for t in zero_opt.fp32_partitioned_groups_flat}),
            "grad_partitions_device": str(zero_opt.grad_partitions_flat_buffer.device),
            "fp32_grad_sub_groups": [int(t.grad.numel()) for t in zero_opt.fp32_partitioned_groups_flat],
            "fp32_grad_element_size": zero_opt.fp32_partitioned_groups_flat[0].grad.element_size(),
            "fp16_cpu_groups": numels(zero_opt.param_groups_fp16_flat_cpu_memory) if zero_opt.offload_param else [],
            "fp16_partitions_device": sorted({str(t.device) for t in zero_opt.fp16_partitioned_groups_flat}),
        }
    for name, p in params.items():  # marked by deepspeed.initialize (parameter_offload.py 317-329)
        after_init[name]["persist_after_initialize"] = bool(p.ds_persist)
    inputs, targets = batch(resolved, rank)
    whole_at, gathered = {}, {}
    Gathered.params = list(params.values())
    copies = {}
    for step in (1, 2):  # step 1 records the trace; step 2 runs as every later step does
        Gathered.peak = 0
        logits = engine(inputs)
        whole_at[f"forward{step}"] = sorted(name for name, p in params.items() if whole(p))
        gathered[f"after_forward{step}"] = Gathered.now()
        Copies.calls = []
        engine.backward(loss_fn(logits, targets))
        copies[f"backward{step}"] = list(Copies.calls)
        engine.step()
        gathered[f"peak{step}"] = Gathered.peak
        whole_at[f"step{step}"] = sorted(name for name, p in params.items() if whole(p))
    return {"params": after_init, "buffers": buffers, "moments": moments(zero_opt.optimizer), "whole": whole_at,
            "gathered": gathered, "copies": copies}


def stage12(resolved, config: dict, rank: int) -> dict:
    model = Transformer(resolved.shape, dropout=resolved.job.model.dropout, attention=resolved.job.train.attention)
    optimizer = torch.optim.AdamW(weight_decay_groups(model), lr=resolved.job.train.lr)
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inputs, targets = batch(resolved, rank)
    BackwardEnd.seen = {}
    zero_opt.flatten = Copies.flatten(zero_opt.flatten)
    backward_ends = []
    for _ in range(config.get("gradient_accumulation_steps", 1)):  # engine.step() steps at the boundary
        logits = engine(inputs)
        Copies.calls, BackwardEnd.seen = [], {}
        engine.backward(loss_fn(logits, targets))
        # The gradients backward leaves in the parameters' .grad: bytes of their distinct
        # storages (views into grads_in_partition count that buffer once).
        storages = {p.grad.untyped_storage().data_ptr(): p.grad.untyped_storage().nbytes()
                    for p in model.parameters() if p.grad is not None}
        backward_ends.append({**BackwardEnd.seen, "param_grad_bytes": sum(storages.values()),
                              "param_grads": sum(1 for p in model.parameters() if p.grad is not None)})
        copies = list(Copies.calls)
        engine.step()
    at_backward_end = backward_ends[0]
    offload = None
    if zero_opt.cpu_offload:  # ZeRO-Offload's host buffers (stage_1_and_2.py 560-575, 653-661, 934-942)
        fp32 = zero_opt.single_partition_of_fp32_groups
        offload = {
            "devices": sorted({str(t.device) for t in fp32}),
            "fp32_grad": [int(t.grad.numel()) for t in fp32],
            "fp32_grad_element_size": fp32[0].grad.element_size(),
            "bit16_staging": numels(zero_opt.param_buffer_of_bit16_for_cpu_offload_groups),
            "bit16_staging_element_size": zero_opt.param_buffer_of_bit16_for_cpu_offload_groups[0].element_size(),
            "temp_grad_buffer_for_cpu_offload": int(zero_opt.temp_grad_buffer_for_cpu_offload.numel()),
            "temp_grad_buffer_for_gpu_offload": int(zero_opt.temp_grad_buffer_for_gpu_offload.numel()),
            "temp_element_size": zero_opt.temp_grad_buffer_for_gpu_offload.element_size(),
        }
    return {
        "offload": offload,
        "backward_end": at_backward_end,
        "backward_ends": backward_ends,
        "copies": copies,
        "group_numel": [sum(int(p.numel()) for p in g) for g in zero_opt.bit16_groups],
        "bit16_groups_flat": numels(zero_opt.bit16_groups_flat),
        "bit16_element_size": zero_opt.bit16_groups_flat[0].element_size(),
        "single_partition_of_fp32_groups": numels(zero_opt.single_partition_of_fp32_groups),
        "fp32_element_size": zero_opt.single_partition_of_fp32_groups[0].element_size(),
        "moments": moments(zero_opt.optimizer),
    }


def bf16_optimizer(resolved, config: dict, rank: int) -> dict:
    """BF16_Optimizer (stage 1, bf16, data_types.grad_accum_dtype fp32): its flat buffers, the
    gradients alive when the step starts, and the copies the engine's all-reduce makes."""
    model = Transformer(resolved.shape, dropout=resolved.job.model.dropout, attention=resolved.job.train.attention)
    optimizer = torch.optim.AdamW(weight_decay_groups(model), lr=resolved.job.train.lr)
    engine, bf16, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inputs, targets = batch(resolved, rank)
    engine.flatten = Copies.flatten(engine.flatten)
    seen = {}
    real_step = bf16.optimizer.step

    def step(*args, **kwargs):
        masters = [p for g in bf16.optimizer.param_groups for p in g["params"]]
        buffers = {t.untyped_storage().data_ptr() for t in bf16.fp32_groups_gradients_flat}
        seen["master_grads_at_step"] = [masters[0].grad.element_size(), sum(p.grad.numel() for p in masters)]
        seen["master_grads_are_buffer_views"] = all(p.grad.untyped_storage().data_ptr() in buffers for p in masters)
        seen["lp_grads_at_step_bytes"] = sum(p.grad.numel() * p.grad.element_size()
                                             for p in model.parameters() if p.grad is not None)
        return real_step(*args, **kwargs)

    bf16.optimizer.step = step
    copies = []
    for _ in range(config["gradient_accumulation_steps"]):  # engine.step() steps at the boundary
        logits = engine(inputs)
        Copies.calls = []
        engine.backward(loss_fn(logits, targets))
        copies += Copies.calls
        engine.step()
    state = bf16.optimizer.state
    return {
        "optimizer": type(bf16).__name__,
        "copies": copies,
        "bf16_groups_flat": [bf16.bf16_groups_flat[0].element_size(), numels(bf16.bf16_groups_flat)],
        "fp32_groups_flat_partition": [bf16.fp32_groups_flat_partition[0].element_size(),
                                       numels(bf16.fp32_groups_flat_partition)],
        "adam_moments_bytes": sum(v.numel() * v.element_size() for s in state.values() for k, v in s.items()
                                  if k in ("exp_avg", "exp_avg_sq")),
        "fp32_groups_gradients_flat": [bf16.fp32_groups_gradients_flat[0].element_size(),
                                       numels(bf16.fp32_groups_gradients_flat)],
        **seen,
    }


def stage0(resolved, config: dict, rank: int) -> dict:
    """No ZeRO: the engine all-reduces every gradient after backward (`allreduce_gradients`)."""
    model = Transformer(resolved.shape, dropout=resolved.job.model.dropout, attention=resolved.job.train.attention)
    optimizer = torch.optim.AdamW(weight_decay_groups(model), lr=resolved.job.train.lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inputs, targets = batch(resolved, rank)
    engine.flatten = Copies.flatten(engine.flatten)
    logits = engine(inputs)
    Copies.calls = []
    engine.backward(loss_fn(logits, targets))
    copies = list(Copies.calls)
    engine.step()
    return {"copies": copies, "numel": sum(int(p.numel()) for p in model.parameters()),
            "optimizer": type(engine.optimizer).__name__}


def main() -> None:
    out_dir, runs = sys.argv[1], json.loads(sys.argv[2])
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    for run in runs:
        resolved = load_job(run["job"], world=world)
        for stage in run["stages"]:
            torch.manual_seed(resolved.job.train.seed)
            config = exported_config(run["job"], stage)
            config["zero_optimization"].update(run.get("zero_optimization", {}))
            run_stage = stage3 if stage == 3 else stage12 if stage else stage0
            if stage == 1 and config.get("data_types", {}).get("grad_accum_dtype") == "fp32" and "bf16" in config:
                run_stage = bf16_optimizer
            report = run_stage(resolved, config, rank)
            report["world"], report["config"] = world, config
            path = os.path.join(out_dir, f"{run['tag']}_stage{stage}_rank{rank}.json")
            with open(path, "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1)
            deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
