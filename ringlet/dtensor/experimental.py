"""``implicit_replication()``: plain tensors mixed with DTensors count as Replicate inside it.

Outside the context, an operator that mixes a plain (non-scalar) tensor with DTensors
raises a ``RuntimeError``; inside, the plain tensor is taken as the whole value, present
on every rank (no communication, no check that ranks agree).  The flag is per thread.

Example::

    from ringlet.distributed.tensor.experimental import implicit_replication

    with implicit_replication():
        y = dtensor + torch.ones(4)      # torch.ones(4) is Replicate on dtensor's mesh
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

__all__ = ["implicit_replication", "implicit_replication_enabled"]

_enabled: contextvars.ContextVar[bool] = contextvars.ContextVar("ringlet_implicit_replication",
                                                                default=False)


@contextlib.contextmanager
def implicit_replication() -> Iterator[None]:
    """Treat plain tensors mixed with DTensors as Replicate while active."""
    token = _enabled.set(True)
    try:
        yield
    finally:
        _enabled.reset(token)


def implicit_replication_enabled() -> bool:
    return _enabled.get()
