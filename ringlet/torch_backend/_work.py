"""torch ``Work`` objects for what ringlet ran: done inline, or queued on ringlet's group thread.

torch's callers (its Python API, DDP's C++ reducer, functional collectives) hold a torch
``Work`` and call ``wait()``, ``is_completed()`` and ``get_future()``.  A Python subclass of
torch's ``Work`` is what reaches them through torch's trampoline, so an error raised by ringlet
(a timeout with its hang report, a dead peer, a mismatch) is raised by ``wait()`` with ringlet's
type and text; torch's ``_create_work_from_future`` would swallow it (measured with torch 2.13:
its ``wait()`` returns normally on a failed future).
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["DoneWork", "GroupedWork", "QueuedWork"]


class DoneWork(tdist._Work):
    """An operation that already ran (inline, on the caller's thread); its future is made
    only when asked for (~0.7 us for the Work alone, ~2 us with a future)."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._outputs = outputs

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self) -> Any:
        return None

    def result(self) -> list[torch.Tensor]:
        return self._outputs

    def synchronize(self) -> None:
        return None

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._outputs)
        return fut


class QueuedWork(tdist._Work):
    """An operation queued on the ringlet group's communication thread (``rwork``: ringlet's
    :class:`~ringlet.c10d.work.Work`).  ``wait`` raises ringlet's error; the future's value is
    the output tensors, as torch's backends give (DDP's comm hooks read ``fut.value()[0]``)."""

    def __init__(self, rwork: Any, outputs: list[torch.Tensor],
                 ranks: list[int] | None = None) -> None:
        super().__init__()
        self._rwork = rwork
        self._outputs = outputs
        self._future: torch.futures.Future | None = None
        self._ranks = ranks          # the group's global ranks (a receive from any source)

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            return bool(self._rwork.wait(timeout))
        self._rwork.wait()
        return True

    def is_completed(self) -> bool:
        return bool(self._rwork.is_completed())

    def is_success(self) -> bool:
        return self._rwork.is_completed() and self._rwork.exception() is None

    def exception(self) -> Any:
        return self._rwork.exception()

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._outputs

    def synchronize(self) -> None:
        self._rwork.synchronize()

    def source_rank(self) -> int:
        """The group rank a receive from any source got its message from (``recv_anysource``);
        ringlet's Work answers with the global rank."""
        src = int(self._rwork.source_rank())
        return self._ranks.index(src) if self._ranks is not None else src

    _source_rank = source_rank

    def get_future(self) -> torch.futures.Future:
        if self._future is None:
            outputs, rwork = self._outputs, self._rwork

            def value(f: torch.futures.Future) -> list[torch.Tensor]:
                rwork.wait()         # raises ringlet's error into the chained future
                return outputs
            self._future = self._rwork.get_future().then(value)
        return self._future


class GroupedWork(tdist._Work):
    """Several works as one (the end of a coalescing block): done when all are."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: timedelta | None = None) -> bool:
        for w in self._works:
            w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        futs = [w.get_future() for w in self._works]
        return torch.futures.collect_all(futs).then(lambda f: [x.wait() for x in f.wait()])
