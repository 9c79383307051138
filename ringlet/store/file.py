"""``FileStore``: a store shared by processes through one file (torch's ``file://`` init).

The file is a header line followed by an append-only log of records
(``!BII`` op, key length, value length, then the key and the value). Writers hold an
exclusive ``flock`` while they append, readers a shared one while they catch up
from the offset they last read. ``get``/``wait`` poll with a short backoff, bounded
by their deadline. Each instance adds 1 to an internal reference count on open and
subtracts 1 on ``close``; with ``world_size > 0`` the last one out removes the file,
and more than ``world_size`` openers means a stale file or two jobs on one path
(docs/reliability.md, row S7).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import struct
import threading
import time
from collections import deque
from collections.abc import Iterator
from datetime import timedelta

from ringlet.errors import DistStoreError
from ringlet.store.base import (
    Store,
    apply_add,
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

__all__ = ["FileStore"]

HEADER = b"RINGLET-FILESTORE 1\n"
_RECORD = struct.Struct("!BII")
_SET, _DELETE, _APPEND, _QPUSH, _QPOP = 1, 2, 3, 4, 5   # _QPOP's record has no value
_REFCOUNT = "\x00ringlet/refcount"  # internal key: hidden from num_keys
_POLL_MIN_S, _POLL_MAX_S = 0.001, 0.01  # wait/lock polling backoff


def _record(op: int, key: str, value: bytes = b"") -> bytes:
    raw = key.encode("utf-8")
    return _RECORD.pack(op, len(raw), len(value)) + raw + value


class FileStore(Store):
    """A store in a file that several processes (on one host or a shared FS) open.

    Args:
        file_name: the file; created (mode 0600) if missing; an empty file is fine.
        world_size: number of instances that will open it; when > 0 the last to
            ``close`` removes the file, and a further opener is refused. -1: unknown.
        timeout: deadline of ``get``/``wait`` (default ``RINGLET_TIMEOUT``).

    Raises:
        DistStoreError: the file cannot be created or opened (names the path and
            the reason), holds something other than a ringlet FileStore, or has
            more openers than ``world_size``.

    Example::

        store = FileStore("/tmp/run1/store", world_size=2)  # in each of two processes
        store.add("arrived", 1)
        ...
        store.close()
    """

    def __init__(
        self, file_name: str, world_size: int = -1, timeout: timedelta | None = None
    ) -> None:
        super().__init__(timeout)
        if not isinstance(world_size, int) or world_size == 0 or world_size < -1:
            raise ValueError("FileStore world_size: expected a positive int "
                             f"or -1, got {world_size!r}")
        self._path = os.path.abspath(os.fspath(file_name))
        self._world_size = world_size
        self._lock = threading.Lock()  # flock does not exclude threads sharing our fd
        self._data: dict[str, bytes] = {}
        self._offset = 0
        self._fd = -1
        self._closed = True  # until the file is open and checked: close()/__del__ do nothing
        self._owns_ref = False  # whether close() must give back a reference
        self._open()
        self._closed = False
        try:
            with self._locked(exclusive=True):
                opened = apply_add(self._data, _REFCOUNT, 1)
                self._write(_record(_SET, _REFCOUNT, self._data[_REFCOUNT]))
        except BaseException:
            self._closed = True
            os.close(self._fd)
            raise
        self._owns_ref = True
        if world_size > 0 and opened > world_size:
            self.close()
            raise DistStoreError(
                f"FileStore {self._path}: {opened} instances opened it but world_size is "
                f"{world_size}; a stale file from an earlier run, or two jobs on one path? "
                "Remove the file or use a fresh path per run",
                store=self._path,
            )

    def _open(self) -> None:
        try:
            self._fd = os.open(self._path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as e:
            raise DistStoreError(
                f"FileStore cannot open {self._path}: {e.strerror} "
                "(is the directory there and writable?)",
                store=self._path,
            ) from None
        st = os.fstat(self._fd)
        # writable by us yet another user's: anyone could inject keys
        if st.st_uid != os.geteuid():
            os.close(self._fd)
            raise DistStoreError(
                f"FileStore {self._path}: expected a file of this user (uid {os.geteuid()}), got "
                f"one owned by uid {st.st_uid}; use a fresh path in a private directory",
                store=self._path,
            )
        self._identity = (st.st_dev, st.st_ino)
        self._pid = os.getpid()
        self._data, self._offset = {}, 0
        self._queues: dict[str, deque[bytes]] = {}   # [Note: store queues] in base

    # -- file access -------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        """Hold the thread lock and the file lock, catching up with the log."""
        deadline = time.monotonic() + max(self._timeout_s, 1.0)
        if not self._lock.acquire(timeout=max(self._timeout_s, 1.0)):
            raise DistStoreError(f"FileStore {self._path}: could not lock it in time")
        try:
            if self._closed:
                raise DistStoreError(f"FileStore {self._path} is closed", store=self._path)
            if self._pid != os.getpid():  # forked: our flock would be shared with the parent
                os.close(self._fd)
                self._open()
                self._owns_ref = False
            self._flock(fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH, deadline)
            try:
                self._check_identity()
                self._catch_up(exclusive)
                yield
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        finally:
            self._lock.release()

    def _flock(self, mode: int, deadline: float) -> None:
        delay = _POLL_MIN_S
        while True:
            try:
                fcntl.flock(self._fd, mode | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                pass
            except OSError as e:  # ENOLCK, EOPNOTSUPP: no locks on this file system
                raise DistStoreError(
                    f"FileStore {self._path}: cannot lock the file ({e.strerror}); "
                    "use a local file system",
                    store=self._path,
                ) from None
            if time.monotonic() >= deadline:
                raise DistStoreError(
                    f"FileStore {self._path}: another process held its lock past the timeout",
                    store=self._path,
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)

    def _check_identity(self) -> None:
        try:
            st = os.stat(self._path)
        except FileNotFoundError:
            st = None
        if st is None or (st.st_dev, st.st_ino) != self._identity:
            raise DistStoreError(
                f"FileStore {self._path} was deleted or replaced while in use", store=self._path
            )

    def _catch_up(self, exclusive: bool) -> None:
        size = os.fstat(self._fd).st_size
        if self._offset == 0:
            if size == 0 and exclusive:
                os.pwrite(self._fd, HEADER, 0)
                size = len(HEADER)
            head = os.pread(self._fd, len(HEADER), 0)
            if head != HEADER:
                if size == 0:
                    return  # created by a peer that has not written the header yet
                raise DistStoreError(
                    f"FileStore {self._path} is not a ringlet FileStore (it starts with "
                    f"{head[:24]!r}); remove it or choose another path",
                    store=self._path,
                )
            self._offset = len(HEADER)
        if size > self._offset:
            chunks, pos = [], self._offset
            while pos < size:
                chunk = os.pread(self._fd, size - pos, pos)
                if not chunk:
                    break
                chunks.append(chunk)
                pos += len(chunk)
            self._offset += self._apply(b"".join(chunks))

    def _apply(self, log: bytes) -> int:
        pos = 0
        while pos < len(log):
            if pos + _RECORD.size > len(log):
                break
            op, klen, vlen = _RECORD.unpack_from(log, pos)
            end = pos + _RECORD.size + klen + vlen
            if op not in (_SET, _DELETE, _APPEND, _QPUSH, _QPOP) or end > len(log):
                break
            key = log[pos + _RECORD.size : pos + _RECORD.size + klen].decode("utf-8", "replace")
            self._replay(op, key, log[pos + _RECORD.size + klen : end])
            pos = end
        if pos != len(log):  # writers append whole records under the lock: this is damage
            raise DistStoreError(
                f"FileStore {self._path} is corrupt at byte {self._offset + pos} (a writer "
                "crashed mid-record, or something else wrote to the file)",
                store=self._path,
            )
        return pos

    def _replay(self, op: int, key: str, value: bytes) -> None:
        if op == _SET:
            self._data[key] = value
        elif op == _APPEND:
            self._data[key] = self._data.get(key, b"") + value
        elif op == _QPUSH:
            self._queues.setdefault(key, deque()).append(value)
        elif op == _QPOP:
            pop_queue(self._queues, key)
        else:
            self._data.pop(key, None)

    def _write(self, data: bytes) -> None:
        """Append records (caller holds the exclusive lock), then apply them."""
        os.pwrite(self._fd, data, os.fstat(self._fd).st_size)
        self._catch_up(exclusive=True)

    def _poll(self, keys: list[str], timeout_s: float, op: str) -> dict[str, bytes]:
        started = time.monotonic()
        deadline, delay = started + timeout_s, _POLL_MIN_S
        while True:
            with self._locked(exclusive=False):
                if op == "get":
                    missing = [k for k in keys if k not in self._data]
                else:   # wait: a non-empty queue counts ([Note: store queues])
                    missing = [k for k in keys if not present(self._data, self._queues, k)]
                if not missing:
                    return {k: self._data.get(k, b"") for k in keys}
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise timeout_error(missing, f"FileStore {self._path}", started, timeout_s, op)
            time.sleep(min(delay, remaining))  # a signal only wakes us early; we re-check
            delay = min(delay * 2, _POLL_MAX_S)

    # -- the Store interface -------------------------------------------------------
    def set(self, key: str, value: str | bytes) -> None:
        record = _record(_SET, check_key(key), to_bytes(value))
        with self._locked(exclusive=True):
            self._write(record)

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        keys, raw = check_pairs(keys, values)
        records = b"".join(_record(_SET, k, v) for k, v in zip(keys, raw, strict=True))
        with self._locked(exclusive=True):
            self._write(records)

    def get(self, key: str) -> bytes:
        return self._poll([check_key(key)], self._timeout_s, "get")[key]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        keys = check_keys(keys)
        found = self._poll(keys, self._timeout_s, "get")
        return [found[k] for k in keys]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._poll(check_keys(keys), self._wait_seconds(timeout), "wait")

    def add(self, key: str, amount: int) -> int:
        key = check_key(key)
        with self._locked(exclusive=True):
            new = apply_add(self._data, key, int(amount))
            self._write(_record(_SET, key, self._data[key]))
            return new

    def compare_set(
        self, key: str, expected_value: str | bytes, desired_value: str | bytes
    ) -> bytes:
        key = check_key(key)
        expected, desired = to_bytes(expected_value), to_bytes(desired_value)
        with self._locked(exclusive=True):
            before = self._data.get(key)
            result = apply_compare_set(self._data, key, expected, desired)
            if self._data.get(key) != before:
                self._write(_record(_SET, key, desired))
            return result

    def append(self, key: str, value: str | bytes) -> None:
        record = _record(_APPEND, check_key(key), to_bytes(value))
        with self._locked(exclusive=True):
            self._write(record)

    def check(self, keys: list[str]) -> bool:
        keys = check_keys(keys)
        with self._locked(exclusive=False):
            return all(present(self._data, self._queues, k) for k in keys)

    def delete_key(self, key: str) -> bool:
        key = check_key(key)
        with self._locked(exclusive=True):
            if key not in self._data:
                return False
            self._write(_record(_DELETE, key))
            return True

    def num_keys(self) -> int:
        with self._locked(exclusive=False):
            return sum(1 for k in self._data if k != _REFCOUNT)

    def queue_push(self, key: str, value: str | bytes) -> None:
        record = _record(_QPUSH, check_key(key), to_bytes(value))
        with self._locked(exclusive=True):
            self._write(record)

    def queue_pop(self, key: str, block: bool = True) -> bytes:
        key = check_key(key)
        started = time.monotonic()
        delay = _POLL_MIN_S
        while True:
            with self._locked(exclusive=True):
                head = self._queues.get(key)
                if head:
                    value = head[0]
                    self._write(_record(_QPOP, key))   # applied to our copy by _write's catch-up
                    return value
            if not block:
                raise queue_empty_error(key, f"FileStore {self._path}")
            remaining = started + self._timeout_s - time.monotonic()
            if remaining <= 0:
                raise timeout_error([key], f"FileStore {self._path}", started, self._timeout_s,
                                    "queue_pop")
            time.sleep(min(delay, remaining))
            delay = min(delay * 2, _POLL_MAX_S)

    def queue_len(self, key: str) -> int:
        key = check_key(key)
        with self._locked(exclusive=False):
            return len(self._queues.get(key, ()))

    def list_keys(self) -> list[str]:
        with self._locked(exclusive=False):
            return [k for k in self._data if k != _REFCOUNT]

    def clone(self) -> FileStore:
        """Another handle on the same file for another thread; it takes no reference, so it
        never counts towards ``world_size`` and its ``close`` never removes the file."""
        other = FileStore.__new__(FileStore)
        Store.__init__(other, self.timeout)
        other._path, other._world_size = self._path, self._world_size
        other._lock = threading.Lock()
        other._closed, other._owns_ref = True, False
        other._open()
        other._closed = False
        return other

    # -- lifetime ------------------------------------------------------------------
    @property
    def path(self) -> str:
        return self._path

    def __repr__(self) -> str:
        state = " closed" if self._closed else ""
        return f"FileStore({self._path!r}, world_size={self._world_size}{state})"

    def close(self) -> None:
        """Give up this instance's reference; the last of ``world_size`` removes the file.

        Idempotent; never raises for a file that is already gone.
        """
        if self._closed:
            return
        try:
            if self._owns_ref:
                with self._locked(exclusive=True):
                    left = apply_add(self._data, _REFCOUNT, -1)
                    self._write(_record(_SET, _REFCOUNT, self._data[_REFCOUNT]))
                    if self._world_size > 0 and left <= 0:
                        os.unlink(self._path)
        except (DistStoreError, OSError):
            pass  # deleted or replaced already: nothing left to clean up
        finally:
            self._closed = True
            os.close(self._fd)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
