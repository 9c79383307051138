"""``HashStore``: an in-process store for ranks that are threads of one process."""

from __future__ import annotations

import copy
import threading
import time
from collections import deque
from datetime import timedelta

from ringlet.store.base import (
    Store,
    apply_add,
    apply_append,
    apply_compare_set,
    check_key,
    check_keys,
    check_pairs,
    pop_queue,
    present,
    queue_empty_error,
    timeout_error,
    to_bytes,
)

__all__ = ["HashStore"]


class HashStore(Store):
    """A thread-safe dictionary with blocking ``get``/``wait``.

    Waiters sleep on a ``threading.Condition`` that every write notifies; no polling.

    Args:
        timeout: deadline of ``get``/``wait`` (default ``RINGLET_TIMEOUT``).

    Example::

        store = HashStore()
        threading.Thread(target=lambda: store.set("ready", "1")).start()
        store.wait(["ready"])  # returns once the other thread has set the key
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        super().__init__(timeout)
        self._data: dict[str, bytes] = {}
        self._queues: dict[str, deque[bytes]] = {}  # [Note: store queues] in base
        self._cond = threading.Condition()

    def __repr__(self) -> str:
        return f"HashStore({len(self._data)} keys, timeout={self._timeout_s:g}s)"

    def set(self, key: str, value: str | bytes) -> None:
        key, data = check_key(key), to_bytes(value)
        with self._cond:
            self._data[key] = data
            self._cond.notify_all()

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, encoded = check_pairs(keys, values)
        with self._cond:
            self._data.update(zip(keys, encoded, strict=True))
            self._cond.notify_all()

    def get(self, key: str) -> bytes:
        return self.multi_get([key])[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = check_keys(keys)
        with self._cond:
            self._wait_locked(keys, self._timeout_s, "get")
            return [self._data[k] for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        keys = check_keys(keys)
        with self._cond:
            self._wait_locked(keys, self._wait_seconds(timeout), "wait")

    def _wait_locked(self, keys: list[str], timeout_s: float, op: str) -> None:
        # Loop on an absolute deadline: spurious wake-ups and signals only re-check.
        started = time.monotonic()
        deadline = started + timeout_s
        while True:
            if op == "get":
                missing = [k for k in keys if k not in self._data]
            else:   # wait: a non-empty queue counts
                missing = [k for k in keys if not present(self._data, self._queues, k)]
            if not missing:
                return
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(missing, repr(self), started, timeout_s, op)
            self._cond.wait(remaining)

    def add(self, key: str, amount: int) -> int:
        key = check_key(key)
        with self._cond:
            new = apply_add(self._data, key, int(amount))
            self._cond.notify_all()
            return new

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        with self._cond:
            result = apply_compare_set(self._data, key, expected, desired)
            self._cond.notify_all()
            return result

    def append(self, key: str, value: str | bytes) -> None:
        key, data = check_key(key), to_bytes(value)
        with self._cond:
            apply_append(self._data, key, data)
            self._cond.notify_all()

    def check(self, keys: list[str]) -> bool:
        keys = check_keys(keys)
        with self._cond:
            return all(present(self._data, self._queues, k) for k in keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._cond:
            return self._data.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cond:
            return len(self._data)

    def queue_push(self, key: str, value: str | bytes) -> None:
        key, data = check_key(key), to_bytes(value)
        with self._cond:
            self._queues.setdefault(key, deque()).append(data)
            self._cond.notify_all()

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        started = time.monotonic()
        with self._cond:
            while True:   # another popper may take the value we were woken for: wait again
                value = pop_queue(self._queues, key)
                if value is not None:
                    return value
                if not block:
                    raise queue_empty_error(key, repr(self))
                remaining = started + self._timeout_s - time.monotonic()
                if remaining <= 0:
                    raise timeout_error([key], repr(self), started, self._timeout_s, "queue_pop")
                self._cond.wait(remaining)

    def queue_len(self, key: str) -> int:
        key = check_key(key)
        with self._cond:
            return len(self._queues.get(key, ()))

    def list_keys(self) -> list[str]:
        with self._cond:
            return list(self._data)

    def clone(self) -> HashStore:
        """Another handle on the same keys and queues (its timeout is its own)."""
        return copy.copy(self)
