"""``Work`` handles and the per-group communication thread that runs async operations in order."""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

from ringlet.errors import DistBackendError

__all__ = ["Executor", "Work"]


def _seconds(timeout: float | timedelta | None) -> float | None:
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    return timeout


class Work:
    """Handle of an operation; torch's ``Work`` API.

    ``wait(timeout=None)`` blocks until the operation finished and re-raises its
    error; it is bounded by the operation's own deadline.  ``get_future()``
    returns a ``torch.futures.Future`` completed with the op's output tensors.

    Example::

        work = dist.all_reduce(t, async_op=True)
        ...  # compute meanwhile
        work.wait()
    """

    def __init__(self, result: Any = None, op: str = "?", bound: float = 300.0,
                 device: torch.device | None = None) -> None:
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._result = result
        self._future: torch.futures.Future | None = None
        self._lock = threading.Lock()
        self._op = op
        self._bound = bound      # seconds the op may take after it started (its timeout)
        self._src = -1
        # A CUDA op's future is CUDA-aware: its callbacks and waits follow the op on the streams
        # ([Note: CUDA streams] in _cuda.py).
        self._devices: list[torch.device | int | str] | None = (
            [device] if device is not None and device.type == "cuda" else None)

    # -- completion (called by the executor) -------------------------------------------
    def _complete(self, exc: BaseException | None = None) -> None:
        with self._lock:
            self._exc = exc
            self._done.set()
            fut = self._future
        if fut is not None:
            self._fire(fut)

    def _fire(self, fut: torch.futures.Future) -> None:
        if self._exc is not None:
            fut.set_exception(self._exc)
        else:
            fut.set_result(self._result)

    # -- torch's API -------------------------------------------------------------------
    def wait(self, timeout: float | timedelta | None = None) -> bool:
        limit = _seconds(timeout)
        if limit is None or limit <= 0:
            limit = self._bound + 30.0   # the op's own deadline ends it first
        if not self._done.wait(limit):
            raise DistBackendError(f"Work.wait: {self._op} did not complete within {limit:.1f} s",
                                   op=self._op, timeout=limit)
        if self._exc is not None:
            raise self._exc
        return True

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._exc is None

    def exception(self) -> BaseException | None:
        return self._exc

    def result(self) -> Any:
        self.wait()
        return self._result

    def source_rank(self) -> int:
        """The global rank a completed receive got its message from (``irecv`` from any rank)."""
        self.wait()
        return self._src

    _source_rank = source_rank     # torch's (private) spelling, which published code calls

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                self._future = (torch.futures.Future(devices=self._devices) if self._devices
                                else torch.futures.Future())
                if self._done.is_set():
                    self._fire(self._future)
            return self._future

    def __repr__(self) -> str:
        state = "pending" if not self._done.is_set() else ("failed" if self._exc else "done")
        return f"Work({self._op}, {state})"


class _Completed(Work):
    """A Work that finished at creation (world size 1, non-members, inline runs)."""

    def __init__(self, result: Any = None, op: str = "?") -> None:
        super().__init__(result, op)
        self._done.set()


class Executor:
    """One daemon thread that runs a group's queued operations in issue order."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._queue: collections.deque[tuple[Callable[[], Any], Work]] = collections.deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.pending = 0

    def submit(self, fn: Callable[[], Any], work: Work) -> None:
        with self._cv:
            if self._closed:
                raise DistBackendError(f"{self._name}: the group was destroyed")
            self.pending += 1
            self._queue.append((fn, work))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._cv.notify()

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait(1.0)
                if not self._queue:
                    return
                fn, work = self._queue.popleft()
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter, never lost
                work._complete(e)
            else:
                work._complete()
            fn = work = None   # type: ignore[assignment]  # hold no tensor while idle (buffers free at once)
            with self._cv:
                self.pending -= 1
                self._cv.notify_all()

    def close(self, timeout: float = 5.0) -> None:
        """Stop accepting work; let queued work finish (it fails fast on an aborted group)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        deadline = time.monotonic() + 0.1
        while self._queue and time.monotonic() < deadline:
            _, work = self._queue.popleft()
            work._complete(DistBackendError(f"{self._name}: the group was destroyed before "
                                            "this op ran"))
