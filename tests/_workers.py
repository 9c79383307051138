"""Rank bodies used by process-tier tests (module level so that they pickle by reference)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

import ringlet.distributed as dist


class Evil:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.path}",))


def send_evil_object(rank: int, n: int, path: str) -> None:
    objs: list[Any] = [Evil(path)] if rank == 0 else [None]
    dist.broadcast_object_list(objs, src=0)


def allreduce_loop(rank: int, n: int, steps: int) -> float:
    t = torch.ones(1000)
    for _ in range(steps):
        dist.all_reduce(t)
        t.fill_(1.0)
    return time.time()


def skip_on_rank(rank: int, n: int, skipper: int, linger: float) -> None:
    dist.all_reduce(torch.ones(4))
    if rank != skipper:
        dist.all_reduce(torch.ones(4))
    time.sleep(linger)


def mismatch_op(rank: int, n: int) -> None:
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        dist.all_reduce(torch.ones(4))
    else:
        dist.broadcast(torch.ones(3), src=0)


def mismatch_shape(rank: int, n: int) -> None:
    dist.all_reduce(torch.ones(4 if rank == 0 else 3))


def mismatch_dtype(rank: int, n: int) -> None:
    dist.all_reduce(torch.ones(4, dtype=torch.float32 if rank == 0 else torch.float64))


def timed_until_error(rank: int, n: int, steps: int, numel: int = 1000) -> tuple[str, str, float]:
    """Loop all_reduce until an error; return (type, message, seconds from the error's op start)."""
    t0 = time.monotonic()
    try:
        for _ in range(steps):
            t0 = time.monotonic()
            dist.all_reduce(torch.ones(numel))
    except Exception as e:
        elapsed = time.monotonic() - t0
        try:
            dist.all_reduce(torch.ones(1))
            again = "usable"
        except Exception as e2:
            again = type(e2).__name__
        return type(e).__name__, f"{e} || next call: {again}", elapsed
    return "none", "", 0.0


def evaluate(seconds: float) -> None:
    time.sleep(seconds)           # the line a hang report must point at


def skip_into_evaluate(rank: int, n: int, seconds: float) -> None:
    dist.all_reduce(torch.ones(4))
    if rank == 1:
        evaluate(seconds)
    else:
        dist.all_reduce(torch.ones(4))


def detail_mismatch(rank: int, n: int) -> None:
    dist.all_reduce(torch.ones(4))
    if rank == 0:
        dist.all_reduce(torch.ones(2, 3))
    else:
        dist.all_reduce(torch.ones(3, 2))


def freeze_then_thaw(rank: int, n: int, t: float) -> tuple[str, float]:
    """Rank 1 stops itself at its 3rd collective; rank 0 times out, then thaws it (SIGCONT).
    The thawed rank must fail fast on the aborted group instead of carrying on."""
    import signal

    pids: list[Any] = [None] * n
    dist.all_gather_object(pids, os.getpid())
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)      # frozen before its 3rd collective
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4))
        except Exception as e:
            return type(e).__name__, time.monotonic() - t0
        return "none", 0.0
    try:
        dist.all_reduce(torch.ones(4))
    except Exception as e:
        os.kill(pids[1], signal.SIGCONT)
        return type(e).__name__, 0.0
    return "none", 0.0


def tagged_sum(rank: int, n: int, tag: float, steps: int) -> float:
    t = torch.full((1000,), tag + rank)
    for _ in range(steps):
        dist.all_reduce(t)
        t.fill_(tag + rank)
    dist.all_reduce(t)
    return float(t[0])


_RNG_LOCK = threading.Lock()


def seeded(seed: int, build: Callable[[], Any]) -> Any:
    """``build()`` right after ``torch.manual_seed(seed)``, one rank thread at a time: ranks that
    are threads share torch's global generator, so a peer's draw between the seed and the build
    would give this rank other initial weights."""
    with _RNG_LOCK:
        torch.manual_seed(seed)
        return build()


def outcome(body: Callable[[], Any]) -> dict[str, Any]:
    """Run ``body`` and report what it raised (``"none"`` if nothing), as ``"Type: message"``, and
    how long it took: the rank side of :func:`survivors_failed_fast`."""
    t0 = time.monotonic()
    try:
        body()
    except BaseException as e:   # the test reports what was raised, KeyboardInterrupt included
        err = f"{type(e).__name__}: {e}"
    else:
        err = "none"
    return {"error": err, "elapsed": time.monotonic() - t0}


def survivors_failed_fast(res: list[Any], survivors: tuple[int, ...], dead: int,
                          within: float) -> list[dict[str, Any]]:
    """Check that each surviving rank of a run_world result raised a peer-failure (or abort)
    error naming rank ``dead`` within ``within`` seconds -- long before the op's timeout, which
    is what a dead peer must not cost; returns the survivors' reports for further checks."""
    got = []
    for r in survivors:
        report = res[r].value
        assert report is not None, res[r].message
        assert report["error"].startswith(("PeerFailureError", "GroupAbortedError")), report
        assert f"rank {dead}" in report["error"], report
        assert report["elapsed"] < within, report
        got.append(report)
    return got


def non_member_warnings(rank: int, n: int) -> list[str]:
    """Calls on a group this rank is not in: torch's warning for operations, none for queries
    and context managers."""
    import warnings

    g = dist.new_group([0, 1])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        dist.broadcast_object_list([None], src=0, group=g)
        dist.barrier(group=g)
        if rank == 2:
            dist.is_comm_buffer(t, group=g)
            with dist._coalescing_manager(group=g):
                pass
    return [str(w.message) for w in seen if issubclass(w.category, UserWarning)]
