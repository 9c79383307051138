"""``CommDebugMode``: count the collectives that DTensor issues inside a ``with`` block.

Tests use it to assert how a transition or an operator communicates, e.g. that a
Shard -> Replicate redistribution is one all-gather and ``clip_grad_norm_`` over
sharded gradients is a single all-reduce.  Counts are per thread (ranks may be
threads), kept in a ``ContextVar``.

Example::

    with CommDebugMode() as comm:
        dt.redistribute(mesh, [Replicate()])
    assert comm.get_comm_counts() == {"all_gather": 1}
"""

from __future__ import annotations

import contextvars
from collections import Counter
from typing import Any, Self

__all__ = ["CommDebugMode"]

_active: contextvars.ContextVar[tuple[CommDebugMode, ...]] = contextvars.ContextVar(
    "ringlet_comm_debug", default=())


class CommDebugMode:
    """Counts DTensor collectives by name (``all_gather``, ``all_reduce``, ``reduce_scatter``,
    ``all_to_all``, ``broadcast``) while active; modes nest, each sees what ran inside it."""

    def __init__(self) -> None:
        self.comm_counts: Counter[str] = Counter()
        self._token: Any = None

    def get_comm_counts(self) -> dict[str, int]:
        return dict(self.comm_counts)

    def get_total_counts(self) -> int:
        return sum(self.comm_counts.values())

    def __enter__(self) -> Self:
        self.comm_counts.clear()
        self._token = _active.set(_active.get() + (self,))
        return self

    def __exit__(self, *exc: object) -> None:
        _active.reset(self._token)

    def __repr__(self) -> str:
        return f"CommDebugMode({dict(self.comm_counts)})"


def record(name: str) -> None:
    """Called by the communication layer for every collective it issues."""
    for mode in _active.get():
        mode.comm_counts[name] += 1
