"""Real multi-process worlds for tests: ``run_world(n, fn, *args)``.

Ranks come from a ``forkserver`` that preloads torch and ringlet (2.5 s once,
then ~0.06 s per launch, measured on 2 cores), so the pool of pre-imported workers is
shared by every test of a session.  The parent hosts the TCPStore; children
die with the parent (``PR_SET_PDEATHSIG``) and are always reaped: SIGTERM,
bounded join, SIGKILL.  Hung ranks dump their Python stacks (``faulthandler``)
before being killed.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["RankResult", "forkserver_context", "raise_first", "run_world"]

_ctx: list[Any] = [None]


@dataclasses.dataclass
class RankResult:
    """What one rank did: its exit code, return value or exception, and when it ended."""

    rank: int
    exitcode: int | None
    value: Any = None
    exc_type: str | None = None
    message: str = ""
    traceback: str = ""
    elapsed: float = 0.0      # seconds from the start of the world to the rank's end
    exception: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.exitcode == 0 and self.exc_type is None


def forkserver_context() -> Any:
    """The shared ``forkserver`` context whose server preloads torch and ringlet (made once)."""
    if _ctx[0] is None:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(["torch", "ringlet.distributed", "ringlet.testing.procs"])
        _ctx[0] = ctx
    return _ctx[0]


def _set_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _child(rank: int, n: int, port: int, backend: str, op_timeout: float, env: dict[str, str],
           fn: Callable[..., Any], args: tuple[Any, ...], conn: Any, t0: float) -> None:
    _set_pdeathsig()
    import faulthandler

    faulthandler.register(signal.SIGUSR1, all_threads=True)
    os.environ.update(env)
    import torch

    torch.set_num_threads(1)
    from ringlet import c10d as dist
    from ringlet.store import TCPStore

    store = None
    try:
        store = TCPStore("127.0.0.1",
                         port, n, is_master=False, timeout=timedelta(seconds=op_timeout + 10))
        dist.init_process_group(backend, store=store, rank=rank, world_size=n,
                                timeout=timedelta(seconds=op_timeout))
        value = fn(rank, n, *args)
        conn.send(("ok", value, None, "", "", time.time() - t0))
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        try:
            picklable: BaseException | None = e
            import pickle

            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            picklable = None
        conn.send(("err", None, picklable, type(e).__name__, f"{e}\n{traceback.format_exc()}",
                   time.time() - t0))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        if store is not None:
            store.close()
        conn.close()


def run_world(n: int, fn: Callable[..., Any], *args: Any, backend: str = "shm",
              timeout: float = 60.0, op_timeout: float = 10.0,
              env: dict[str, str] | None = None) -> list[RankResult]:
    """Run ``fn(rank, n, *args)`` in ``n`` processes joined in one default group.

    ``fn`` must be importable (module level).  Returns one :class:`RankResult`
    per rank; never raises for a rank's failure (see :func:`raise_first`).
    """
    from ringlet.store import TCPStore

    ctx = forkserver_context()
    server = TCPStore("127.0.0.1", 0, n + 1, is_master=True, timeout=timedelta(seconds=timeout),
                      wait_for_workers=False)
    procs, conns = [], []
    t0 = time.time()
    try:
        for r in range(n):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_child, name=f"rank{r}", daemon=True,
                            args=(r, n, server.port, backend, op_timeout, env or {}, fn, args,
                                  child, t0))
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        return _collect(procs, conns, t0, timeout)
    finally:
        _reap(procs)
        for c in conns:
            c.close()
        server.close()


def _collect(procs: list[Any], conns: list[Any], t0: float, timeout: float) -> list[RankResult]:
    results: list[RankResult | None] = [None] * len(procs)
    deadline = time.time() + timeout
    pending = set(range(len(procs)))
    while pending and time.time() < deadline:
        for r in list(pending):
            died = False
            if conns[r].poll(0.01):
                try:
                    _, value, exc, etype, msg, elapsed = conns[r].recv()
                except EOFError:   # the rank died without reporting
                    died = True
                else:
                    results[r] = RankResult(r, None, value, etype or None, msg, "", elapsed, exc)
                    pending.discard(r)
                    continue
            if died or not procs[r].is_alive():
                procs[r].join(1.0)
                results[r] = RankResult(r, procs[r].exitcode, None, "died",
                                        f"rank {r} exited with code "
                                        f"{procs[r].exitcode} without reporting",
                                        "", time.time() - t0)
                pending.discard(r)
    for r in pending:   # hung: dump stacks, then the finally-block kills it
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except (ProcessLookupError, TypeError):
            pass
        results[r] = RankResult(r, None, None, "hung", f"rank {r} still running after {timeout} s",
                                "", time.time() - t0)
    if pending:
        time.sleep(0.3)       # let the stack dumps reach stderr
        for r in pending:
            procs[r].kill()   # SIGKILL also ends a stopped (SIGSTOP) rank
    for r, p in enumerate(procs):
        p.join(5.0)
        res = results[r]
        if res is not None and res.exitcode is None:
            res.exitcode = p.exitcode
    return [r for r in results if r is not None]


def _reap(procs: list[Any]) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.time() + 3.0
    for p in procs:
        p.join(max(0.0, deadline - time.time()))
        if p.is_alive():
            p.kill()
            p.join(2.0)


def raise_first(results: list[RankResult]) -> list[Any]:
    """Values of a successful world, or an AssertionError describing the first failing rank."""
    bad = sorted((r for r in results if not r.ok), key=lambda r: r.elapsed)
    if bad:
        first = bad[0]
        raise AssertionError(f"rank {first.rank} failed first ({first.exc_type}, exit "
                             f"{first.exitcode}): {first.message}")
    return [r.value for r in results]
