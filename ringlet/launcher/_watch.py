"""Waiting for a generation's workers: blocked on pidfds and the signal
wake-up pipe, not on a timer.

``wait_workers`` sleeps in ``select`` until a worker exits (its pidfd becomes readable), a
signal reaches the launcher (``signal.set_wakeup_fd``), or a periodic check is due: another
node's failure (multi-node runs) or the heartbeats ([Note: heartbeat] in ``ringlet._heartbeat``).
Where pidfds or the wake-up fd are unavailable it falls back to waking every ``interval``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import selectors
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Sequence

from ringlet._heartbeat import SIZE, read_counter

__all__ = ["Heartbeats", "Outcome", "wait_workers"]

STACK_DUMP_S = 1.0   # a hung worker gets this long to print its stacks before SIGKILL


@dataclasses.dataclass
class Outcome:
    state: str                                  # succeeded, failed, interrupted, stopped
    failed: list[int] = dataclasses.field(default_factory=list)       # worker indices
    hung: dict[int, float] = dataclasses.field(default_factory=dict)  # index -> seconds silent
    signum: int | None = None


class Heartbeats:
    """The launcher's side of [Note: heartbeat]: one mapped counter file per worker."""

    def __init__(self, paths: Sequence[str], timeout: float) -> None:
        self.paths, self.timeout = list(paths), timeout
        self._views: list[memoryview] = []
        self._last: list[tuple[int, float]] = []

    def create(self) -> None:
        """Create the files (before the workers start, so they can map them)."""
        for path in self.paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                os.write(fd, bytes(SIZE))
                self._views.append(memoryview(mmap.mmap(fd, SIZE)).cast("q"))
            finally:
                os.close(fd)

    def started(self) -> None:
        now = time.monotonic()
        self._last = [(read_counter(v), now) for v in self._views]

    def silent(self, now: float) -> dict[int, float]:
        """Workers whose counter has not moved for the timeout, with how long they were silent."""
        out = {}
        for i, view in enumerate(self._views):
            count, since = self._last[i]
            current = read_counter(view)
            if current != count:
                self._last[i] = (current, now)
            elif current > 0 and now - since >= self.timeout:   # from its first beat to DONE
                out[i] = now - since
        return out

    @property
    def period(self) -> float:
        return min(max(self.timeout / 4, 0.05), 1.0)

    def close(self) -> None:
        for view in self._views:
            obj = view.obj
            view.release()
            with contextlib.suppress(BufferError):
                obj.close()   # type: ignore[attr-defined]
        self._views.clear()
        for path in self.paths:
            with contextlib.suppress(OSError):
                os.unlink(path)


@contextlib.contextmanager
def _wakeups(popens: Sequence[subprocess.Popen[bytes]],
             wake_fd: int | None) -> Iterator[tuple[selectors.BaseSelector, dict[int, int], bool]]:
    """A selector over the workers' pidfds, the signal wake-up pipe and ``wake_fd``; yields
    (selector, pidfd -> worker index, whether it can block without a timer)."""
    sel = selectors.DefaultSelector()
    if wake_fd is not None:
        sel.register(wake_fd, selectors.EVENT_READ, "elsewhere")
    fds: dict[int, int] = {}
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    blocking, previous = True, None
    try:
        previous = signal.set_wakeup_fd(w)
        sel.register(r, selectors.EVENT_READ, "signal")
    except ValueError:   # not the main thread: signals cannot wake us
        blocking = False
    for i, p in enumerate(popens):
        try:
            fd = os.pidfd_open(p.pid)
        except (OSError, AttributeError):
            blocking = False
            continue
        fds[fd] = i
        sel.register(fd, selectors.EVENT_READ, i)
    try:
        yield sel, fds, blocking
    finally:
        if previous is not None:
            signal.set_wakeup_fd(previous)
        sel.close()
        for fd in [*fds, r, w]:
            os.close(fd)


def wait_workers(popens: Sequence[subprocess.Popen[bytes]], interval: float,
                 interrupted: Callable[[], int | None], elsewhere: Callable[[], bool] | None,
                 heartbeats: Heartbeats | None, on_hung: Callable[[int], None],
                 wake_fd: int | None = None) -> Outcome:
    """Until all workers succeed, one fails or goes silent, a signal arrives, or ``elsewhere()``
    reports a failure on another node (``wake_fd`` readable: no need to ask it periodically).
    ``on_hung(i)`` must kill worker ``i``."""
    if heartbeats is not None:
        heartbeats.started()
    periodic = elsewhere if wake_fd is None else None
    with _wakeups(popens, wake_fd) as (sel, fds, blocking):
        while True:
            signum = interrupted()
            if signum is not None:
                return Outcome("interrupted", signum=signum)
            if elsewhere is not None and elsewhere():
                return Outcome("stopped")
            codes = [p.poll() for p in popens]
            failed = [i for i, rc in enumerate(codes) if rc not in (None, 0)]
            if failed:
                return Outcome("failed", failed=failed)
            if all(rc == 0 for rc in codes):
                return Outcome("succeeded")
            if heartbeats is not None:
                hung = {i: s for i, s in heartbeats.silent(time.monotonic()).items()
                        if codes[i] is None}
                if hung:
                    for i in hung:
                        on_hung(i)
                    return Outcome("failed", failed=sorted(hung), hung=hung)
            for fd, i in list(fds.items()):      # an exited worker's pidfd stays readable
                if codes[i] is not None:
                    sel.unregister(fd)
                    del fds[fd]
            _sleep(sel, _timeout(blocking, interval, periodic, heartbeats))


def _timeout(blocking: bool, interval: float, elsewhere: object,
             heartbeats: Heartbeats | None) -> float | None:
    periods = [interval] if (not blocking or elsewhere is not None) else []
    if heartbeats is not None:
        periods.append(heartbeats.period)
    return min(periods) if periods else None


def _sleep(sel: selectors.BaseSelector, timeout: float | None) -> None:
    for key, _ in sel.select(timeout):
        if key.data == "signal":
            with contextlib.suppress(OSError):
                os.read(key.fd, 512)   # drain; the handler recorded the signal


def kill_hung(popen: subprocess.Popen[bytes], dump_stacks: bool) -> None:
    """Ask a hung worker for its stacks (Python workers), then SIGKILL its process group."""
    if dump_stacks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(popen.pid, signal.SIGUSR1)
        with contextlib.suppress(subprocess.TimeoutExpired):
            popen.wait(STACK_DUMP_S)   # returns early only if the dump killed it
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(popen.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        popen.wait(10.0)
