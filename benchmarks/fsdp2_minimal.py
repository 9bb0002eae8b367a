"""The training loop a user would write by hand with FSDP2: the baseline of bench_run.py.

Same model class and weights as `shardplan run` (`shardplan.runtime.model`: `Transformer`,
`init_weights`, `loss_fn`) and the same global batch (`shardplan.runtime.data`, indices from
`Batching`), read from the same job file, so both runs compute the same losses. Everything
else is the plain recipe: `fully_shard` per block then the root, AdamW, a loop that times
each step. Batches are built before the loop, as a DataLoader would prefetch them.

Only what this baseline mirrors is accepted: dp only (tp = pp = cp = 1), ZeRO stage 2 or 3,
no activation checkpointing, no offload, synthetic data.

usage: torchrun --standalone --nproc_per_node=DP benchmarks/fsdp2_minimal.py JOB \
           [--set section.key=value ...] [--out steps.json] [--prefetch N]
Rank 0 writes {"steps": [{"step", "seconds", "loss"}], ...} to --out (loss: global mean).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from shardplan.io.job import load_job
from shardplan.io.overrides import parse_set
from shardplan.runtime import data as data_mod
from shardplan.runtime.model import Transformer, init_weights, loss_fn

COMPUTE_DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def unsupported(job) -> list[str]:
    par = job.parallel
    reasons = []
    if (par.tp, par.pp, par.cp) != (1, 1, 1):
        reasons.append(f"tp={par.tp} pp={par.pp} cp={par.cp} (dp only)")
    if job.zero.stage not in (2, 3):
        reasons.append(f"zero.stage={job.zero.stage} (2 or 3)")
    if job.train.activation_checkpointing != "none":
        reasons.append(f"activation_checkpointing={job.train.activation_checkpointing}")
    if job.offload.params or job.offload.optimizer:
        reasons.append("offload")
    if job.data.path:
        reasons.append("data.path (synthetic data only)")
    if job.train.optimizer != "adamw":
        reasons.append(f"optimizer={job.train.optimizer}")
    return reasons


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("job", help="job file or job preset, as for `shardplan run`")
    parser.add_argument("--set", dest="sets", action="append", default=[], help="section.key=value")
    parser.add_argument("--out", help="rank 0 writes the per-step JSON here")
    parser.add_argument("--prefetch", type=int, default=0,
                        help="explicit forward/backward prefetch of N blocks (0: FSDP2's default)")
    args = parser.parse_args()

    resolved = load_job(args.job, [parse_set(s) for s in args.sets])
    job, shape = resolved.job, resolved.shape
    reasons = unsupported(job)
    if reasons:
        sys.exit(f"fsdp2_minimal.py does not mirror: {'; '.join(reasons)}")

    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != job.parallel.dp:
        sys.exit(f"the job has dp={job.parallel.dp}; start {job.parallel.dp} processes, not {world}")
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("dp",))
    try:
        seconds, losses = train(job, shape, mesh, device, rank, args.prefetch)
        # The global loss once, after the timed loop: one all_reduce for all steps.
        stacked = torch.stack(losses)
        dist.all_reduce(stacked)
        stacked = (stacked / world).tolist()
        dist.barrier()
    finally:
        dist.destroy_process_group()
        # Let gloo's worker threads drop the last collectives before the interpreter exits:
        # seen here 1 launch in ~15, a pt_gloo_runloop thread still freeing the barrier's
        # work needed the GIL during Py_FinalizeEx and the process aborted with "terminate
        # called without an active exception" (gdb backtrace; pytorch/pytorch#179291).
        time.sleep(0.1)
    if rank == 0:
        report = {"world_size": world, "device": device.type, "torch_version": torch.__version__,
                  "steps": [{"step": i + 1, "seconds": s, "loss": l} for i, (s, l) in enumerate(zip(seconds, stacked))]}
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
        tail = sorted(seconds[1:] or seconds)
        print(f"fsdp2_minimal: {len(seconds)} steps, median {tail[len(tail) // 2]:.4f} s/step after the first, "
              f"loss {stacked[0]:.4f} -> {stacked[-1]:.4f}", file=sys.stderr)


def train(job, shape, mesh, device, rank: int, prefetch: int) -> tuple[list[float], list[torch.Tensor]]:
    """The hand-written part: build, shard, train; per-step seconds and local losses."""
    model = Transformer(shape, dropout=job.model.dropout, attention=job.train.attention)
    init_weights(model, job.train.seed)
    if job.train.precision == "bf16":
        model.to(torch.bfloat16)
    compute = COMPUTE_DTYPES.get(job.train.precision)
    mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32) if compute else MixedPrecisionPolicy()
    reshard = job.zero.stage == 3
    blocks = list(model.layers.values())
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    if prefetch:
        for i, block in enumerate(blocks):
            if blocks[i + 1:i + 1 + prefetch]:
                block.set_modules_to_forward_prefetch(blocks[i + 1:i + 1 + prefetch])
            if blocks[max(0, i - prefetch):i]:
                block.set_modules_to_backward_prefetch(blocks[max(0, i - prefetch):i][::-1])
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.train.lr)

    par = job.parallel
    batching = data_mod.Batching(par.dp, par.micro_batch_size, par.num_microbatches, job.train.seq_len)
    source = data_mod.SyntheticTokens(shape.vocab_size, job.train.seq_len, job.train.seed)
    steps, m = job.train.steps, par.num_microbatches
    batches = [[data_mod.batch(source, batching.indices(step, mb, rank), device) for mb in range(m)]
               for step in range(steps)]

    seconds, losses = [], []
    for step in range(steps):
        sync(device)
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        total = torch.zeros((), device=device)
        for tokens, targets in batches[step]:
            loss = loss_fn(model(tokens), targets) / m
            loss.backward()
            total += loss.detach().float()
        optimizer.step()
        sync(device)
        seconds.append(time.perf_counter() - start)
        losses.append(total)

    return seconds, losses


if __name__ == "__main__":
    main()
