"""Under torchrun (gloo, CPU): `shardplan run JOB` with a probe at the first gradient
reduction of each step, where torch's pipeline schedules hand FSDP2 back its resharding and
its reduce-scatter (`_PipelineStageBase.perform_reduce_grad`, torch/distributed/pipelining/
stage.py). Just before it runs, the probe reads over every FSDP2 parameter of every stage
this rank holds what torch keeps:

- "gathered": bytes of the all-gather outputs still allocated (the unsharded parameters;
  a resharded parameter's storage is resized to 0 bytes);
- "unsharded_grads": bytes of the unsharded gradients waiting for the reduction
  (`unsharded_accumulated_grad` in the reduce dtype, or the unsharded parameter's `.grad`
  when that is already the reduce dtype);
- "sharded_grads": bytes of the sharded gradients (`.grad` of the sharded parameters).

Around every forward of a stage it also reads the gathered bytes ("gathered_before_forward",
"gathered_after_forward": the largest of the step), which show what a forward finds gathered
from the backward before it and what it reshards. The last step's figures go to
OUT_DIR/rank<R>.json.

usage: torchrun --standalone --nproc_per_node N tests/dist/deferred_reduction.py OUT_DIR JOB [run flags]
"""

from __future__ import annotations

import json
import os
import sys

from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.pipelining import stage as pipeline_stage

STAGES: list = []
CALLS = [0]
FORWARDS = {"gathered_before_forward": 0, "gathered_after_forward": 0}
_init = pipeline_stage._PipelineStageBase.__init__
_reduce = pipeline_stage._PipelineStageBase.perform_reduce_grad
_forward = pipeline_stage._PipelineStageBase.forward_one_chunk


def _register(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    STAGES.append(self)


def _storage_bytes(tensor) -> int:
    if tensor is None:
        return 0
    if hasattr(tensor, "to_local"):
        tensor = tensor.to_local()
    return tensor.untyped_storage().nbytes()


def held() -> dict[str, int]:
    found = {"gathered": 0, "unsharded_grads": 0, "sharded_grads": 0}
    for stage in STAGES:
        for module in stage.submod.modules():
            if not isinstance(module, FSDPModule):
                continue
            group = fully_shard.state(module)._fsdp_param_group
            for param in group.fsdp_params if group is not None else ():
                found["gathered"] += sum(t.untyped_storage().nbytes() for t in param.all_gather_outputs)
                found["unsharded_grads"] += _storage_bytes(param.unsharded_accumulated_grad)
                if hasattr(param, "_unsharded_param"):
                    found["unsharded_grads"] += _storage_bytes(param._unsharded_param.grad)
                found["sharded_grads"] += _storage_bytes(param.sharded_param.grad)
    return found


def _probe(self, grad_scale_factor):
    if CALLS[0] % len(STAGES) == 0:  # the rank's first reduction of this step
        path = os.path.join(OUT, f"rank{os.environ['RANK']}.json")
        with open(path, "w", encoding="utf-8") as out:
            json.dump({**held(), **FORWARDS}, out)
        FORWARDS.update(dict.fromkeys(FORWARDS, 0))
    CALLS[0] += 1
    return _reduce(self, grad_scale_factor)


def _around_forward(self, *args, **kwargs):
    FORWARDS["gathered_before_forward"] = max(FORWARDS["gathered_before_forward"], held()["gathered"])
    output = _forward(self, *args, **kwargs)
    FORWARDS["gathered_after_forward"] = max(FORWARDS["gathered_after_forward"], held()["gathered"])
    return output


if __name__ == "__main__":
    OUT = sys.argv[1]
    pipeline_stage._PipelineStageBase.__init__ = _register
    pipeline_stage._PipelineStageBase.perform_reduce_grad = _probe
    pipeline_stage._PipelineStageBase.forward_one_chunk = _around_forward
    from shardplan.cli.app import main_exit

    sys.argv = ["shardplan", "run", *sys.argv[2:]]
    main_exit()
