"""Rank bodies for fully_shard's newer surface: grouped modules, reshard_after_forward as an int,
Shard(1) placements, custom collectives and the other FSDPModule setters, share_comm_ctx
(module level: they also run in real processes)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from _fsdp_workers import MLP, batch, loss_fn, make_model, shard_model, train_pair
from torch import nn

import ringlet.distributed as dist
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.fsdp import FSDPModule, fully_shard, share_comm_ctx
from ringlet.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from ringlet.distributed.tensor import Shard


class CountingAllGather(AllGather):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                           async_op=async_op)


class CountingReduceScatter(ReduceScatter):
    def __init__(self) -> None:
        self.calls = 0

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any, op: Any,
                 async_op: bool = False) -> Any:
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group,
                                          async_op=async_op)


def _grouped(m: MLP) -> MLP:
    fully_shard([m.layers[0], m.layers[1]])
    fully_shard(m.layers[2])
    fully_shard(m)
    return m


def _shard_dim1(m: nn.Module) -> nn.Module:
    world = dist.get_world_size()
    return shard_model(m, shard_placement_fn=lambda p: (
        Shard(1) if p.dim() == 2 and p.shape[1] % world == 0 else None))


COMMS: dict[str, Any] = {}


def _custom(m: nn.Module) -> nn.Module:
    shard_model(m)
    ag, rs = CountingAllGather(), CountingReduceScatter()
    COMMS[dist.get_rank()] = (ag, rs)
    for sub in m.modules():
        if isinstance(sub, FSDPModule):
            sub.set_custom_all_gather(ag)
            sub.set_custom_reduce_scatter(rs)
    return m


def _force_sum(m: nn.Module) -> nn.Module:
    shard_model(m)
    for sub in m.modules():
        if isinstance(sub, FSDPModule):
            sub.set_force_sum_reduction_for_comms(True)
    return m


def _separate_rs(m: nn.Module) -> nn.Module:
    shard_model(m)
    m.set_separate_reduce_scatter_group()          # type: ignore[attr-defined]
    return m


def _raf2(m: nn.Module) -> nn.Module:
    return shard_model(m, reshard_after_forward=2)


SHARDINGS = {"grouped": _grouped, "shard1": _shard_dim1, "custom": _custom, "force_sum": _force_sum,
             "separate_rs": _separate_rs, "raf2": _raf2}


def parity(rank: int, world: int, name: str) -> dict[str, Any]:
    kind = "transformer" if name in ("force_sum", "raf2") else "mlp"
    losses, ref, diff = train_pair(rank, world, kind, steps=4, shard=SHARDINGS[name])
    out: dict[str, Any] = {"loss": max(abs(a - b) for a, b in zip(losses, ref)), "diff": diff}
    if name == "custom":
        ag, rs = COMMS.pop(rank)
        out["calls"] = (ag.calls, rs.calls)
    return out


def grouped_details(rank: int, world: int) -> dict[str, Any]:
    """One state and one all-gather for a grouped pair; the state dict keeps ordinary names."""
    model = _grouped(make_model("mlp"))
    pg = dist.group.WORLD
    x, y = batch("mlp", 0, 2)
    pg.reset_counts()
    loss_fn("mlp", model, x, y).backward()
    counts = pg.counts()
    a, b = model.layers[0], model.layers[1]
    keys = sorted(model.state_dict())
    fresh = _grouped(make_model("mlp", seed=3))
    fresh.load_state_dict(model.state_dict())
    same = all(torch.equal(v.full_tensor(), fresh.state_dict()[k].full_tensor())
               for k, v in model.state_dict().items())
    return {"shared": a._get_fsdp_state() is b._get_fsdp_state(), "counts": counts, "keys": keys,
            "reload": same}


class ChunkedHead(nn.Module):
    """The chunked-loss pattern: forward runs ``norm`` only; the loss calls ``head`` per chunk."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.body(x))


def chunked_head(rank: int, world: int) -> float:
    from _fsdp_workers import _INIT_LOCK

    with _INIT_LOCK:
        torch.manual_seed(0)
        model = ChunkedHead()
        ref = ChunkedHead()
        ref.load_state_dict(model.state_dict())
    fully_shard([model.norm, model.head])
    fully_shard(model)
    diffs = []
    for step in range(3):
        x, y = batch("mlp", step, 4 * world)
        for m, xs, ys in ((model, x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]),
                          (ref, x, y)):
            h = m(xs)
            loss = sum(F.mse_loss(m.head(c), t, reduction="sum")
                       for c, t in zip(h.chunk(2), ys.chunk(2)))
            (loss / len(xs)).backward()
        got = model.head.weight.grad.full_tensor()
        diffs.append((got - ref.head.weight.grad).abs().max().item())
        model.zero_grad()
        ref.zero_grad()
    return max(diffs)


def raf_int_details(rank: int, world: int) -> dict[str, Any]:
    """reshard_after_forward=2 on 4 ranks: backward gathers over the 2-rank group, 1/2 kept."""
    model = shard_model(make_model("mlp"), reshard_after_forward=2)
    group = model.layers[1]._get_fsdp_state().group
    pf = group.comm.post_forward_pg
    shard_pg = group.mesh_info.shard_group
    x, y = batch("mlp", 0, 2)
    shard_pg.reset_counts()
    pf.reset_counts()
    loss = loss_fn("mlp", model, x, y)
    kept = group._post_forward_shard
    registered_sharded = type(model.layers[1].weight).__name__
    forward_ag = shard_pg.counts().get("all_gather", 0)
    loss.backward()
    return {"pf_ranks": pf.ranks, "kept": kept.numel() if kept is not None else 0,
            "gathered": group.layout.gathered_numel, "registered": registered_sharded,
            "forward_ag": forward_ag,
            "backward_ag_shard": shard_pg.counts().get("all_gather", 0) - forward_ag,
            "backward_ag_pf": pf.counts().get("all_gather", 0),
            "after": group._post_forward_shard is None}


class TwoPaths(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, use_b: bool) -> torch.Tensor:
        y = self.a(x)
        return y + self.b(x) if use_b else y


def unused_params(rank: int, world: int, flag: bool) -> dict[str, Any]:
    """``b`` gets a gradient on rank 0 only: with set_reduce_scatter_unused_params every rank ends
    with the same averaged gradient (zeros counted for rank 1); without, rank 1 keeps None."""
    from _fsdp_workers import _INIT_LOCK

    with _INIT_LOCK:
        torch.manual_seed(0)
        model = TwoPaths()
    fully_shard(model)
    model.set_reduce_scatter_unused_params(flag)    # type: ignore[attr-defined]
    x, _ = batch("mlp", 0, 2)
    model(x, use_b=rank == 0).sum().backward()
    g = model.b.weight.grad
    return {"has_grad": g is not None, "grad": g.to_local().clone() if g is not None else None}


def setter_checks(rank: int, world: int) -> dict[str, str]:
    model = shard_model(make_model("mlp"))
    out = {}
    for name, call in (("symm", lambda: model.set_symm_mem_for_comm()),
                       ("buffers", lambda: model.set_reduce_scatter_max_input_buffers(0)),
                       ("buffers_type", lambda: model.set_reduce_scatter_max_input_buffers(True)),
                       ("comm_type", lambda: model.set_custom_all_gather(object())),
                       ("conflict", lambda: (
                           model.layers[0].set_allocate_memory_from_process_group_for_comm(True),
                           model.layers[0].set_custom_all_gather(CountingAllGather()))),
                       ("share_bad", lambda: share_comm_ctx([nn.Linear(2, 2)]))):
        try:
            call()
            out[name] = "no error"
        except (NotImplementedError, ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_reduce_scatter_divide_factor(2.0)
    out["deprecated"] = caught[0].category.__name__ if caught else ""
    model.set_reduce_scatter_max_input_buffers(5)
    model._set_unshard_async_op(True)
    model.set_post_optim_event(object())
    out["pool"] = str(model.layers[0]._get_fsdp_state().group.pool.max_free)
    other = shard_model(make_model("mlp", seed=1))
    share_comm_ctx([model, other])
    x, y = batch("mlp", 0, 2)
    for m in (model, other):
        loss_fn("mlp", m, x, y).backward()
    out["shared_pool"] = str(model.layers[0]._get_fsdp_state().group.pool
                             is other.layers[2]._get_fsdp_state().group.pool)
    return out


def proc_surface(rank: int, world: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = {name: parity(rank, world, name) for name in ("grouped", "custom", "separate_rs", "raf2")}
    out["raf"] = raf_int_details(rank, world)
    return out


def hsdp_force_sum(rank: int, world: int) -> float:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))

    def shard(m: nn.Module) -> nn.Module:
        shard_model(m, mesh=mesh)
        for sub in m.modules():
            if isinstance(sub, FSDPModule):
                sub.set_force_sum_reduction_for_comms(True)
        return m
    losses, ref, diff = train_pair(rank, world, "mlp", steps=3, shard=shard)
    return max(diff, max(abs(a - b) for a, b in zip(losses, ref)))
