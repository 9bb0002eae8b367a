"""Process group, device and DeviceMesh, built in the planner's rank order and checked
against the groups `shardplan layout` computes."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from ..core.degrees import Degrees
from ..core.layout import AXIS_GROUPS, Layout, hybrid_shard_groups, mesh_dims, shard_group_size
from ..spec.errors import RunFailure


@dataclass
class Runtime:
    """This process's place in the job."""

    rank: int
    world: int
    device: torch.device
    mesh: DeviceMesh
    layout: Layout
    dp_split: str | None = None  # "hybrid" | "replicate": a 2-D (dp_replicate, dp_shard) mesh

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def coords(self) -> dict[str, int]:
        return self.layout.coords(self.rank)

    def group(self, axis: str) -> dist.ProcessGroup:
        return self.mesh.get_group(axis)


def pick_device(local_rank: int) -> torch.device:
    """CUDA with NCCL where a GPU exists, else the CPU with gloo."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")


def _attempt_store(timeout: timedelta) -> dist.Store:
    """torchrun's store, with a prefix per restart attempt.

    torch 2.13's torchrun keeps one store across `--max-restarts` restarts, so a restarted
    worker would read the previous attempt's (dead) peer addresses and fail to connect; the
    prefix keeps each attempt's keys apart. The store itself is created as torchrun's own
    env:// rendezvous does (torch/distributed/rendezvous.py, `_create_c10d_store`).
    """
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(host, port, world, is_master=False, timeout=timeout)
    else:
        store = dist.TCPStore(host, port, world, is_master=rank == 0, timeout=timeout, multi_tenant=True)
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return dist.PrefixStore(f"shardplan/attempt-{attempt}", store)


def start(degrees: Degrees, order: str, gpus_per_node: int, timeout_s: float, dp_split: str | None = None) -> Runtime:
    """Join the process group and build the DeviceMesh in the planner's order.

    `dp_split` gives FSDP2 a 2-D data-parallel mesh (dp_replicate, dp_shard), flattened back
    into "dp" for the groups that span all of it: "hybrid" shards over the dp ranks of one node
    (HSDP), "replicate" shards over none (dp_shard = 1: ZeRO stage 0, every rank whole).
    """
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = pick_device(local_rank)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if not dist.is_initialized():
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(backend, timeout=timeout, store=_attempt_store(timeout), **kwargs,
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    rank, world = dist.get_rank(), dist.get_world_size()
    layout = Layout(degrees, order, gpus_per_node)
    dp_shard = None
    if dp_split == "hybrid":
        dp_shard = shard_group_size(layout, hybrid=True)
    elif dp_split == "replicate":
        dp_shard = 1
    names, shape = mesh_dims(order, degrees, dp_shard=dp_shard)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)
    if dp_shard is not None:
        mesh[("dp_replicate", "dp_shard")]._flatten("dp")
    runtime = Runtime(rank, world, device, mesh, layout, dp_split)
    check_mesh(runtime)
    return runtime


def _planned_split(layout: Layout, rank: int, dp_split: str) -> dict[str, list[int]]:
    if dp_split == "replicate":
        return {"dp_shard": [rank], "dp_replicate": layout.group_of("dp", rank)}
    shard_groups, replicate_groups = hybrid_shard_groups(layout)
    return {
        "dp_shard": next(g for g in shard_groups if rank in g),
        "dp_replicate": next(g for g in replicate_groups if rank in g),
    }


def check_mesh(runtime: Runtime) -> None:
    """Each rank's mesh groups must be the groups the planner computed."""
    planned_groups = {axis: runtime.layout.group_of(axis, runtime.rank) for axis in AXIS_GROUPS}
    if runtime.dp_split:
        planned_groups.update(_planned_split(runtime.layout, runtime.rank, runtime.dp_split))
    for axis, planned in planned_groups.items():
        mesh_group = sorted(dist.get_process_group_ranks(runtime.mesh.get_group(axis)))
        planned = sorted(planned)
        if mesh_group != planned:
            raise RunFailure(
                f"rank {runtime.rank}: the DeviceMesh {axis} group {mesh_group} differs from the "
                f"planned group {planned}"
            )


def stop(together: bool = True) -> None:
    """Leave the process group; `together` waits for every rank first (a rank tearing down
    while a peer still sends aborts the peer under gloo)."""
    if not dist.is_initialized():
        return
    try:
        if together:
            dist.barrier()
    finally:
        dist.destroy_process_group()
        # Gloo's worker threads may still be releasing the last collective's tensors; if the
        # interpreter finalises meanwhile the process aborts (pytorch/pytorch PR #179291).
        time.sleep(0.1)
