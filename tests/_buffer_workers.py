"""Rank bodies of the comm_buffer tests (module level: process-tier tests pickle them by name)."""

from __future__ import annotations

import functools
import gc
import os
import signal
from typing import Any

import torch
from _workers import outcome

import ringlet.distributed as dist
from ringlet.c10d.world import resolve_group
from ringlet.transport import arena_inplace

BIG = 40_000          # float32 elements: above the in-place threshold (160 KB)


def _transport() -> Any:
    return resolve_group(None).transport


def _rand(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def parity(rank: int, n: int) -> int:
    """In-place results equal the ordinary path's bit for bit, for every op kind and dtype."""
    checks = 0
    cases = [(torch.float32, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.AVG),
             (torch.float64, dist.ReduceOp.MAX), (torch.int64, dist.ReduceOp.SUM),
             (torch.bfloat16, dist.ReduceOp.SUM),
             (torch.float32, dist._make_nccl_premul_sum(0.25))]
    for k, (dtype, op) in enumerate(cases):
        data = _rand(BIG + 7, 100 * k + rank, dtype)
        plain = data.clone()
        buf = dist.comm_buffer(data.shape, dtype)
        if not dist.is_comm_buffer(buf):
            raise AssertionError(f"rank {rank}: comm_buffer is not in the heap")
        buf.copy_(data)
        dist.all_reduce(plain, op=op)
        dist.all_reduce(buf, op=op)
        if not torch.equal(buf, plain):
            raise AssertionError(f"rank {rank}: all_reduce {dtype} {op} differs from the ordinary "
                                 "path")
        checks += 1
    checks += _gather_scatter_parity(rank, n)
    return checks


def _gather_scatter_parity(rank: int, n: int) -> int:
    N = BIG // n + 3
    inp = _rand(N, 7 + rank)
    want = torch.empty(N * n)
    dist.all_gather_into_tensor(want, inp)
    out = dist.comm_buffer(N * n)                        # into an arena output
    dist.all_gather_into_tensor(out, inp)
    src = dist.comm_buffer(N).copy_(inp)                 # from an arena input
    got = torch.empty(N * n)
    dist.all_gather_into_tensor(got, src)
    inner = dist.comm_buffer(N * n)                      # the input is the output's own block
    inner[rank * N:(rank + 1) * N].copy_(inp)
    dist.all_gather_into_tensor(inner, inner[rank * N:(rank + 1) * N])
    for name, t in (("arena output", out), ("arena input", got), ("own block", inner)):
        if not torch.equal(t, want):
            raise AssertionError(f"rank {rank}: all_gather into {name} differs")
    rin = _rand(N * n, 50 + rank)
    ref = torch.empty(N)
    dist.reduce_scatter_tensor(ref, rin)
    b = dist.comm_buffer(N * n).copy_(rin)
    o = torch.empty(N)
    dist.reduce_scatter_tensor(o, b)
    own = b[rank * N:(rank + 1) * N]                     # output = its own block of the input
    dist.reduce_scatter_tensor(own, b)
    if not (torch.equal(o, ref) and torch.equal(own, ref)):
        raise AssertionError(f"rank {rank}: reduce_scatter from an arena input differs")
    return 4


def mixed(rank: int, n: int) -> int:
    """Some ranks pass buffers, others ordinary tensors: every op still gives the right result."""
    done = 0
    for pattern in range(2 ** n):
        arena = bool(pattern >> rank & 1)
        t = (dist.comm_buffer(BIG) if arena else torch.empty(BIG)).fill_(rank + 1.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.equal(t, torch.full((BIG,), (n + 1) / 2)):
            raise AssertionError(f"rank {rank} pattern {pattern}: all_reduce gave {t[:3]}")
        inp = torch.full((BIG // n,), float(rank))
        out = dist.comm_buffer(BIG // n * n) if arena else torch.empty(BIG // n * n)
        dist.all_gather_into_tensor(out, inp)
        if not torch.equal(out, torch.arange(n, dtype=torch.float32).repeat_interleave(BIG // n)):
            raise AssertionError(f"rank {rank} pattern {pattern}: all_gather gave "
                                 f"{out[::BIG // n]}")
        rin = (dist.comm_buffer(BIG // n * n) if arena else torch.empty(BIG // n * n)).fill_(1.0)
        ro = torch.empty(BIG // n)
        dist.reduce_scatter_tensor(ro, rin)
        if not torch.equal(ro, torch.full_like(ro, float(n))):
            raise AssertionError(f"rank {rank} pattern {pattern}: reduce_scatter gave {ro[:3]}")
        done += 1
    return done


def reuse(rank: int, n: int, steps: int = 6) -> dict[str, int]:
    """One buffer reduced again and again with new data, async and sync, with frees between:
    each result is exact and freed regions are reused (the heap does not grow)."""
    heap = _transport().inplace.heap
    for step in range(steps):
        buf = dist.comm_buffer((BIG,))
        buf.fill_(float(rank + step))
        work = dist.all_reduce(buf, async_op=True)
        work.wait()
        del work                                     # it holds its tensors
        want = sum(r + step for r in range(n))
        if not torch.equal(buf, torch.full((BIG,), float(want))):
            raise AssertionError(f"rank {rank} step {step}: got {buf[:3]}, want {want}")
        view = buf[10:20]
        del buf
        gc.collect()
        if heap.live_bytes() == 0:
            raise AssertionError("a live view's block was freed")
        del view
        gc.collect()
    return {"live": heap.live_bytes(), "quarantined": heap.quarantined}


def outlives_group(rank: int, n: int) -> float:
    """A buffer stays valid memory after its group is destroyed; a new group treats it as an
    ordinary tensor."""
    g = dist.new_group()
    buf = dist.comm_buffer(BIG, group=g).fill_(1.0)
    dist.all_reduce(buf, group=g)
    dist.destroy_process_group(g)
    buf.add_(1.0)                                    # still mapped
    if dist.is_comm_buffer(buf):
        raise AssertionError("a buffer of a destroyed group counts as a buffer of the world")
    dist.all_reduce(buf)
    return float(buf[0])


def _die_in_place(rank: int, how: str) -> None:
    """Make ``rank`` fail inside its next in-place all_reduce, after the first round."""
    real = arena_inplace.InplaceCollectives._fold_and_push

    def failing(self: Any, *args: Any, **kwargs: Any) -> None:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyboardInterrupt("interrupted inside an in-place all_reduce")
    if dist.get_rank() == rank:
        arena_inplace.InplaceCollectives._fold_and_push = failing   # type: ignore[method-assign]
    else:
        arena_inplace.InplaceCollectives._fold_and_push = real      # type: ignore[method-assign]


def peer_fails_mid_op(rank: int, n: int, how: str) -> dict[str, Any]:
    """Rank 1 dies (``kill``) or is interrupted (``interrupt``) inside an in-place all_reduce:
    the others raise within the op timeout, the group is aborted, and freed buffers are
    quarantined."""
    heap = _transport().inplace.heap
    buf = dist.comm_buffer(BIG).fill_(1.0)
    spare = dist.comm_buffer(BIG)                    # freed after the failure
    dist.all_reduce(buf)                             # one good round trip first
    _die_in_place(1, how)
    report = outcome(functools.partial(dist.all_reduce, buf))
    del buf, spare           # (the group's stored error may keep `buf` alive: `spare` is free)
    gc.collect()
    return {**report, "quarantined": heap.quarantined}


def tcp_gives_plain(rank: int, n: int) -> bool:
    t = dist.comm_buffer((4, 5))
    t.fill_(1.0)
    dist.all_reduce(t)
    return dist.is_comm_buffer(t) or not torch.equal(t, torch.full((4, 5), float(n)))



def ddp_parity(rank: int, n: int, as_view: bool, steps: int = 6) -> dict[str, Any]:
    """DDP with buckets in shared memory (the default on shm/inproc) matches the single-process
    reference; a 400x400 float64 layer (1.28 MB) gets a solo bucket, the rest a packed one."""
    import _ddp_workers as dw

    from ringlet.parallel.ddp import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    net, ref = (dw.init_(dw.mlp(width=400), 0, scale=0.05) for _ in range(2))
    ddp = DDP(net, gradient_as_bucket_view=as_view)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    for step in range(steps):
        dw.mlp_loss(ddp, rank, step).backward()
        opt.step()
        opt.zero_grad(set_to_none=step % 2 == 0)     # both: .grad gone, .grad zeroed in place
        total, _ = dw.reference_loss(ref, dw.mlp_loss, n, step)
        total.backward()
        ropt.step()
        ropt.zero_grad()
    buckets = ddp.reducer.layout.buckets
    return {"param": max((a - b).abs().max().item()
                         for a, b in zip(net.parameters(), ref.parameters())),
            "solo": [b.plan.solo for b in buckets],
            "shared": [b.shared and dist.is_comm_buffer(b.own()) for b in buckets]}
