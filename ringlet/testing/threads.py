"""Ranks as threads: one process, one ``inproc`` world per thread (see [Note:
where the world lives])."""

from __future__ import annotations

import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from ringlet.c10d import _current
from ringlet.c10d import world as _world

__all__ = ["RankFailure", "run_threads"]


class RankFailure(AssertionError):
    """A rank of a test world failed; ``rank``, ``cause`` and the rank's traceback are attached."""

    def __init__(self, message: str, rank: int, cause: BaseException | None) -> None:
        super().__init__(message)
        self.rank = rank
        self.cause = cause


def run_threads(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0,
                op_timeout: float = 10.0, **kwargs: Any) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` rank threads.

    Each thread joins its own default group (backend ``inproc``, op deadline
    ``op_timeout``).  Returns the per-rank results.  Raises :class:`RankFailure`
    for the first rank (by time) that raised; if ranks are still running after
    ``timeout`` their groups are aborted so that they end, and the failure names them.
    """
    from ringlet.store import HashStore

    store = HashStore()
    results: list[Any] = [None] * world_size
    errors: list[tuple[float, int, BaseException, str]] = []
    worlds: list[Any] = []
    lock = threading.Lock()

    def body(rank: int) -> None:
        _current._thread_mode.set(True)
        try:
            _world.init_process_group("inproc", store=store, rank=rank, world_size=world_size,
                                      timeout=op_timeout)
            with lock:
                worlds.append(_world.current_world())
            results[rank] = fn(rank, world_size, *args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - reported to the caller
            with lock:
                errors.append((time.monotonic(), rank, e, traceback.format_exc()))
            _abort_current()
        finally:
            if _world.is_initialized():
                _world.destroy_process_group()

    threads = [threading.Thread(target=body, args=(r,), name=f"rank{r}", daemon=True)
               for r in range(world_size)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, t in enumerate(threads) if t.is_alive()]
    if hung:
        with lock:
            for w in worlds:
                for pg in w.groups:
                    pg.abort(f"run_threads: ranks {hung} still running after {timeout} s")
        for t in threads:
            t.join(5.0)
        raise RankFailure(f"run_threads: ranks {hung} did not finish within {timeout} s",
                          hung[0], None)
    if errors:
        errors.sort(key=lambda e: e[0])
        _, rank, exc, tb = errors[0]
        raise RankFailure(f"rank {rank} failed first: {type(exc).__name__}: {exc}\n{tb}",
                          rank, exc) from exc
    return results


def _abort_current() -> None:
    w = _world.current_world(required=False)
    if w is None:
        return
    for pg in w.groups:
        pg.abort("a rank of run_threads raised")
