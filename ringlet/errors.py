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


# [Note: abort carries the cause]
# A rank whose collective fails (a mismatch, a timeout, a dead peer) aborts the group with the
# reason "<ErrorClass>: <text>" (``ProcessGroup._poison``), and its peers raise when they see the
# abort.  Which of the two a peer sees first -- the fault itself or the abort record -- depends
# on scheduling, so a peer that learns of the fault through the abort raises an error of the
# *same class* as the rank that found it (``CollectiveMismatchError`` on every rank of a
# mismatch), which is also a ``GroupAbortedError`` (code that caught the abort still does) and
# names the aborting rank (``err.aborted_by``).  Only the classes below travel; any other reason
# (``ProcessGroup.abort`` by the user, a plain ``DistBackendError``) gives a plain
# ``GroupAbortedError``.
def _carrying(base: type[DistBackendError]) -> type[GroupAbortedError]:
    """``base`` as seen by a peer through the abort record: a subclass of both ``base`` and
    ``GroupAbortedError`` that prints and reports as ``base``'s name."""

    def __reduce__(self: DistError) -> tuple[Any, ...]:
        return (_rebuild_carried, (base, str(self), self.context))

    return type(base.__name__, (base, GroupAbortedError),
                {"__module__": __name__, "__qualname__": base.__qualname__,
                 "__doc__": f"{base.__name__} learnt from a peer's abort (also a "
                            "GroupAbortedError).", "__reduce__": __reduce__})


_CARRIED: dict[str, type[GroupAbortedError]] = {
    cls.__name__: _carrying(cls)
    for cls in (CollectiveMismatchError, CollectiveTimeoutError, PeerFailureError)}


def _rebuild_carried(base: type[DistBackendError], message: str,
                     context: dict[str, Any]) -> DistError:
    return _CARRIED[base.__name__](message, **context)


def abort_error_class(reason: str) -> type[GroupAbortedError]:
    """The class a rank raises for a peer's abort whose reason is ``reason`` ("<ErrorClass>:
    <text>"): the cause's class (also a ``GroupAbortedError``) for the faults that travel,
    plain ``GroupAbortedError`` otherwise ([Note: abort carries the cause])."""
    name = reason.split(":", 1)[0].strip()
    return _CARRIED.get(name, GroupAbortedError)
