"""Futex waits on a 32-bit word of shared memory (Linux), through ``ctypes`` -- no extension.

A waiter blocks in the kernel until another thread *or process* that maps the same memory
calls :meth:`Futex.wake` on that word, or its timeout passes: the wake-up costs a few
microseconds, where a sleep on a timer costs whatever the timer is.  The arena's waits use it
after a short spin ([Note: arena waits] in ``arena.py``).

Only the plain (shared) futex operations are used -- ``FUTEX_WAIT`` and ``FUTEX_WAKE`` without
``FUTEX_PRIVATE_FLAG`` -- because the waiter and the waker may be different processes mapping
the word at different addresses.  Where the syscall is unknown (not Linux, or an architecture
whose syscall number is not listed), :func:`available` is False and callers sleep instead.

Safety: a :class:`Futex` is built from a buffer and an offset, checked to lie inside the buffer
and to be 4-byte aligned, and it keeps the buffer's exported pointer alive for its lifetime
(``ctypes.c_char.from_buffer`` pins the buffer: it cannot be resized or released underneath).
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import sys
from typing import Any

from ringlet import _env

__all__ = ["Futex", "available"]

_FUTEX_WAIT, _FUTEX_WAKE = 0, 1
_SYSCALL = {"x86_64": 202, "amd64": 202, "aarch64": 98, "arm64": 98, "riscv64": 98}
_NR = _SYSCALL.get(platform.machine().lower()) if sys.platform.startswith("linux") else None
_WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def _load_syscall() -> Any:
    if _NR is None:
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)      # CDLL calls release the GIL while blocked
        fn = libc.syscall
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_long
    return fn


_syscall = _load_syscall()


def available() -> bool:
    """Whether futex waits work here (Linux on a known architecture)."""
    return _syscall is not None and not _env.no_futex()


class Futex:
    """The 32-bit word at ``offset`` of ``buffer`` (writable, e.g. an ``mmap`` or ``bytearray``).

    Example::

        word = Futex(shared_mmap, 64)
        word.wait(expected=0, timeout_s=0.01)   # blocks while the word still holds 0
        word.wake()                             # from any process mapping the same memory
    """

    __slots__ = ("_addr", "_pin", "_ts", "_wake_args")

    def __init__(self, buffer: Any, offset: int) -> None:
        if not available():
            raise OSError(errno.ENOSYS, "futex waits are not available on this platform")
        pin = (ctypes.c_char * 1).from_buffer(buffer, 0)      # raises on read-only buffers
        size = memoryview(buffer).nbytes
        if not 0 <= offset <= size - 4:
            raise ValueError(f"Futex: expected an offset in [0, {size - 4}], got {offset}")
        addr = ctypes.addressof(pin) + offset
        if addr % 4:
            raise ValueError(f"Futex: the word at offset {offset} is not 4-byte aligned")
        self._pin = pin
        self._addr = ctypes.c_void_p(addr)
        self._ts = _Timespec(0, 0)
        self._wake_args = (_NR, self._addr, _FUTEX_WAKE, ctypes.c_int(_WAKE_ALL), None, None, 0)

    def wait(self, expected: int, timeout_s: float) -> bool:
        """Block while the word equals ``expected`` (low 32 bits), at most ``timeout_s`` seconds.

        Returns False on timeout, True otherwise (woken, the word already differed, or a signal):
        callers re-check their condition either way.
        """
        timeout_s = max(0.0, timeout_s)
        sec = int(timeout_s)
        self._ts.tv_sec = sec
        self._ts.tv_nsec = int((timeout_s - sec) * 1e9)
        value = ctypes.c_int(((expected + 2**31) % 2**32) - 2**31)   # as the kernel's signed int
        rc = _syscall(_NR, self._addr, _FUTEX_WAIT, value, ctypes.byref(self._ts), None, 0)
        if rc == 0:
            return True
        err = ctypes.get_errno()
        if err == errno.ETIMEDOUT:
            return False
        if err in (errno.EAGAIN, errno.EINTR):
            return True
        raise OSError(err, f"futex wait failed: {os.strerror(err)}")

    def wake(self) -> int:
        """Wake every waiter blocked on the word; returns how many were woken."""
        return max(0, int(_syscall(*self._wake_args)))
