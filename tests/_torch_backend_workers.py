"""Worker bodies for tests/test_torch_backend.py: torch's own API over torch's gloo and over the
"ringlet" backend in the same processes, one phase after the other, results compared by the
test."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

import ringlet  # noqa: F401  (registers the "ringlet" backend)


def _init(backend: str, path: str, rank: int, world: int, seconds: float = 20.0) -> None:
    tdist.init_process_group(backend, init_method=f"file://{path}.{backend}", rank=rank,
                             world_size=world, timeout=timedelta(seconds=seconds))


def _plain(x: Any) -> Any:
    """Tensors as (dtype, shape, values) so results cross the pipe without shared memory."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), list(x.shape), x.tolist())
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    return x


def _on_both(rank: int, world: int, path: str, body: Any, *args: Any) -> dict[str, Any]:
    out = {}
    for backend in ("gloo", "ringlet"):
        _init(backend, path, rank, world)
        try:
            out[backend] = _plain(body(rank, world, *args))
        finally:
            tdist.destroy_process_group()
    return out


# ------------------------------------------------------------------- every collective of the API
def _collectives(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {"backend": tdist.get_backend(), "rank": tdist.get_rank(),
                         "size": tdist.get_world_size()}
    base = torch.arange(4, dtype=torch.float32) + 10 * rank
    for name, op in [("sum", tdist.ReduceOp.SUM), ("avg", tdist.ReduceOp.AVG),
                     ("max", tdist.ReduceOp.MAX), ("product", tdist.ReduceOp.PRODUCT),
                     ("premul", tdist._make_nccl_premul_sum(0.5))]:
        t = base.clone()
        if name in ("avg", "premul") and tdist.get_backend() == "gloo":
            t *= 0.5 if name == "premul" else 1 / world   # gloo has neither: scale, then sum
            tdist.all_reduce(t)
        else:
            tdist.all_reduce(t, op=op)
        r[f"all_reduce/{name}"] = t
    t = base.clone()
    tdist.broadcast(t, src=1)
    r["broadcast"] = t
    t = base.clone()
    tdist.reduce(t, dst=1)
    r["reduce"] = t if rank == 1 else None
    outs = [torch.empty(4) for _ in range(world)]
    tdist.all_gather(outs, base)
    r["all_gather"] = outs
    o = torch.empty(4 * world)
    tdist.all_gather_into_tensor(o, base)
    r["all_gather_into_tensor"] = o
    o = torch.empty(2)
    tdist.reduce_scatter(o, [base[:2].clone(), base[2:].clone()])
    r["reduce_scatter"] = o
    o = torch.empty(2)
    tdist.reduce_scatter_tensor(o, base.clone())
    r["reduce_scatter_tensor"] = o
    o = torch.empty(3 if rank == 0 else 5)
    ins = [1, 3] if rank == 0 else [2, 2]
    outs_split = [1, 2] if rank == 0 else [3, 2]
    tdist.all_to_all_single(o, base, outs_split, ins)
    r["all_to_all_single"] = o
    outs = [torch.empty(2) for _ in range(world)]
    tdist.all_to_all(outs, list(base.split(2)))
    r["all_to_all"] = outs
    gl = [torch.empty(4) for _ in range(world)] if rank == 0 else None
    tdist.gather(base, gl, dst=0)
    r["gather"] = gl
    o = torch.empty(4)
    tdist.scatter(o, [base * 0 + i for i in range(world)] if rank == 1 else None, src=1)
    r["scatter"] = o
    r.update(_p2p_and_async(rank, world, base))
    r.update(_objects_and_groups(rank, world))
    return r


def _p2p_and_async(rank: int, world: int, base: torch.Tensor) -> dict[str, Any]:
    r: dict[str, Any] = {}
    peer = 1 - rank
    got = torch.empty(4)
    if rank == 0:
        tdist.send(base, peer)
        tdist.recv(got, peer)
    else:
        tdist.recv(got, peer)
        tdist.send(base, peer)
    r["send_recv"] = got
    got = torch.empty(4)
    if rank == 0:
        tdist.send(base, 1)
    else:
        r["recv_any_source/sender"] = tdist.recv(got)      # recv_anysource: who sent it
        r["recv_any_source"] = got
    got = torch.empty(4)
    ops = [tdist.P2POp(tdist.isend, base, peer), tdist.P2POp(tdist.irecv, got, peer)]
    for w in tdist.batch_isend_irecv(ops):
        w.wait()
    r["batch_isend_irecv"] = got
    t = base.clone()
    w = tdist.all_reduce(t, async_op=True)
    r["async/future"] = w.get_future().wait()
    w.wait()
    r["async/completed"] = w.is_completed()
    ts = [base.clone(), base[:2].clone() * 2]
    with tdist._coalescing_manager(async_ops=True) as cm:
        for x in ts:
            tdist.all_reduce(x)
    cm.wait()
    r["coalesced_all_reduce"] = ts
    tdist.barrier()
    return r


def _objects_and_groups(rank: int, world: int) -> dict[str, Any]:
    r: dict[str, Any] = {}
    objs: list[Any] = [None] * world
    tdist.all_gather_object(objs, {"rank": rank, "x": [rank] * 3})
    r["all_gather_object"] = objs
    lst: list[Any] = [{"from": rank}, "two"] if rank == 1 else [None, None]
    tdist.broadcast_object_list(lst, src=1)
    r["broadcast_object_list"] = lst
    got: list[Any] = [None]
    tdist.scatter_object_list(got, [f"for {i}" for i in range(world)] if rank == 0 else None, 0)
    r["scatter_object_list"] = got
    sub = tdist.new_group([0, 1])
    t = torch.full((2,), float(rank + 1))
    tdist.all_reduce(t, group=sub)
    r["new_group"] = (t, tdist.get_process_group_ranks(sub))
    return r


def collectives(rank: int, world: int, path: str) -> dict[str, Any]:
    return _on_both(rank, world, path, _collectives)


# ------------------------------------------------------------------- torch's strategies unchanged
def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(model: torch.nn.Module, rank: int, steps: int = 4, lr: float = 0.05) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        loss = model(torch.randn(4, 8, generator=g)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _strategies(rank: int, world: int, ckpt: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from torch.nn.parallel import DistributedDataParallel as DDP

    r: dict[str, Any] = {}
    ddp = DDP(_mlp())
    r["ddp"] = _train(ddp, rank)
    hooked = DDP(_mlp())

    def halve_then_sum(state, bucket):  # type: ignore[no-untyped-def]  # torch reads annotations
        buf = bucket.buffer().div_(2)
        fut = tdist.all_reduce(buf, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])
    hooked.register_comm_hook(None, halve_then_sum)
    r["ddp/comm_hook"] = _train(hooked, rank)
    mesh = init_device_mesh("cpu", (world,))
    m = _mlp()
    fully_shard(m[0], mesh=mesh)
    fully_shard(m[2], mesh=mesh)
    fully_shard(m, mesh=mesh)
    r["fully_shard"] = _train(m, rank)
    tp = parallelize_module(_mlp(), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    r["tensor_parallel"] = _train(tp, rank)
    import torch.distributed.checkpoint as dcp

    where = f"{ckpt}/{tdist.get_backend()}"
    dcp.save({"model": m.state_dict()}, checkpoint_id=where)
    fresh = _mlp()
    fully_shard(fresh, mesh=mesh)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=where)
    fresh.load_state_dict(sd["model"])
    r["dcp"] = [p.full_tensor() for p in fresh.parameters()]
    r["trained"] = [p.full_tensor() for p in m.parameters()]
    return r


def strategies(rank: int, world: int, path: str, ckpt: str) -> dict[str, Any]:
    return _on_both(rank, world, path, _strategies, ckpt)


# ------------------------------------------------------------------- faults seen through torch
def mismatch(rank: int, world: int, path: str) -> tuple[str, str]:
    """Rank 0 all_reduces, rank 1 broadcasts (RINGLET_DEBUG=DETAIL): ringlet's mismatch error."""
    _init("ringlet", path, rank, world, seconds=10)
    try:
        t = torch.ones(4)
        if rank == 0:
            tdist.all_reduce(t)
        else:
            tdist.broadcast(t, src=0)
    except Exception as e:
        return type(e).__name__, str(e)
    finally:
        tdist.destroy_process_group()
    return "none", ""


def skipped(rank: int, world: int, path: str) -> tuple[str, str, float]:
    """Rank 1 never joins rank 0's all_reduce inside torch's DDP-free API: ringlet's timeout with
    its hang report, after the group's timeout (2 s), not a hang."""
    import time

    _init("ringlet", path, rank, world, seconds=2)
    t0 = time.monotonic()
    try:
        if rank == 0:
            tdist.all_reduce(torch.ones(4))
        else:
            time.sleep(4)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    finally:
        tdist.destroy_process_group()
    return "none", "", time.monotonic() - t0


def ddp_peer_dies(rank: int, world: int, path: str) -> tuple[str, str]:
    """Rank 1 exits during training under torch's DDP: rank 0's backward reports the dead peer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    _init("ringlet", path, rank, world, seconds=10)
    model = DDP(_mlp())
    model(torch.randn(4, 8)).sum().backward()
    if rank == 1:
        os._exit(0)
    try:
        for _ in range(3):
            model(torch.randn(4, 8)).sum().backward()
    except Exception as e:
        return type(e).__name__, str(e)
    return "none", ""


def _two_d(rank: int, world: int) -> dict[str, Any]:
    """torch's 2-d layouts on a (2, 2) mesh: HSDP (replicate x shard) and fully_shard over dp with
    tensor parallelism over tp (torch's FSDP + TP recipe)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    r: dict[str, Any] = {}
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    m = _mlp()
    fully_shard(m, mesh=hsdp)
    r["hsdp"] = _train(m, rank)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    m = parallelize_module(_mlp(), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    r["fsdp+tp"] = _train(m, rank)
    r["full"] = [p.full_tensor() for p in m.parameters()]
    return r


def two_d(rank: int, world: int, path: str) -> dict[str, Any]:
    return _on_both(rank, world, path, _two_d)


def fsdp_rank_stalls(rank: int, world: int, path: str) -> tuple[str, str, float]:
    """Under torch's fully_shard, rank 1 stops taking steps (alive, silent): rank 0's next step
    ends with ringlet's timeout and hang report after the group's timeout (3 s)."""
    import time

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    _init("ringlet", path, rank, world, seconds=3)
    m = _mlp()
    fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
    _train(m, rank, steps=1)
    t0 = time.monotonic()
    try:
        if rank == 1:
            time.sleep(6)
            return "none", "", 0.0
        _train(m, rank, steps=1)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", time.monotonic() - t0
