"""Rank bodies for DDP's newer constructor arguments, comm hooks by name, logging data and pickling
(module level: they also run in real processes)."""

from __future__ import annotations

import io
import warnings
from typing import Any

import _ddp_workers as W
import torch
from torch import nn

from ringlet.distributed.algorithms.ddp_comm_hooks import DDPCommHookType, register_ddp_comm_hook
from ringlet.nn.parallel import DistributedDataParallel as DDP


def per_bucket_caps(rank: int, world: int, form: str) -> dict[str, Any]:
    """bucket_cap_mb as a list, or bucket_cap_mb_list: bucket k holds up to caps[k]; training
    exact."""
    caps = [300 / (1 << 20), 2000 / (1 << 20)]         # bytes: 300, then 2000
    kw: dict[str, Any] = {"bucket_cap_mb": caps} if form == "list" else {"bucket_cap_mb_list": caps}
    out = W.parity(rank, world, "mlp", "mlp", kw, steps=3)
    ddp = DDP(W.mlp(), **kw)
    out["caps"] = (ddp.bucket_bytes_cap, ddp.bucket_bytes_cap_list)
    out["buckets"] = [(b.plan.indices, b.plan.nbytes) for b in ddp.reducer.layout.buckets]
    return out


def buffer_options(rank: int, world: int) -> dict[str, Any]:
    """broadcast_buffers (deprecated) vs forward_sync_buffers: what BatchNorm sees at construction
    and at the start of its forward (rank r sets its running mean to r, then to r + 10)."""
    out: dict[str, Any] = {}
    for name, kw in (("broadcast_false", {"broadcast_buffers": False}),
                     ("forward_false", {"forward_sync_buffers": False}), ("default", {}),
                     ("batched", {"batched_grad_copy": True})):
        net = W.bn_net()
        net[1].running_mean.fill_(float(rank))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp = DDP(net, **kw)
        at_init = net[1].running_mean[0].item()
        net[1].running_mean.fill_(float(rank) + 10)
        seen: list[float] = []
        net[1].register_forward_pre_hook(lambda m, args: seen.append(m.running_mean[0].item()))
        ddp(W.data(rank, 0, (4, 6))).sum().backward()
        out[name] = (at_init, seen[0], ddp.broadcast_buffers, [w.category.__name__ for w in caught])
    return out


HOOKS = ["ALLREDUCE", "FP16_COMPRESS", "BF16_COMPRESS", "QUANTIZE_PER_TENSOR",
         "QUANTIZE_PER_CHANNEL", "POWER_SGD",
         "POWER_SGD_RANK2", "BATCHED_POWER_SGD", "BATCHED_POWER_SGD_RANK2", "NOOP"]


def hooks_by_name(rank: int, world: int) -> dict[str, tuple[str, int, float]]:
    """Every DDPCommHookType: (hook registered, PowerSGD rank, relative gradient error vs the exact
    average -- the local gradient for NOOP) after one backward (12 for PowerSGD, which compresses
    from iteration 10 on)."""
    out = {}
    for name in HOOKS:
        ddp = DDP(W.mlp(dtype=torch.float32))
        register_ddp_comm_hook(DDPCommHookType[name], ddp, None)
        state, hook = ddp.reducer.comm_hook
        steps = 12 if "POWER" in name else 1
        for step in range(steps):
            ddp.zero_grad()
            W.mlp_loss(ddp, rank, step).backward()
        got = torch.cat([p.grad.reshape(-1) for p in ddp.parameters()])
        ref = W.mlp(dtype=torch.float32)
        with torch.no_grad():
            for a, b in zip(ref.parameters(), ddp.parameters()):
                a.copy_(b)
        ranks = [rank] if name == "NOOP" else list(range(world))
        (sum(W.mlp_loss(ref, r, steps - 1) for r in ranks) / len(ranks)).backward()
        want = torch.cat([p.grad.reshape(-1) for p in ref.parameters()])
        out[name] = (hook.__name__, getattr(state, "matrix_approximation_rank", 0),
                     ((got - want).norm() / want.norm()).item())
    return out


def batched_powersgd_exact(rank: int, world: int) -> float:
    """A bucket whose average, as a padded square matrix, has rank 1 is reproduced exactly."""
    from ringlet.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import (
        PowerSGDState,
        batched_powerSGD_hook,
    )
    from ringlet.parallel.ddp import GradBucket

    u, v = torch.arange(1.0, 5.0), torch.tensor([1.0, -2.0, 0.5, 3.0])
    # 16 elements: a 4x4 matrix of rank 1
    mine = (rank + 1.0) * torch.outer(u, v).reshape(-1)
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                          use_error_feedback=False)
    state.iter = 2
    p = nn.Parameter(torch.zeros(16))
    result = batched_powerSGD_hook(state, GradBucket(0, mine.clone(), [p], [0], True)).wait()
    want = sum(r + 1.0 for r in range(world)) / world * torch.outer(u, v).reshape(-1)
    return (result - want).abs().max().item()


def logging_data(rank: int, world: int) -> dict[str, Any]:
    net = W.mlp(dtype=torch.float32)
    ddp = DDP(net)
    ddp._set_ddp_runtime_logging_sample_rate(2)
    iterations = []
    for step in range(14):
        ddp.zero_grad()
        W.mlp_loss(ddp, rank, step).backward()
        iterations.append(ddp._get_ddp_logging_data().get("iteration"))
    data = ddp._get_ddp_logging_data()
    errors = {}
    try:
        ddp._set_static_graph()
    except RuntimeError as e:
        errors["static"] = (str(e), ddp._get_ddp_logging_data().get("error"))
    try:
        ddp.register_comm_hook({}, {})      # type: ignore[arg-type]
    except TypeError as e:
        errors["hook"] = (str(e), ddp._get_ddp_logging_data().get("error"))
    return {"data": data, "iterations": iterations, "errors": errors}


def pickled(rank: int, world: int) -> dict[str, Any]:
    """torch.save/torch.load of a DDP model: the copy trains on the default group like the
    original."""
    ddp = DDP(W.bn_net())
    ddp(W.data(rank, 0, (4, 6))).sum().backward()
    buf = io.BytesIO()
    torch.save(ddp, buf)
    buf.seek(0)
    twin = torch.load(buf, weights_only=False)
    same_state = all(torch.equal(a, b)
                     for a, b in zip(ddp.state_dict().values(), twin.state_dict().values()))
    twin.zero_grad()
    twin(W.data(rank, 1, (4, 6))).sum().backward()
    grads = torch.cat([p.grad.reshape(-1) for p in twin.parameters()])
    from ringlet.c10d import all_gather_object, new_group

    seen: list[Any] = [None] * world
    all_gather_object(seen, grads)
    sub = DDP(W.bn_net(), process_group=new_group(list(range(world))))
    try:
        torch.save(sub, io.BytesIO())
        refused = ""
    except RuntimeError as e:
        refused = str(e)
    return {"type": type(twin).__name__, "same_state": same_state,
            "pg": twin.process_group is ddp.process_group,
            "grads_agree": all(torch.equal(seen[0], g) for g in seen), "refused": refused}


def proc_surface(rank: int, world: int) -> dict[str, Any]:
    """The same checks in a real process (shm transport)."""
    torch.set_num_threads(1)
    return {"caps": per_bucket_caps(rank, world, "list"), "hooks": hooks_by_name(rank, world),
            "logging": logging_data(rank, world)["data"], "pickled": pickled(rank, world)}
