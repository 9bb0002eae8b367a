"""Shard styles against torch's own code: torch.chunk, FSDP1's flat-parameter sharding, FSDP2's
`_chunk_with_empty`, and one real `fully_shard` run under torchrun (3 CPU ranks, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, run_cli
from shardplan.core.shards import chunk_rows, shard_ranges

torch = pytest.importorskip("torch")

# A tiny MoE model whose dims are not divisible by 3: hidden 20, head_dim 5 (one kv head:
# k/v are 5 x 20), ffn 44, vocab 50, and a 2-expert router (2 rows over 3 ranks: the last
# rank holds only padding).
TINY_SHAPE = {
    "family": "mixtral", "num_layers": 2, "hidden_size": 20, "num_heads": 4, "num_kv_heads": 1,
    "ffn_hidden_size": 44, "vocab_size": 50, "num_experts": 2,
}
NPROC = 3


def test_chunk_rows_match_torch_chunk():
    for size in range(0, 30):
        for parts in range(1, 9):
            pieces = [len(c) for c in torch.arange(size).chunk(parts)] if size else []
            pieces += [0] * (parts - len(pieces))  # FSDP2 pads the list with empty chunks
            assert chunk_rows(size, parts) == pieces, (size, parts)


def test_fsdp1_flat_parameter_shards_match_torch():
    """FSDP1 `FlatParamHandle._get_unpadded_shard` (torch/distributed/fsdp/_flat_param.py)
    returns each rank's chunk and the numel it pads to the first chunk's size."""
    from torch.distributed.fsdp._flat_param import FlatParamHandle

    for numel in range(1, 40):
        for world in range(1, 9):
            tensor = torch.arange(numel)
            for shard in shard_ranges(numel, world, "fsdp1"):
                chunk, numel_to_pad = FlatParamHandle._get_unpadded_shard(tensor, shard.rank, world)
                assert chunk.tolist() == list(range(shard.start, shard.end))
                assert numel_to_pad == shard.padding


def test_fsdp2_chunk_with_empty_matches():
    from torch.distributed.fsdp._fully_shard._fsdp_common import _chunk_with_empty

    for rows in range(0, 20):
        for world in range(1, 7):
            chunks = _chunk_with_empty(torch.zeros(rows, 3), world, dim=0)
            assert [c.shape[0] for c in chunks] == chunk_rows(rows, world)


def test_zero_optimizer_partition_matches_torch():
    """torch's own ZeroRedundancyOptimizer._partition_parameters (sizes largest first, each to
    the least-loaded rank) run unbound on a stand-in holding only what it reads, against
    `zero_optimizer_partition` on the same sizes, ties included."""
    import random

    from torch.distributed.optim import ZeroRedundancyOptimizer

    from shardplan.core.shards import zero_optimizer_partition

    class StandIn:
        _get_min_index = ZeroRedundancyOptimizer._get_min_index
        _partition_param_group = ZeroRedundancyOptimizer._partition_param_group
        _partition_parameters = ZeroRedundancyOptimizer._partition_parameters

    rng = random.Random(7)
    for _ in range(200):
        numels = [rng.choice([1, 3, 8, 8, 64, 100, 4096]) for _ in range(rng.randint(1, 30))]
        world = rng.randint(1, 9)
        tensors = [torch.empty(n) for n in numels]
        stand_in = StandIn()
        stand_in._partition_parameters_cache, stand_in.world_size = [], world
        stand_in.param_groups = [{"params": tensors}]
        per_rank = stand_in._partition_parameters()
        owner = {id(t): rank for rank, groups in enumerate(per_rank) for t in groups[0]["params"]}
        assert zero_optimizer_partition(numels, world) == [owner[id(t)] for t in tensors], (numels, world)


@pytest.mark.slow
def test_fully_shard_local_shapes_and_padding(tmp_path, write):
    """One torchrun launch: every rank's local shard shape and padded storage equal
    `shards --style fsdp2` rows and padding for that rank; per-rank byte totals too."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("WORLD_SIZE", None)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(NPROC),
        str(ROOT / "tests" / "dist" / "fsdp2_shards.py"), json.dumps(TINY_SHAPE), str(tmp_path),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(NPROC)]

    model = "".join(f"{k} = {json.dumps(v)}\n" for k, v in TINY_SHAPE.items())
    job = write("job.toml", f"[model]\n{model}[train]\nprecision = \"fp32\"\n")
    result = run_cli("shards", job, "--world", str(NPROC), "--style", "fsdp2", "--json")
    assert result.code == 0, result.err
    planned = result.json
    assert {p["name"] for p in planned["params"]} == set(measured[0])
    for param in planned["params"]:
        row_numel = 1
        for size in param["local_shape"][1:]:
            row_numel *= size
        for shard in param["shards"]:
            theirs = measured[shard["rank"]][param["name"]]
            assert theirs["local_shape"] == [shard["rows"], *param["local_shape"][1:]], param["name"]
            stored = shard["end"] - shard["start"] + shard["padding"]
            assert theirs["storage_bytes"] == stored * theirs["element_bytes"], param["name"]
    router = next(p for p in planned["params"] if p["name"].endswith("router.weight"))
    assert [s["rows"] for s in router["shards"]] == [1, 1, 0]  # the case that needs empty chunks
    for total in planned["ranks"]:
        rank_bytes = sum(p["storage_bytes"] for p in measured[total["rank"]].values())
        assert total["bytes"] == rank_bytes
