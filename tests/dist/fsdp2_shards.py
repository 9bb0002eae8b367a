"""Under torchrun (gloo, CPU): build a model with shardplan's parameter names and shapes,
apply FSDP2 `fully_shard` (each transformer block, then the root, as `shardplan run` does)
and write what this rank really holds of every parameter to OUT_DIR/rank<R>.json:
the local shard's shape (`DTensor.to_local().shape`) and the bytes of its storage
(`untyped_storage().nbytes()`, which includes FSDP2's padding rows).

usage: torchrun --standalone --nproc_per_node 3 tests/dist/fsdp2_shards.py SHAPE_JSON OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from shardplan.core.params import model_params
from shardplan.spec.model import resolve_shape


def build(params) -> nn.Module:
    """Nested modules whose parameters carry exactly the planner's dotted names."""
    root = nn.Module()
    for info in params:
        *path, leaf = info.name.split(".")
        module = root
        for part in path:
            child = module._modules.get(part)
            if child is None:
                child = nn.Module()
                module.add_module(part, child)
            module = child
        module.register_parameter(leaf, nn.Parameter(torch.randn(info.shape)))
    return root


def main() -> None:
    table, out_dir = json.loads(sys.argv[1]), sys.argv[2]
    shape, problems = resolve_shape(table)
    assert shape is not None, problems
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = build(model_params(shape))
    for block in model.layers.children():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    report = {}
    for name, param in model.named_parameters():
        local = param.to_local()
        report[name] = {
            "local_shape": list(local.shape),
            "storage_bytes": local.untyped_storage().nbytes(),
            "element_bytes": local.element_size(),
        }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w", encoding="utf-8") as handle:
        json.dump(report, handle)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
