"""Rank bodies for tests/test_waits.py: waiters blocked on a slow, stopped, dead, departed or
aborting peer (module level, so that forkserver children can import them)."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from typing import Any

import torch

import ringlet.distributed as dist


def naps() -> int:
    """Futex sleeps of this rank in the default group's arena (0 without a doorbell)."""
    bell = dist.group.WORLD.transport.arena.bell
    return bell.naps if bell is not None else 0


def has_doorbell() -> bool:
    return dist.group.WORLD.transport.arena.bell is not None


def _timed(fn: Any) -> tuple[str, str, float]:
    """(exception type or 'none', message, seconds) of ``fn()``."""
    t0 = time.monotonic()
    try:
        fn()
    except Exception as e:      # reported to the test
        return type(e).__name__, str(e), time.monotonic() - t0
    return "none", "", time.monotonic() - t0


def slow_peer(rank: int, n: int, delay: float) -> tuple[list[float], float, int, bool]:
    """Rank 1 reaches the all_reduce ``delay`` s late: rank 0 waits (sleeps) meanwhile."""
    t = torch.full((4,), float(rank + 1))
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
    t0 = time.monotonic()
    dist.all_reduce(t)
    return t.tolist(), time.monotonic() - t0, naps(), has_doorbell()


def slow_p2p(rank: int, n: int, delay: float) -> tuple[bool, float, int]:
    """Rank 1's receive starts late (rank 0's send waits for acknowledgements), then rank 1's
    reply is sent late (rank 0's receive waits for the message).  600 KB: several chunks."""
    big = torch.arange(150_000, dtype=torch.float32)
    dist.barrier()
    t0 = time.monotonic()
    if rank == 0:
        dist.send(big, 1)
        back = torch.zeros_like(big)
        dist.recv(back, 1)
        ok = torch.equal(back, big * 2)
    else:
        time.sleep(delay)
        got = torch.zeros_like(big)
        dist.recv(got, 0)
        time.sleep(delay)
        dist.send(got * 2, 0)
        ok = torch.equal(got, big)
    return ok, time.monotonic() - t0, naps()


def _stopped(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")
    except OSError:
        return False


def stopped_peer(rank: int, n: int, pause: float) -> tuple[list[float], float, int]:
    """Rank 1 stops itself (SIGSTOP) before the all_reduce; rank 0, already waiting, has a
    thread continue it ``pause`` s after it was seen stopped."""
    pids: list[Any] = [None] * n
    dist.all_gather_object(pids, os.getpid())
    t = torch.full((4,), float(rank + 1))
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        dist.all_reduce(t)
        return t.tolist(), 0.0, naps()

    def thaw() -> None:
        deadline = time.monotonic() + 10.0
        while not _stopped(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(pause)
        os.kill(pids[1], signal.SIGCONT)

    thawer = threading.Thread(target=thaw)
    thawer.start()
    t0 = time.monotonic()
    try:
        dist.all_reduce(t)
    finally:
        thawer.join(15.0)
    return t.tolist(), time.monotonic() - t0, naps()


def dies_while_awaited(rank: int, n: int, delay: float) -> tuple[str, str, float]:
    """Rank 1 is SIGKILLed ``delay`` s after rank 0 started waiting for it."""
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
        os.kill(os.getpid(), signal.SIGKILL)
    return _timed(lambda: dist.all_reduce(torch.ones(4)))


def ends_while_awaited(rank: int, n: int, delay: float, how: str) -> tuple[str, str, float]:
    """Rank 1 leaves (``how="leave"``: destroys its group) or aborts the group (``"abort"``)
    ``delay`` s after rank 0 started waiting for it."""
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
        if how == "leave":
            dist.destroy_process_group()
        else:
            dist.group.WORLD.abort("rank 1 gives up (test)")
        return "none", "", 0.0
    return _timed(lambda: dist.all_reduce(torch.ones(4)))


def late_past_deadline(rank: int, n: int, delay: float) -> tuple[str, str, float]:
    """Rank 1 arrives ``delay`` s late, after rank 0's deadline."""
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
    return _timed(lambda: dist.all_reduce(torch.ones(4)))


def jittery_loop(rank: int, n: int, steps: int, seed: int) -> tuple[bool, int]:
    """``steps`` collectives with random short stalls on every rank: sleeps and wake-ups of
    several ranks interleave; every result is checked."""
    rng = random.Random(seed * 1000 + rank)
    ok = True
    for i in range(steps):
        if rng.random() < 0.3:
            time.sleep(rng.random() * 2e-3)
        t = torch.full((8,), float(rank + i))
        dist.all_reduce(t)
        ok = ok and bool((t == sum(r + i for r in range(n))).all())
        b = torch.full((3,), float(rank))
        dist.broadcast(b, src=i % n)
        ok = ok and bool((b == i % n).all())
    return ok, naps()


def stopped_peer_gives_up(rank: int, n: int, how: str, delay: float) -> tuple[str, str, float]:
    """Rank 1 stops itself (SIGSTOP) before an all_reduce.  Rank 0 waits for it until its
    deadline (``how="deadline"``) or until rank 2 aborts the group ``delay`` s in (``"abort"``);
    then rank 0 continues rank 1, whose all_reduce must fail too (the group was given up)."""
    pids: list[Any] = [None] * n
    dist.all_gather_object(pids, os.getpid())
    t = torch.ones(4)
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)
        return _timed(lambda: dist.all_reduce(t))
    if rank == 2 and how == "abort":
        time.sleep(delay)
        dist.group.WORLD.abort("rank 2 gives up on a stopped rank (test)")
        return "none", "", 0.0
    if rank != 0:
        return _timed(lambda: dist.all_reduce(t))
    ended = threading.Event()

    def thaw() -> None:                 # always continue rank 1, once rank 0's wait has ended
        deadline = time.monotonic() + 10.0
        while not _stopped(pids[1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        ended.wait(30.0)
        os.kill(pids[1], signal.SIGCONT)

    thawer = threading.Thread(target=thaw)
    thawer.start()
    try:
        return _timed(lambda: dist.all_reduce(t))
    finally:
        ended.set()
        thawer.join(40.0)


def _switches() -> int:
    """Voluntary context switches of every thread of this process so far (each one a wake-up
    after blocking)."""
    total = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/status") as f:
                for line in f:
                    if line.startswith("voluntary_ctxt_switches:"):
                        total += int(line.split()[1])
        except OSError:             # a thread that just ended
            pass
    return total


def wakeups_while_awaited(rank: int, n: int, delay: float) -> tuple[int, float]:
    """Rank 1 reaches an all_reduce ``delay`` s late; rank 0 returns how often its threads woke
    up meanwhile and how long it waited."""
    t = torch.ones(4)
    dist.barrier()
    if rank == 1:
        time.sleep(delay)
        dist.all_reduce(t)
        return 0, 0.0
    before, t0 = _switches(), time.monotonic()
    dist.all_reduce(t)
    return _switches() - before, time.monotonic() - t0
