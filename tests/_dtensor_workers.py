"""Rank bodies for the DTensor process-tier test (module level so that they pickle by reference)."""

from __future__ import annotations

import os
from typing import Any

import torch

import ringlet.distributed as dist
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor


def _torch_dtensor() -> Any:
    import torch.distributed as tdist
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as t_init_device_mesh

    return tdist, tdt, t_init_device_mesh


def mesh_and_dtensor_vs_torch(rank: int, n: int, tmp: str) -> dict[str, Any]:
    """Our mesh and DTensor over shm next to torch's DTensor over gloo: same shards, same
    results."""
    tdist, tdt, t_init = _torch_dtensor()
    tdist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'gloo')}", rank=rank,
                             world_size=n)
    failures: list[str] = []
    checks = 0

    def same(what: str, got: torch.Tensor, want: torch.Tensor) -> None:
        nonlocal checks
        checks += 1
        if got.shape != want.shape or not torch.equal(got, want):
            failures.append(f"rank {rank}: {what}: got {got.tolist()}, want {want.tolist()}")

    try:
        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("dp",))
        tmesh = t_init("cpu", (n,))
        if mesh.get_group().backend != "shm" or mesh.get_coordinate() != [rank]:
            failures.append(f"rank {rank}: mesh {mesh!r} group {mesh.get_group()!r}")
        for shape in [(33, 4), (3, 5), (1, 3)]:
            full = torch.arange(shape[0] * shape[1], dtype=torch.float32).reshape(shape)
            for d in (0, 1):
                ours = distribute_tensor(full, mesh, [Shard(d)])
                theirs = tdt.distribute_tensor(full, tmesh, [tdt.Shard(d)])
                same(f"{shape} S({d}) local", ours.to_local(), theirs.to_local())
                same(f"{shape} S({d}) full", ours.full_tensor(), full)
                other = 1 - d
                same(f"{shape} S({d})->S({other})",
                     ours.redistribute(mesh, [Shard(other)]).to_local(),
                     theirs.redistribute(tmesh, [tdt.Shard(other)]).to_local())
            part = full * (rank + 1)
            ours_p = DTensor.from_local(part, mesh, [Partial()])
            theirs_p = tdt.DTensor.from_local(part, tmesh, [tdt.Partial()])
            same(f"{shape} P->S(0)", ours_p.redistribute(mesh, [Shard(0)]).to_local(),
                 theirs_p.redistribute(tmesh, [tdt.Shard(0)]).to_local())
            same(f"{shape} P->R", ours_p.full_tensor(), theirs_p.full_tensor())
        a, b = torch.arange(12.0).reshape(3, 4), torch.arange(8.0).reshape(4, 2)
        prod = torch.mm(distribute_tensor(a, mesh, [Shard(1)]),
                        distribute_tensor(b, mesh, [Shard(0)]))
        tprod = torch.mm(tdt.distribute_tensor(a, tmesh, [tdt.Shard(1)]),
                         tdt.distribute_tensor(b, tmesh, [tdt.Shard(0)]))
        if repr(prod.placements[0]) != "Partial(sum)" or not tprod.placements[0].is_partial():
            failures.append(f"rank {rank}: mm placements {prod.placements} vs torch "
                            f"{tprod.placements}")
        same("mm P->R", prod.full_tensor(), tprod.full_tensor())
        path = os.path.join(tmp, f"dt{rank}.pt")
        w = torch.nn.Parameter(distribute_tensor(torch.arange(10.0).reshape(5, 2), mesh,
                                                 [Shard(0)]))
        torch.save({"w": w, "r": distribute_tensor(a, mesh, [Replicate()])}, path)
        back = torch.load(path, weights_only=False)
        same("save/load", back["w"].to_local(), w.to_local())
        if back["w"].device_mesh is not mesh or not isinstance(back["w"], torch.nn.Parameter):
            failures.append(f"rank {rank}: loaded {back['w']!r} on {back['w'].device_mesh!r}")
        dist.barrier()
    finally:
        tdist.destroy_process_group()
    return {"failures": failures, "checks": checks}
