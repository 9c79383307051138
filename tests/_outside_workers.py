"""Rank bodies for tests/test_dtensor_outside.py (module level so that they pickle by reference):
DTensors of meshes [0, 3] and [0, 1, 3] used on every rank of a world of 4."""

from __future__ import annotations

from typing import Any

import torch

import ringlet.distributed as dist
from ringlet.distributed import tensor as dt
from ringlet.distributed.device_mesh import DeviceMesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard


def _about(t: DTensor) -> tuple[Any, ...]:
    """What the test compares: global shape, placements, local shape, dtype, local values."""
    local = t.to_local()
    return (tuple(t.shape), tuple(map(repr, t.placements)), tuple(local.shape), str(local.dtype),
            local.detach().flatten().tolist())


def factories_then_ops(rank: int, n: int) -> dict[str, Any]:
    """Factories, distribute_tensor and from_local on two overlapping sub-meshes, ops and
    redistributions between them, then collectives on the world and on each mesh's group."""
    m03 = DeviceMesh("cpu", [0, 3])
    m013 = DeviceMesh("cpu", [0, 1, 3])
    out: dict[str, Any] = {}
    out["zeros"] = _about(dt.zeros(4, 2, device_mesh=m03, placements=[Shard(0)]))
    out["ones"] = _about(dt.ones(3, dtype=torch.float64, device_mesh=m013))
    out["full"] = _about(dt.full((2, 3), 7, dtype=torch.int64, device_mesh=m03,
                              placements=[Shard(1)]))
    e = dt.empty(6, requires_grad=True, device_mesh=m013, placements=[Shard(0)])
    out["empty"] = (tuple(e.shape), tuple(e.to_local().shape), e.requires_grad)
    torch.manual_seed(0)
    out["rand"] = _about(dt.rand(5, device_mesh=m03, placements=[Shard(0)]))
    out["randn"] = _about(dt.randn(2, 2, device_mesh=m013, placements=[dt.Partial()]))
    out["after"] = torch.rand(3).tolist()              # the generator stayed in step everywhere
    a = dt.ones(4, 2, device_mesh=m03, placements=[Shard(0)])
    b = a * 2 + 1
    out["b"] = _about(b)
    out["b.full"] = b.full_tensor().tolist()
    out["b.sum"] = _about(b.sum())
    out["b.sum.full"] = b.sum().full_tensor().tolist()
    out["equal"] = (b.equal(b), b.equal(a))
    out["add_"] = a.add_(1) is a
    c = dt.distribute_tensor(torch.arange(6.0), m013, [Shard(0)])
    out["c"] = _about(c)
    out["c.rep"] = _about(c.redistribute(m013, [Replicate()]))
    d = DTensor.from_local(torch.full((2,), float(rank)), m013, [Shard(0)])
    out["d"] = _about(d)
    out["d.full"] = d.full_tensor().tolist()
    out["split"] = [_about(x) for x in c.split([4, 2])]
    try:
        out["nonzero"] = _about(c.redistribute(m013, [Replicate()]).nonzero())
    except NotImplementedError as e:
        out["nonzero"] = str(e)
    t = torch.ones(1)
    dist.all_reduce(t)
    out["world"] = t.item()
    for name, mesh in (("m03", m03), ("m013", m013)):
        if mesh.get_coordinate() is not None:
            t = torch.ones(1) * rank
            dist.all_reduce(t, group=mesh.get_group())
            out[name] = t.item()
    return out
