"""DeviceMesh: groups per axis, slicing, flattening, identity -- on 4 rank threads and 2
processes."""

from __future__ import annotations

import _dtensor_workers as workers
import pytest
import torch

import ringlet.distributed as dist
from ringlet.c10d.world import resolve_group
from ringlet.distributed.device_mesh import DeviceMesh, init_device_mesh
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world


def _mesh_2x2(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp, dp = mesh["tp"], mesh["dp"]
    out = {
        "repr": repr(mesh), "tp": (repr(tp), tp.mesh.tolist()),
        "dp": (repr(dp), dp.mesh.tolist()),
        "coord": mesh.get_coordinate(),
        "local": (mesh.get_local_rank("dp"), mesh.get_local_rank(1), tp.get_local_rank()),
        "groups": [g.ranks for g in mesh.get_all_groups()], "tp_group": tp.get_group().ranks,
        "by_name": mesh.get_group("tp") is mesh.get_group(1) is tp.get_group(),
        "sizes": (mesh.size(), mesh.size(0), mesh.size("tp"), mesh.ndim, mesh.shape),
        "rank": mesh.get_rank(),
        "swapped": (repr(mesh["tp", "dp"]), mesh["tp", "dp"].mesh.tolist()),
        "whole": mesh["dp", "tp"] is mesh,
    }
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=tp)                 # a 1-d mesh is accepted wherever a group is
    out["tp_sum"] = t.item()
    out["resolve"] = resolve_group(dp) is dp.get_group()
    flat = mesh._flatten("dp_tp")
    out["flat"] = ((repr(flat), flat.mesh.tolist()), flat.get_local_rank(), mesh["dp_tp"] == flat,
                   flat.get_group() is not None)
    out["eq"] = (mesh == init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp")),
                 hash(tp)
                 == hash(DeviceMesh("cpu", tp.mesh.tolist(), mesh_dim_names=("tp",),
                                    _init_backend=False)),
                 tp != dp, mesh != init_device_mesh("cpu", (2, 2)))
    with pytest.raises(ValueError, match="expected an axis"):
        mesh.get_group()
    with pytest.raises(KeyError, match="expected one of the axis names"):
        mesh["pp"]
    with pytest.raises(ValueError, match="expected a 1-d DeviceMesh"):
        dist.all_reduce(t, group=mesh)
    return out


@pytest.mark.timeout(60)
def test_mesh_2x2_on_threads() -> None:
    res = run_threads(_mesh_2x2, 4)
    # printed as torch prints meshes (sizes, device, strides in the root mesh; no ranks)
    assert res[0]["repr"] == "DeviceMesh((dp=2, tp=2), 'cpu', stride=(2, 1))"
    tp, dp = "DeviceMesh((tp=2), 'cpu', stride=(1,))", "DeviceMesh((dp=2), 'cpu', stride=(2,))"
    assert [r["tp"] for r in res] == [(tp, [0, 1])] * 2 + [(tp, [2, 3])] * 2
    assert [r["dp"] for r in res] == [(dp, [0, 2]), (dp, [1, 3])] * 2
    assert [r["coord"] for r in res] == [[0, 0], [0, 1], [1, 0], [1, 1]]
    assert [r["local"] for r in res] == [(0, 0, 0), (0, 1, 1), (1, 0, 0), (1, 1, 1)]
    assert [r["groups"] for r in res] == [[[0, 2], [0, 1]], [[1, 3], [0, 1]], [[0, 2], [2, 3]],
                                          [[1, 3], [2, 3]]]
    assert [r["tp_sum"] for r in res] == [1.0, 1.0, 5.0, 5.0]
    for r in res:
        assert r["by_name"] and r["resolve"] and r["whole"] and all(r["eq"])
        assert r["sizes"] == (4, 2, 2, 2, (2, 2))
        assert r["swapped"] == ("DeviceMesh((tp=2, dp=2), 'cpu', stride=(1, 2))",
                                [[0, 2], [1, 3]])
        assert (r["flat"][0] == ("DeviceMesh((dp_tp=4), 'cpu', stride=(1,))", [0, 1, 2, 3])
                and all(r["flat"][2:]))
    assert [r["flat"][1] for r in res] == [0, 1, 2, 3]


def _mesh_odd_layouts(rank: int, n: int) -> dict:
    # Columns first: axis 1 lines are [0, 2] and [1, 3]; a reversed line [1, 0] still orders by
    # coordinate.
    cols = DeviceMesh("cpu", [[0, 2], [1, 3]], mesh_dim_names=("a", "b"))
    rev = DeviceMesh("cpu", [[1, 0], [3, 2]])
    sub = DeviceMesh("cpu", [0, 1])             # ranks 2 and 3 are not in it
    out = {"cols": cols["b"].get_group().ranks, "rev": rev.get_coordinate(),
           "rev_order": [rev._group_rank_of(1, c) for c in range(2)] if rank < 4 else None,
           "sub": sub.get_coordinate(), "from_group": None}
    if rank < 2:
        pg = dist.new_group([0, 1], use_local_synchronization=True)
        m = DeviceMesh.from_group(pg, "cpu", mesh_dim_names=("x",))
        out["from_group"] = (repr(m), m.mesh.tolist(), m.get_group() is pg)
    else:
        with pytest.raises(ValueError, match="not part of"):
            sub.get_local_rank(0)
    for bad, match in [(([0, 0, 1, 2],), "distinct ranks"), (([[0, 1], [2, 9]],), "distinct ranks"),
                       (([0.5, 1.5],), "integer ranks")]:
        with pytest.raises(ValueError, match=match):
            DeviceMesh("cpu", *bad)
    with pytest.raises(ValueError, match="mesh_dim_names: expected 2 distinct names"):
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("x", "x"))
    with pytest.raises(ValueError, match="product is the world size 4"):
        init_device_mesh("cpu", (3,))
    with pytest.raises(ValueError, match="device_type: expected 'cpu'"):
        init_device_mesh("xpu", (4,))
    return out


@pytest.mark.timeout(60)
def test_mesh_layouts_subsets_and_errors_on_threads() -> None:
    res = run_threads(_mesh_odd_layouts, 4)
    assert [r["cols"] for r in res] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r["rev"] for r in res] == [[0, 1], [0, 0], [1, 1], [1, 0]]
    assert [r["rev_order"] for r in res] == [[1, 0]] * 4
    assert [r["sub"] for r in res] == [[0], [1], None, None]
    assert res[0]["from_group"] == ("DeviceMesh((x=2), 'cpu', stride=(1,))", [0, 1], True)


@pytest.mark.timeout(120)
def test_mesh_and_dtensor_on_two_processes_against_torch(tmp_path) -> None:
    """shm transport; torch's own DTensor (gloo) is the oracle for uneven shards."""
    values = raise_first(run_world(2, workers.mesh_and_dtensor_vs_torch, str(tmp_path),
                                   timeout=100))
    for v in values:
        assert v["failures"] == [], v["failures"]
        assert v["checks"] >= 10
