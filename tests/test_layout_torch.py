"""Layout groups against torch's own `init_device_mesh`, the reference nobody here wrote.

Every rank of every mesh joins a fake process group (torch.testing's FakeStore: no
processes, no network; ~1 ms per rank), builds the mesh that `mesh_dims` describes, and asks
torch for the ranks of its group on each dimension (`mesh.get_group(name)` +
`get_process_group_ranks`), of the flattened dp x cp dimensions (FSDP's shard group when cp
> 1), and of the HSDP (dp_replicate, dp_shard) split. Those must equal `Layout`'s groups for
all 24 orders and several factorizations.
"""

from __future__ import annotations

import itertools
import warnings

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")
device_mesh = pytest.importorskip("torch.distributed.device_mesh")
fake_pg = pytest.importorskip("torch.testing._internal.distributed.fake_pg")

from shardplan.core.degrees import Degrees  # noqa: E402
from shardplan.core.layout import Layout, hybrid_shard_groups, mesh_dims  # noqa: E402

ORDERS = ["-".join(p) for p in itertools.permutations(("tp", "cp", "dp", "pp"))]
# (dp, tp, pp, cp): a full 4-D grid, uneven sizes, and degree-1 axes.
FACTORIZATIONS = [(2, 2, 2, 2), (3, 2, 1, 2), (1, 4, 3, 1), (2, 1, 3, 2)]


def torch_groups(rank: int, world: int, names: tuple, sizes: tuple, flatten: tuple | None) -> dict:
    """The ranks torch puts in `rank`'s group on each mesh dimension (and on `flatten`)."""
    dist.init_process_group("fake", store=fake_pg.FakeStore(), rank=rank, world_size=world)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mesh = device_mesh.init_device_mesh("cpu", sizes, mesh_dim_names=names)
            groups = {name: dist.get_process_group_ranks(mesh.get_group(name)) for name in names}
            if flatten:
                flat = mesh[flatten]._flatten()
                groups["+".join(flatten)] = dist.get_process_group_ranks(flat.get_group())
        return groups
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("dp, tp, pp, cp", FACTORIZATIONS)
def test_groups_equal_device_mesh_for_every_order(dp, tp, pp, cp):
    degrees = Degrees(dp=dp, tp=tp, pp=pp, cp=cp)
    for order in ORDERS:
        grid = Layout(degrees, order, gpus_per_node=4)
        names, sizes = mesh_dims(order, degrees)
        # FSDP's shard group over dp and cp: mesh dimensions are sliced in mesh order.
        flatten = tuple(name for name in names if name in ("dp", "cp"))
        for rank in range(grid.world):
            theirs = torch_groups(rank, grid.world, names, sizes, flatten)
            for axis in ("dp", "tp", "pp", "cp"):
                assert theirs[axis] == grid.group_of(axis, rank), (order, rank, axis)
            assert sorted(theirs["+".join(flatten)]) == grid.group_of("dp_cp", rank), (order, rank)
        # The mesh numbers ranks as the planner does: its coordinates are ours.
        assert torch.arange(grid.world).view(sizes).tolist() == _nested(grid, names)


def _nested(grid: Layout, names: tuple) -> list:
    """Our ranks as a nested list indexed by mesh coordinates (slowest dimension first)."""
    def build(depth: int, coords: dict):
        if depth == len(names):
            return grid.rank_of(**coords)
        return [build(depth + 1, {**coords, names[depth]: k}) for k in range(grid.sizes[names[depth]])]

    return build(0, {})


@pytest.mark.parametrize("order", ["tp-cp-dp-pp", "dp-tp-pp-cp", "pp-dp-tp-cp"])
def test_hybrid_groups_equal_hsdp_mesh(order):
    """HSDP: split dp into (dp_replicate, dp_shard) as `mesh_dims(dp_shard=k)` says; torch's
    groups on those dimensions are `hybrid_shard_groups`' shard and replicate groups."""
    degrees = Degrees(dp=4, tp=2, pp=2)
    grid = Layout(degrees, order, gpus_per_node=4)
    shard, replicate = hybrid_shard_groups(grid)
    names, sizes = mesh_dims(order, degrees, dp_shard=len(shard[0]))
    for rank in range(grid.world):
        theirs = torch_groups(rank, grid.world, names, sizes, None)
        assert theirs["dp_shard"] in shard, (order, rank)
        assert theirs["dp_replicate"] in replicate, (order, rank)
        assert rank in theirs["dp_shard"] and rank in theirs["dp_replicate"]
