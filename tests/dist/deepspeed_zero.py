"""Under torchrun (gloo, DeepSpeed's CPU accelerator): build shardplan's model of a job the way
`shardplan run` builds it (runtime/model.py `Transformer`, parameter names as `shardplan
shards` lists them), hand it to real DeepSpeed at each ZeRO stage asked for, take one training
step (forward, backward, step) with torch's AdamW, and write what DeepSpeed allocated on this
rank to a JSON file per job and stage.

ZeRO-3 (the model is built inside `deepspeed.zero.Init`, as ZeRO-3 training scripts do):
- per parameter, after `zero.Init`: `ds_numel`, the partition `ds_tensor` (elements, element
  size), `ds_persist`, and how many elements `param.data` still holds;
- per parameter, after the forward and after the step: whether it is gathered whole
  (`ds_status` AVAILABLE with `data.numel() == ds_numel`);
- the optimizer's buffers: the 16-bit partitions, the fp32 master partitions, the gradient
  partitions' flat buffer, the IPG bucket(s) and AdamW's moments.

ZeRO-1/2 (a model built without `zero.Init`, parameters in two optimizer groups, matrices and
vectors, as shardplan's accounting assumes): each group's flat 16-bit buffer (padded), this
rank's fp32 master partition and AdamW's moments, and the IPG bucket(s).

usage: torchrun --standalone --nproc_per_node 2 tests/dist/deepspeed_zero.py OUT_DIR JOB STAGES [JOB STAGES ...]
(STAGES: comma-separated, e.g. 3,2; reports go to OUT_DIR/<job stem>_stage<S>_rank<R>.json; the
DeepSpeed config is `shardplan export JOB --to
deepspeed` at that stage, without its "optimizer" section: torch's AdamW is passed instead.)
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

from shardplan.cli.app import main as shardplan_main
from shardplan.io.job import load_job
from shardplan.runtime.model import Transformer, loss_fn

# DeepSpeed's torch backend JIT-compiles its shared-memory all-reduce op (ShareMemCommBuilder,
# deepspeed/comm/torch.py `build_shm_op`) on first use: about 45 s with a C++ compiler, and it
# serves only `inference_all_reduce`. Without it the backend is plain torch.distributed (gloo);
# nothing ZeRO allocates depends on it. (The module by path: `deepspeed.comm.torch` as an
# attribute is torch itself, which deepspeed/comm/__init__.py re-exports.)
importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


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


def batch(resolved, rank: int):
    seq = resolved.job.train.seq_len
    micro = resolved.job.parallel.micro_batch_size
    generator = torch.Generator().manual_seed(rank)
    tokens = torch.randint(0, resolved.shape.vocab_size, (micro, seq + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


def stage3(resolved, job: str, rank: int) -> dict:
    config = exported_config(job, 3)
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
    optimizer = torch.optim.AdamW(model.parameters(), lr=resolved.job.train.lr)
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
    for name, p in params.items():  # marked by deepspeed.initialize (parameter_offload.py 317-329)
        after_init[name]["persist_after_initialize"] = bool(p.ds_persist)
    inputs, targets = batch(resolved, rank)
    whole_at = {}
    for step in (1, 2):  # step 1 records the trace; step 2 runs as every later step does
        logits = engine(inputs)
        whole_at[f"forward{step}"] = sorted(name for name, p in params.items() if whole(p))
        engine.backward(loss_fn(logits, targets))
        engine.step()
        whole_at[f"step{step}"] = sorted(name for name, p in params.items() if whole(p))
    return {"params": after_init, "buffers": buffers, "moments": moments(zero_opt.optimizer), "whole": whole_at}


def stage12(resolved, job: str, stage: int, rank: int) -> dict:
    config = exported_config(job, stage)
    model = Transformer(resolved.shape, dropout=resolved.job.model.dropout, attention=resolved.job.train.attention)
    named = list(model.named_parameters())
    groups = [{"params": [p for _, p in named if p.dim() >= 2]},
              {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=resolved.job.train.lr)
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    inputs, targets = batch(resolved, rank)
    engine.backward(loss_fn(engine(inputs), targets))
    engine.step()
    return {
        "group_numel": [sum(int(p.numel()) for p in g) for g in zero_opt.bit16_groups],
        "bit16_groups_flat": numels(zero_opt.bit16_groups_flat),
        "bit16_element_size": zero_opt.bit16_groups_flat[0].element_size(),
        "single_partition_of_fp32_groups": numels(zero_opt.single_partition_of_fp32_groups),
        "fp32_element_size": zero_opt.single_partition_of_fp32_groups[0].element_size(),
        "moments": moments(zero_opt.optimizer),
    }


def main() -> None:
    out_dir, runs = sys.argv[1], sys.argv[2:]
    deepspeed.init_distributed(dist_backend="gloo")
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    for job, stages in zip(runs[::2], runs[1::2]):
        resolved = load_job(job, world=world)
        tag = os.path.splitext(os.path.basename(job))[0]
        for stage in (int(s) for s in stages.split(",")):
            torch.manual_seed(resolved.job.train.seed)
            report = stage3(resolved, job, rank) if stage == 3 else stage12(resolved, job, stage, rank)
            report["world"] = world
            with open(os.path.join(out_dir, f"{tag}_stage{stage}_rank{rank}.json"), "w", encoding="utf-8") as handle:
                json.dump(report, handle, indent=1)
            deepspeed.comm.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
