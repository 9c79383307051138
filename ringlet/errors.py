"""ringlet's error hierarchy (bottom layer: imported by every other layer).

Names follow torch.distributed where a user would look for them
(``DistError``, ``DistBackendError``, ``DistNetworkError``, ``DistStoreError``);
ringlet adds specific subclasses that carry structured context so tests and
tools can assert on fields instead of free text
(docs/reliability.md#error-messages).
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "DistBackendError",
    "DistError",
    "DistNetworkError",
    "DistStoreError",
    "GroupAbortedError",
    "PeerFailureError",
    "QueueEmptyError",
]


class DistError(RuntimeError):
    """Base class of every communication fault raised by ringlet.

    ``context`` holds the structured fields (rank, group, op, seq, peer, ...)
    that the message was built from.
    """

    def __init__(self, message: str, **context: Any) -> None:
        super().__init__(message)
        self.context: dict[str, Any] = context

    def __getattr__(self, name: str) -> Any:
        # Fields of the context read as attributes (err.rank, err.peer, ...).
        ctx = self.__dict__.get("context")
        if ctx is not None and name in ctx:
            return ctx[name]
        raise AttributeError(name)

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), str(self), self.context))


def _rebuild_error(cls: type, message: str, context: dict[str, Any]) -> DistError:
    return cls(message, **context)


class DistBackendError(DistError):
    """A transport or process-group operation failed (timeout, peer death, mismatch)."""


class DistNetworkError(DistError):
    """A network operation failed (connect, bind, handshake, cut link)."""


class DistStoreError(DistError):
    """A store operation failed; a timed-out ``get``/``wait`` names the missing keys."""


class QueueEmptyError(DistStoreError):
    """``Store.queue_pop(key, block=False)`` found the queue empty (torch's ``QueueEmptyError``)."""


class CollectiveTimeoutError(DistBackendError):
    """A collective passed its deadline; names the ranks that never arrived."""


class PeerFailureError(DistBackendError):
    """A peer process died or left while this rank waited on it."""


class CollectiveMismatchError(DistBackendError):
    """Ranks called different collectives (or the same one with different arguments)."""


class GroupAbortedError(DistBackendError):
    """The group was poisoned by an earlier failure; every later call fails fast."""
