"""Rank bodies of the peer-read all-reduce tests (module level: run_world pickles them by name).

The groups run with ``RINGLET_SHM_PEER_READ_BYTES=4096`` (set by the tests), so that small
tensors take the path; ``transport.inplace.peer_read_bytes = 0`` switches it off on one rank."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch
from _workers import outcome

import ringlet.distributed as dist
from ringlet.c10d.world import resolve_group
from ringlet.transport import arena_inplace
from ringlet.transport.arena_algos import FAST_BYTES

NUMEL = 70_001        # float32: 280 KB, more than one 256 KiB piece per rank, odd for any n


def _transport() -> Any:
    return resolve_group(None).transport


def _count_peer_reads() -> list[int]:
    """Count this process's runs of the peer-read algorithm (wraps it once)."""
    real = arena_inplace.peer_read_all_reduce
    calls = [0]

    def counting(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        real(*args, **kwargs)
    arena_inplace.peer_read_all_reduce = counting    # type: ignore[assignment]
    return calls


def _rand(numel: int, seed: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return torch.randn(numel, generator=g).to(dtype)
    return torch.randint(-1000, 1000, (numel,), generator=g, dtype=dtype)


def parity(rank: int, n: int) -> dict[str, Any]:
    """Peer-read results equal the slot path's bit for bit, for every kind of op and dtype."""
    tr = _transport()
    calls = _count_peer_reads()
    cases = [(torch.float32, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.AVG),
             (torch.float64, dist.ReduceOp.MAX), (torch.int64, dist.ReduceOp.SUM),
             (torch.bfloat16, dist.ReduceOp.SUM), (torch.float32, dist.ReduceOp.PRODUCT),
             (torch.float32, dist._make_nccl_premul_sum(0.25))]
    checked = 0
    for k, (dtype, op) in enumerate(cases):
        for numel in (NUMEL, FAST_BYTES // dtype.itemsize + 3):   # above the latency path
            data = _rand(numel, 100 * k + rank + numel, dtype).view(-1, 1)
            fast, plain = data.clone(), data.clone()
            dist.all_reduce(fast, op=op)
            tr.inplace.peer_read_bytes = 0
            dist.all_reduce(plain, op=op)
            tr.inplace.peer_read_bytes = 4096
            if not torch.equal(fast, plain):
                raise AssertionError(f"rank {rank}: {dtype} {op} numel {numel}: the peer-read "
                                     f"result differs from the slot path's")
            checked += 1
    return {"checked": checked, "peer_reads": calls[0], "why_not": tr.inplace.reader.why_not}


_MODES = ("reads", "slots", "buffer")


def mixed(rank: int, n: int) -> int:
    """Every mix of ranks reading peers, ranks with the path off and ranks passing heap buffers
    gives the right result (all of them fall back together when one does not read)."""
    tr = _transport()
    calls = _count_peer_reads()
    done = 0
    for pattern in range(len(_MODES) ** n):
        modes = [_MODES[pattern // len(_MODES) ** r % len(_MODES)] for r in range(n)]
        mode = modes[rank]
        tr.inplace.peer_read_bytes = 0 if mode == "slots" else 4096
        before = calls[0]
        t = dist.comm_buffer(NUMEL) if mode == "buffer" else torch.empty(NUMEL)
        t.fill_(rank + 1.0)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        if not torch.equal(t, torch.full((NUMEL,), (n + 1) / 2)):
            raise AssertionError(f"rank {rank} modes {modes}: all_reduce gave {t[:3]}")
        ran = calls[0] > before
        if ran != all(m == "reads" for m in modes):
            raise AssertionError(f"rank {rank} modes {modes}: peer reads ran: {ran}")
        done += 1
    tr.inplace.peer_read_bytes = 4096
    return done


def peer_dies(rank: int, n: int, how: str) -> dict[str, Any]:
    """Rank 1 dies (``kill``) or is interrupted inside a peer-read all_reduce; the others raise
    fast, naming it, and leave no result."""
    t = torch.ones(NUMEL)
    dist.all_reduce(t)                              # one good run first
    if rank == 1:
        real = arena_inplace.peer_read_all_reduce

        def failing(*args: Any, **kwargs: Any) -> None:
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise KeyboardInterrupt("interrupted inside a peer-read all_reduce")
        arena_inplace.peer_read_all_reduce = failing   # type: ignore[assignment]
        del real
    return outcome(lambda: dist.all_reduce(t))
