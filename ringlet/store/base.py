"""The ``Store`` interface shared by every key-value store, plus the pure helpers
that give all stores the same semantics (counters, compare-and-set, timeouts).

A store maps ``str`` keys to ``bytes`` values. ``get``/``wait`` block until the
keys exist or the store's timeout passes; a timed-out call raises
``DistStoreError`` naming the keys, the store and the time waited, and leaves the
store usable (docs/reliability.md, row S4). Every wait is written as a loop on an absolute
``time.monotonic()`` deadline, so a signal (EINTR) can neither abort nor shorten it.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Mapping, MutableMapping, Sequence
from datetime import timedelta

from ringlet import _env
from ringlet.errors import DistStoreError, QueueEmptyError

__all__ = ["Store"]


def to_bytes(value: str | bytes | bytearray | memoryview, what: str = "value") -> bytes:
    """``str`` is encoded as UTF-8; bytes-likes are copied to ``bytes``."""
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    raise TypeError(f"store {what}: expected str or bytes, got {type(value).__name__}")


def check_key(key: object) -> str:
    if not isinstance(key, str):
        raise TypeError(f"store key: expected str, got {type(key).__name__}")
    return key


def check_keys(keys: object) -> list[str]:
    if isinstance(keys, str | bytes):
        raise TypeError(f"store keys: expected a list of str, got {type(keys).__name__}")
    if not isinstance(keys, Sequence):
        raise TypeError(f"store keys: expected a list of str, got {type(keys).__name__}")
    return [check_key(k) for k in keys]


def check_pairs(keys: object, values: Sequence[str | bytes]) -> tuple[list[str], list[bytes]]:
    """Validated ``multi_set`` arguments: str keys and as many encoded values."""
    key_list = check_keys(keys)
    if len(key_list) != len(values):
        raise ValueError(
            f"multi_set: expected as many values as keys, got {len(values)} values "
            f"for {len(key_list)} keys"
        )
    return key_list, [to_bytes(v) for v in values]


def as_seconds(timeout: timedelta | float) -> float:
    """Seconds of a timeout given as ``timedelta`` (torch's type) or a number."""
    if isinstance(timeout, timedelta):
        return timeout.total_seconds()
    if isinstance(timeout, int | float) and not isinstance(timeout, bool):
        return float(timeout)
    raise TypeError(f"store timeout: expected a timedelta, got {type(timeout).__name__}")


def timeout_error(
    keys: Sequence[str], where: str, started: float, timeout_s: float, op: str = "wait"
) -> DistStoreError:
    """The error of a ``get``/``wait`` that passed its deadline (names keys, store, time)."""
    elapsed = time.monotonic() - started
    return DistStoreError(
        f"{op} for keys {list(keys)} timed out after {elapsed:.2f}s on {where} "
        f"(timeout {timeout_s:g}s); the keys were never set",
        keys=list(keys),
        store=where,
        elapsed=elapsed,
        timeout=timeout_s,
        op=op,
    )


def parse_counter(key: str, raw: bytes) -> int:
    """A counter's value: ASCII decimal bytes, as torch stores them."""
    try:
        return int(raw.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        raise ValueError(
            f"store add({key!r}): expected the value to be an ASCII integer, got {raw[:32]!r}"
        ) from None


def apply_add(table: MutableMapping[str, bytes], key: str, amount: int) -> int:
    """``add`` on a plain mapping: a missing key counts from 0. Returns the new value."""
    new = parse_counter(key, table[key]) + amount if key in table else amount
    table[key] = str(new).encode("ascii")
    return new


def apply_compare_set(
    table: MutableMapping[str, bytes], key: str, expected: bytes, desired: bytes
) -> bytes:
    """torch's compare-and-set: a missing key is set only when ``expected`` is empty.

    Returns the value now stored, or ``expected`` when the key is missing and
    ``expected`` is not empty (what torch returns in that case).
    """
    if key not in table:
        if expected == b"":
            table[key] = desired
            return desired
        return expected
    if table[key] == expected:
        table[key] = desired
    return table[key]


def apply_append(table: MutableMapping[str, bytes], key: str, value: bytes) -> None:
    table[key] = table.get(key, b"") + value


# [Note: store queues]
# Queues live beside the keys, as in torch: ``queue_push(k)`` never changes ``get(k)``, and
# ``delete_key``/``num_keys``/``list_keys`` see only keys.  ``check``/``wait`` count a key as
# present when it is set *or* its queue is not empty, so a consumer can wait for work.  A
# blocking ``queue_pop`` waits up to the store's timeout (``DistStoreError`` naming the queue);
# ``block=False`` on an empty queue raises ``QueueEmptyError`` at once.
def present(data: Mapping[str, bytes], queues: Mapping[str, deque[bytes]], key: str) -> bool:
    """Whether ``check``/``wait`` consider ``key`` present (see [Note: store queues])."""
    return key in data or bool(queues.get(key))


def pop_queue(queues: MutableMapping[str, deque[bytes]], key: str) -> bytes | None:
    """The head of ``key``'s queue (removed), or None when it is empty."""
    q = queues.get(key)
    if not q:
        return None
    value = q.popleft()
    if not q:
        del queues[key]
    return value


def queue_empty_error(key: str, where: str) -> QueueEmptyError:
    return QueueEmptyError(f"queue_pop({key!r}, block=False): queue is empty ({where})", keys=[key],
                           store=where)


class Store:
    """Base class of ringlet's key-value stores (torch's ``Store`` interface).

    Subclasses implement ``set``, ``get``, ``add``, ``compare_set``, ``wait``,
    ``check``, ``delete_key`` and ``num_keys``; ``multi_get``, ``multi_set`` and
    ``append`` have generic (non-atomic) defaults that subclasses override.

    Args:
        timeout: deadline of blocking calls; defaults to ``RINGLET_TIMEOUT`` (300 s).

    Example::

        store = HashStore()
        store.set("k", b"v")
        assert store.get("k") == b"v"
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._timeout_s = as_seconds(timeout if timeout is not None else _env.default_timeout())

    @property
    def timeout(self) -> timedelta:
        """Deadline of ``get``/``wait`` (and of connecting, for network stores)."""
        return timedelta(seconds=self._timeout_s)

    def set_timeout(self, timeout: timedelta) -> None:
        """Change the deadline of later blocking calls.

        Raises:
            ValueError: if the timeout is negative.
        """
        seconds = as_seconds(timeout)
        if seconds < 0:
            raise ValueError(f"store timeout: expected a non-negative duration, got {timeout}")
        self._timeout_s = seconds

    def _wait_seconds(self, timeout: timedelta | None) -> float:
        return self._timeout_s if timeout is None else as_seconds(timeout)

    # -- the interface -------------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        """Store ``value`` (``str`` is encoded as UTF-8) under ``key``."""
        raise NotImplementedError

    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting until it exists.

        Raises:
            DistStoreError: the key did not appear within the store's timeout.
        """
        raise NotImplementedError

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to the counter ``key`` (missing = 0); returns the sum.

        Raises:
            ValueError: the key holds a value that is not an ASCII integer.
        """
        raise NotImplementedError

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        """Set ``key`` to ``desired_value`` if it holds ``expected_value`` (or is missing
        and ``expected_value`` is empty); returns the value now stored."""
        raise NotImplementedError

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists.

        Raises:
            DistStoreError: some key is still missing after ``timeout`` (default:
                the store's), naming the keys, the store and the time waited.
        """
        raise NotImplementedError

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (never blocks)."""
        raise NotImplementedError

    def delete_key(self, key: str) -> bool:
        """Remove ``key``; returns whether it existed."""
        raise NotImplementedError

    def num_keys(self) -> int:
        """Number of keys stored (internal bookkeeping keys excluded)."""
        raise NotImplementedError

    def queue_push(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the queue ``key`` (queues live beside keys: [Note: store queues]).

        Example::

            store.queue_push("work", b"job-1")
            assert store.queue_pop("work") == b"job-1"
        """
        raise NotImplementedError

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        """Remove and return the oldest value of the queue ``key``.

        Args:
            key: the queue.
            block: wait (up to the store's timeout) for a value when the queue is empty.

        Raises:
            QueueEmptyError: ``block`` is false and the queue is empty.
            DistStoreError: ``block`` is true and no value arrived within the timeout.
        """
        raise NotImplementedError

    def queue_len(self, key: str) -> int:
        """Number of values in the queue ``key`` (0 when it does not exist)."""
        raise NotImplementedError

    def list_keys(self) -> list[str]:
        """Every key in the store (queues and internal bookkeeping keys excluded)."""
        raise NotImplementedError

    def clone(self) -> Store:
        """A new store object on the same underlying store, for use from another thread."""
        raise NotImplementedError

    # -- ringlet extras with generic defaults --------------------------------------
    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys``, waiting until all exist."""
        return [self.get(k) for k in check_keys(keys)]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        """Set several keys (atomically where the store allows it).

        Raises:
            ValueError: ``keys`` and ``values`` differ in length.
        """
        for key, value in zip(*check_pairs(keys, values), strict=True):
            self.set(key, value)

    def append(self, key: str, value: str | bytes) -> None:
        """Append ``value`` to the bytes of ``key`` (created if missing).

        The generic version is a compare-and-set loop; ringlet's stores do it atomically.
        """
        data = to_bytes(value)
        current = self.multi_get([key])[0] if self.check([key]) else b""
        deadline = time.monotonic() + self._timeout_s
        while time.monotonic() < deadline:  # each lost round means another writer progressed
            stored = self.compare_set(key, current, current + data)
            if stored == current + data:
                return
            current = stored
        raise DistStoreError(f"append({key!r}) kept losing compare_set races", keys=[key])
