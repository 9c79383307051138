"""Rank bodies for tests/test_tcp_overlap.py: the tcp transport with ``RINGLET_TCP_OVERLAP=1``
(the reader thread receives a collective's frames while the calling thread sends and reduces;
[Note: tcp I/O overlap])."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch

import ringlet.distributed as dist
from ringlet.transport.tcp.inbox import Inbox


def _count_served(counts: list[int]) -> Any:
    """Count the operations the reader thread serves on this rank (wraps ``Inbox.serve``)."""
    plain = Inbox.serve

    def serve(self: Inbox, on: bool) -> None:
        if on:
            counts[0] += 1
        plain(self, on)
    Inbox.serve = serve           # type: ignore[method-assign]
    return plain


def served_and_correct(rank: int, n: int) -> dict[str, Any]:
    """Large collectives (many 4 KiB chunks) are served by the reader thread and give exact
    results; small ones are not served (a hand-off would cost more than it saves)."""
    counts = [0]
    plain = _count_served(counts)
    try:
        out: dict[str, Any] = {}
        big = 50_000
        t = torch.arange(big, dtype=torch.float64) + rank
        dist.all_reduce(t)
        want = torch.arange(big, dtype=torch.float64) * n + n * (n - 1) // 2
        out["all_reduce"] = bool(torch.equal(t, want))
        g = torch.empty(big * n)
        dist.all_gather_into_tensor(g, torch.full((big,), float(rank)))
        out["all_gather"] = bool(torch.equal(g, torch.arange(n).repeat_interleave(big).float()))
        b = torch.full((big,), float(rank))
        dist.broadcast(b, src=n - 1)
        out["broadcast"] = bool(torch.equal(b, torch.full((big,), float(n - 1))))
        out["served_big"] = counts[0]
        dist.all_reduce(torch.ones(10))
        out["served_small"] = counts[0] - out["served_big"]
        return out
    finally:
        Inbox.serve = plain       # type: ignore[method-assign]


def abort_during_big_collective(rank: int, n: int) -> tuple[str, str, float]:
    """Rank 0 aborts from another thread while it waits in a served all_reduce that rank 1 joins
    only later; rank 1 then hears the ABORT."""
    pg = dist.group.WORLD
    t = torch.ones(50_000)
    t0 = time.monotonic()
    try:
        if rank == 0:
            threading.Timer(0.3, lambda: pg.abort("stopped by the test")).start()
            dist.all_reduce(t)
        else:
            time.sleep(1.0)
            t0 = time.monotonic()
            dist.all_reduce(t)
    except Exception as e:
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


def threads_after_destroy(rank: int, n: int) -> tuple[bool, list[str]]:
    """A tcp group that ran served collectives and messages leaves no thread behind."""
    g = dist.new_group(list(range(n)), backend="tcp")
    t = torch.ones(50_000)
    for _ in range(3):
        dist.all_reduce(t, group=g)
    if rank == 0:
        dist.send(torch.ones(8), 1, group=g)
    elif rank == 1:
        dist.recv(torch.empty(8), 0, group=g)
    ok = bool(torch.equal(t, torch.full((50_000,), float(n ** 3))))
    dist.barrier()
    dist.destroy_process_group(g)
    time.sleep(0.1)
    return ok, [th.name for th in threading.enumerate() if g.group_desc in th.name]
