"""Every redistribution on 1-d (2 and 3 ranks, uneven sizes) and 2-d meshes; gradients through the
API.

Expected shards come from ``distribute_tensor(..., src_data_rank=None)``, which involves no
communication, so each transition costs only its own collectives.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringlet.distributed.device_mesh import DeviceMesh, init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.testing import run_threads

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _full(shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return torch.arange(n, dtype=torch.float32).reshape(shape)


def _all_pairs(rank: int, n: int, mesh_shape: tuple[int, ...],
               shapes: list[tuple[int, ...]]) -> list[str]:
    mesh = init_device_mesh("cpu", mesh_shape)
    opts = [R, S0, S1, P]
    bad = []
    for shape in shapes:
        full = _full(shape)
        combos = list(itertools.product(opts, repeat=len(mesh_shape)))
        expect = {c: distribute_tensor(full, mesh, list(c), src_data_rank=None) for c in combos}
        for src in combos:
            for dst in combos:
                got = expect[src].redistribute(mesh, list(dst))
                if got.placements != dst or not torch.equal(got.to_local(), expect[dst].to_local()):
                    bad.append(f"rank {rank} {shape}: {src} -> {dst}: {got.to_local().tolist()}")
    return bad


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mesh_shape,shapes",
                         [((2,), [(5, 3)]), ((3,), [(7, 2), (2, 5)]), ((2, 2), [(5, 3)])],
                         ids=["2ranks", "3ranks", "2x2"])
def test_every_transition_matches_the_full_tensor(mesh_shape: tuple[int, ...],
                                                  shapes: list) -> None:
    n = 1
    for s in mesh_shape:
        n *= s
    for bad in run_threads(_all_pairs, n, mesh_shape, shapes, timeout=80):
        assert bad == []


def _partials_and_counts(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    full = _full((7, 2))
    parts = DTensor.from_local(full * (rank + 1), mesh, [P])       # genuinely different partials
    total = full * (n * (n + 1) // 2)
    out = {"P->R": torch.equal(parts.full_tensor(), total),
           "P->S0": torch.equal(parts.redistribute(mesh, [S0]).to_local(),
                                S0.local_chunk(total, n, rank)),
           "P->S1": torch.equal(parts.redistribute(mesh, [S1]).to_local(),
                                S1.local_chunk(total, n, rank))}
    avg = DTensor.from_local(full * (rank + 1), mesh, [Partial("avg")])
    out["avg"] = torch.allclose(avg.full_tensor(), total / n)
    mx = DTensor.from_local(full * (rank + 1), mesh, [Partial("max")])
    out["max"] = torch.equal(mx.redistribute(mesh, [S0]).full_tensor(), full * n)
    counts = {}
    s0 = distribute_tensor(full, mesh, [S0], src_data_rank=None)
    for name, src, dst in [("S->R", s0, [R]), ("S->S", s0, [S1]), ("P->R", parts, [R]),
                           ("P->S", parts, [S0]),
                           ("R->S", s0.redistribute(mesh, [R]), [S1]),
                           ("R->P", s0.redistribute(mesh, [R]), [P])]:
        with CommDebugMode() as comm:
            src.redistribute(mesh, dst)
        counts[name] = comm.get_comm_counts()
    out["counts"] = counts
    return out


@pytest.mark.timeout(60)
def test_partial_sources_and_one_collective_per_transition() -> None:
    for r in run_threads(_partials_and_counts, 3):
        assert r.pop("counts") == {"S->R": {"all_gather": 1}, "S->S": {"all_to_all": 1},
                                   "P->R": {"all_reduce": 1},
                                   "P->S": {"reduce_scatter": 1}, "R->S": {}, "R->P": {}}
        assert all(r.values()), r


def _permuted_mesh(rank: int, n: int) -> list[bool]:
    # Mesh coordinates in reverse rank order: shards must follow coordinates, not group ranks.
    mesh = DeviceMesh("cpu", [[1, 0], [3, 2]])
    full = _full((5, 4))
    out = []
    for pls in ([R, S0], [S1, S0], [S0, S0], [P, S1]):
        dt = distribute_tensor(full, mesh, pls, src_data_rank=None)
        out.append(torch.equal(dt.full_tensor(), full))
        moved = dt.redistribute(mesh, [S1, S1])
        out.append(torch.equal(moved.to_local(),
                               distribute_tensor(full, mesh, [S1, S1],
                                                 src_data_rank=None).to_local()))
    src = torch.full((2, 2), float(rank))
    # coordinate (0, 0) is rank 1
    out.append(distribute_tensor(src, mesh, [R, R]).to_local()[0, 0].item() == 1.0)
    return out


@pytest.mark.timeout(60)
def test_meshes_whose_lines_are_not_in_rank_order() -> None:
    for r in run_threads(_permuted_mesh, 4):
        assert all(r), r


def _gradients(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    # rank's shard of a [3n, 2] tensor
    x = (torch.arange(6.0).reshape(3, 2) + rank).requires_grad_()
    dt = DTensor.from_local(x, mesh, [S0])
    # all-gather; backward: keep my chunk
    full = dt.full_tensor()
    (full * torch.arange(3.0 * n).reshape(-1, 1)).sum().backward()
    out = {"from_local+full": x.grad.tolist()}
    w = distribute_tensor(torch.ones(4, 3), mesh, [S0]).requires_grad_()
    y = w.redistribute(mesh, [R]) * 2                                      # S->R; backward R->S
    # each rank: d/dy = 1 as a R grad
    y.to_local().sum().backward()
    out["redistribute"] = (repr(w.grad), w.grad.to_local().tolist())
    src = torch.ones(2, 2, requires_grad=True)
    r = DTensor.from_local(src, mesh, [P]).redistribute(mesh, [S0]).to_local(grad_placements=[S0])
    r.sum().backward()                        # every partial counts fully: its gradient is all ones
    out["partial"] = src.grad.tolist()
    a = torch.ones(2, requires_grad=True)
    d = DTensor.from_local(a, mesh, [R]).redistribute(mesh, [P])
    d.full_tensor().sum().backward()
    out["R->P grad"] = a.grad.tolist()
    out["async"] = repr(w.redistribute(mesh, [R], async_op=True))
    return out


@pytest.mark.timeout(60)
def test_gradients_flow_through_from_local_redistribute_to_local_and_full_tensor() -> None:
    res = run_threads(_gradients, 2)
    assert res[0]["from_local+full"] == [[0, 0], [1, 1], [2, 2]]
    assert res[1]["from_local+full"] == [[3, 3], [4, 4], [5, 5]]
    for r in res:
        assert r["redistribute"] == ("DTensor(f32[4@0,3] S(0))", [[2.0] * 3] * 2)
        assert r["R->P grad"] == [1.0, 1.0] and r["partial"] == [[1.0, 1.0], [1.0, 1.0]]
        assert r["async"] == "DTensor(f32[4,3] R)"


def _api_checks(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}
    uneven = DTensor.from_local(torch.ones(2 if rank == 0 else 1, 3), mesh, [S0], shape=(3, 3),
                                stride=(3, 1))
    out["uneven"] = (repr(uneven), uneven.full_tensor().shape == (3, 3))
    even = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(-1)], run_check=True)
    out["even"] = (repr(even), even.stride())
    # copies coordinate 0
    rep = DTensor.from_local(torch.full((2,), float(rank)), mesh, run_check=True)
    out["run_check"] = rep.to_local().tolist()
    out["verbose"] = even.verbose_repr().startswith("DTensor(local_tensor=tensor(")
    for fn, err, match in [
        (lambda: DTensor.from_local(torch.ones(2 + rank, 3), mesh, [S0], run_check=True),
         ValueError, "disagree on dtype or global shape"),
        (lambda: even.redistribute(mesh, [S0, S0]), ValueError,
         "expected one placement per mesh axis"),
        (lambda: even.redistribute(mesh, [Shard(2)]), ValueError,
         "names a dim outside a 2-d tensor"),
        (lambda: even.redistribute(init_device_mesh("cpu", (n,)), [R]), ValueError,
         "expected DeviceMesh"),
        (lambda: distribute_tensor(even, mesh, [R]), ValueError, "use redistribute"),
        (lambda: distribute_tensor(torch.ones(2), mesh, [R], src_data_rank=5), ValueError,
         "src_data_rank"),
    ]:
        with pytest.raises(err, match=match):
            fn()
    return out


@pytest.mark.timeout(60)
def test_from_local_options_and_errors() -> None:
    res = run_threads(_api_checks, 2)
    assert res[0]["uneven"] == ("DTensor(f32[3@tp,3] S(0))", True)
    assert res[0]["even"] == ("DTensor(f32[2,6@tp] S(1))", (6, 1))
    assert [r["run_check"] for r in res] == [[0.0, 0.0], [0.0, 0.0]]
    assert res[1]["verbose"]
