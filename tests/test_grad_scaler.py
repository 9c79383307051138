"""Loss scaling with sharded gradients (ranks as threads): torch's ``GradScaler`` on fully_shard's
DTensor gradients, and ``ShardedGradScaler``.  An overflow that only one rank sees must make
every rank skip the step together."""

from __future__ import annotations

import copy

import pytest
import torch
from _workers import seeded
from torch import nn

import ringlet.distributed as dist
from ringlet.distributed.fsdp import fully_shard
from ringlet.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _mlp(dtype: torch.dtype = torch.float32) -> nn.Module:
    return seeded(0, lambda: nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).to(dtype))


def _batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s 1/world of the step's batch of 8 (world 1: all of it)."""
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=gen).chunk(world)[rank]


def _step(model: nn.Module, opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler,
          x: torch.Tensor, poison: bool = False) -> None:
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()
    if poison:                               # an overflow in this rank's piece only
        g = next(iter(model.parameters())).grad
        (g.to_local() if hasattr(g, "to_local") else g).view(-1)[0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def _fully_shard_with_torch_scaler(rank: int, world: int) -> tuple[float, ...]:
    ref = _mlp()
    model = copy.deepcopy(ref)
    fully_shard(model[0])
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    _step(model, opt, scaler, _batch(0, rank, world))
    _step(ref, ref_opt, ref_scaler, _batch(0, 0, 1))         # the whole batch in one process
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, rtol=1e-5, atol=1e-6)
    before = [p.full_tensor().clone() for p in model.parameters()]
    _step(model, opt, scaler, _batch(1, rank, world), poison=rank == 1)
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p.full_tensor(), b), f"rank {rank} stepped past an overflow"
    return scaler.get_scale(), float(sum(p.to_local().sum() for p in model.parameters()))


def test_torch_grad_scaler_on_fully_shard_skips_on_every_rank() -> None:
    """The shards' overflow flags are reduced (MAX) over the mesh: rank 0, whose shard is
    finite, skips with rank 1 and both halve the scale; a normal step matches one process."""
    a, b = run_threads(_fully_shard_with_torch_scaler, 2)
    assert a[0] == b[0] == 512.0


def _sharded_scaler(rank: int, world: int) -> tuple[float, list[int], bool]:
    model = _mlp(torch.float16)
    with torch.no_grad():                       # ranks hold different values, as shards do
        for p in model.parameters():
            p.add_(rank * 0.01)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0)
    pg = dist.group.WORLD
    _step(model, opt, scaler, _batch(0, rank, world).half())
    stepped = [p.clone() for p in model.parameters()]
    pg.reset_counts()
    _step(model, opt, scaler, _batch(1, rank, world).half(), poison=rank == 0)
    calls = pg.counts().get("all_reduce", 0)
    unchanged = all(torch.equal(p, s) for p, s in zip(model.parameters(), stepped))
    return scaler.get_scale(), [calls], unchanged


def test_sharded_grad_scaler_agrees_across_the_group_with_float16_grads() -> None:
    """torch's ShardedGradScaler at its module path: float16 gradients are accepted, one
    all_reduce per unscale, an overflow on rank 0 makes rank 1 skip too."""
    a, b = run_threads(_sharded_scaler, 2)
    assert a == b == (512.0, [1], True), (a, b)


def test_sharded_grad_scaler_takes_torchs_arguments() -> None:
    s = ShardedGradScaler(device="cpu", init_scale=8.0, backoff_factor=0.25, growth_factor=4.0,
                          growth_interval=3, enabled=True, process_group=None)
    assert (s.get_scale(), s.get_backoff_factor(), s.get_growth_factor(),
            s.get_growth_interval(), s.process_group) == (8.0, 0.25, 4.0, 3, None)
