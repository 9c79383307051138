"""Rank bodies of tests/test_compile.py: DDP and fully_shard under torch.compile (real processes:
dynamo's state is per process)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from ringlet.distributed.fsdp import fully_shard
from ringlet.nn.parallel import DistributedDataParallel


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(),
                         nn.Linear(16, 2))


def _wrap(model: nn.Module, how: str, backend: str) -> nn.Module:
    if how == "ddp(compile(model))":
        return DistributedDataParallel(torch.compile(model, backend=backend))
    if how == "compile(ddp(model))":
        return torch.compile(DistributedDataParallel(model), backend=backend)
    if how == "compile(fully_shard(model))":
        for layer in model:
            if isinstance(layer, nn.Linear):
                fully_shard(layer)
        return torch.compile(fully_shard(model), backend=backend)
    raise ValueError(how)


def _full(p: torch.Tensor) -> torch.Tensor:
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def compiled_vs_local(rank: int, n: int, hows: list[str], backend: str) -> dict[str, float]:
    """Train each wrapping of the same model for 4 steps on this rank's share of each batch;
    the largest parameter difference from one uncompiled process on the whole batches."""
    torch._dynamo.reset()
    out = {}
    for how in hows:
        ref = _model()
        model = _wrap(copy.deepcopy(ref), how, backend)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        for step in range(4):
            full = torch.randn(4 * n, 8, generator=torch.Generator().manual_seed(step))
            for m, o, x in ((model, opt, full.chunk(n)[rank]), (ref, ref_opt, full)):
                m(x).pow(2).mean().backward()
                o.step()
                o.zero_grad()
        out[how] = max(float((_full(p.detach()) - q.detach()).abs().max())
                       for p, q in zip(model.parameters(), ref.parameters()))
    return out


def tensor_parallel(rank: int, n: int, backend: str) -> float:
    """A column/row-wise parallelized MLP, compiled with ``backend``: its largest parameter
    difference from one uncompiled process after 3 steps."""
    from ringlet.distributed.device_mesh import init_device_mesh
    from ringlet.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", (n,))
    ref = _model()
    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    model = parallelize_module(copy.deepcopy(ref), mesh, plan)
    compiled = torch.compile(model, backend=backend)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        for m, o in ((compiled, opt), (ref, ref_opt)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    return max(float((_full(p) - q).abs().max())
               for p, q in zip(model.parameters(), ref.parameters()))
