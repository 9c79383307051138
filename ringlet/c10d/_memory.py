"""Proof that a tensor's memory may be read (and written) before a transport touches it.

[Note: memory the allocator did not make]
A storage that torch's allocator made (``resizable()``) is ordinary read-write
process memory: nothing to prove beyond the bounds that ``checks`` computes.
Any other storage wraps memory someone else owns -- ``torch.frombuffer``,
``torch.from_numpy``, DLPack, a file mapping -- and torch does not remember
whether that memory may be written.  A transport that ``memmove``s results into
a read-only mapping kills the process with SIGSEGV; one that reads a file
mapping past the end of a truncated file gets SIGBUS.  So for those storages we
read ``/proc/self/maps`` once, check that every byte of the storage is mapped
with the permissions the operation needs and that a file-backed mapping does not
extend past its file's end, and remember the verdict on the storage object
(torch keeps one Python object per storage; the verdict dies with it).

Memory of a Python ``bytes`` object (``torch.frombuffer(b"...")``) is writable
as far as the kernel knows, but writing into it corrupts an immutable object;
it is recognised by the object header that precedes its bytes (CPython's
``PyBytesObject``: refcount, type, size, hash, then the data), looked up only in
memory the maps just proved readable.

Verdicts can go stale only if the user ``mprotect``s or truncates the memory
behind a live tensor -- which would crash torch's own ops on that tensor too.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import weakref
from typing import Any

import numpy as np

__all__ = ["refusal"]

_MAPS = "/proc/self/maps"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_BYTES_HDR = 32               # offset of ob_sval in CPython 3.10-3.13's PyBytesObject (64-bit)
_SCAN = 64 * 1024             # how far before the data a bytes header is looked for
_CPYTHON64 = sys.implementation.name == "cpython" and sys.maxsize > 2**32

# id(storage) -> (weak reference to it, (reason it may not be read, reason it may not be
# written)); "" means allowed.  Looked up by id without a lock (one dict read, atomic under the
# GIL: this runs on every collective on such memory); the reference tells a live entry from one
# whose storage died and whose id was reused, and its callback drops the entry.
_verdicts: dict[int, tuple[weakref.ref[Any], tuple[str, str]]] = {}


def refusal(storage: Any, write: bool) -> str:
    """Why the memory of ``storage`` (not made by torch's allocator) may not be read, or written
    when ``write``; ``""`` when it may."""
    key = id(storage)
    hit = _verdicts.get(key)
    if hit is not None and hit[0]() is storage:
        verdict = hit[1]
    else:
        verdict = _judge(storage.data_ptr(), storage.nbytes())
        _verdicts[key] = (weakref.ref(storage, functools.partial(_forget, key)), verdict)
    return verdict[1] if write and not verdict[0] else verdict[0]


def _forget(key: int, ref: weakref.ref[Any]) -> None:
    hit = _verdicts.get(key)
    if hit is not None and hit[0] is ref:     # not an entry made since for a new storage
        _verdicts.pop(key, None)


def _mappings() -> list[tuple[int, int, str, int, str]] | None:
    """(start, end, perms, file offset, path) of every mapping, or None where there are no maps."""
    try:
        with open(_MAPS, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    out = []
    for line in raw.splitlines():
        parts = line.split(None, 5)
        lo, _, hi = parts[0].partition(b"-")
        path = parts[5].decode("utf-8", "replace").strip() if len(parts) > 5 else ""
        out.append((int(lo, 16), int(hi, 16), parts[1].decode(), int(parts[2], 16), path))
    return out


def _judge(ptr: int, nbytes: int) -> tuple[str, str]:
    maps = _mappings()
    if maps is None or nbytes == 0:
        return "", ""          # nothing to read the layout from (not Linux): trust the memory
    lo, hi = ptr, ptr + nbytes
    covering = [m for m in maps if m[0] < hi and m[1] > lo]
    at = lo
    for start, end, perms, off, path in sorted(covering):
        if start > at:
            break
        if "r" not in perms:
            return f"its memory at {at:#x} is mapped without read permission ({perms})", ""
        if _past_end_of_file(path, start, off, min(end, hi)):
            return (f"its memory is a mapping of {path} that extends past the end of that file "
                    "(reading it would raise SIGBUS)"), ""
        if "w" not in perms:
            return "", f"its memory is mapped read-only ({perms} {path or 'anonymous'})"
        at = end
    if at < hi:
        return f"its memory at {at:#x} (up to {hi:#x}) is not mapped in this process", ""
    if _inside_bytes_object(ptr, nbytes, covering):
        return ("",
                "its memory belongs to an immutable Python bytes object (torch.frombuffer(bytes))")
    return "", ""


def _past_end_of_file(path: str, start: int, off: int, used_end: int) -> bool:
    if not path.startswith("/") or path.endswith("(deleted)") or path.startswith("/dev/"):
        return False
    try:
        size = os.stat(path).st_size
    except OSError:
        return False
    last_page = (size + _PAGE - 1) // _PAGE * _PAGE      # the tail of the last page reads as 0
    return off + (used_end - start) > last_page


def _inside_bytes_object(ptr: int, nbytes: int,
                         covering: list[tuple[int, int, str, int, str]]) -> bool:
    """Whether [ptr, ptr+nbytes) lies in the data of a live ``bytes`` object (see the note).

    Candidates: every 8-byte word up to ``_SCAN`` bytes before ``ptr`` that holds ``id(bytes)``
    (small objects), and the start of the mapping (a large object gets a mapping of its own,
    behind malloc's 16-byte chunk header).  Only memory of the mapping that holds ``ptr`` --
    proven readable by the caller -- is read.
    """
    home = [m for m in covering if m[0] <= ptr < m[1]]
    if not _CPYTHON64 or not home:
        return False
    map_lo, map_hi = home[0][0], home[0][1]
    lo = (max(map_lo, ptr - _BYTES_HDR - _SCAN) + 7) // 8 * 8
    hi = ptr // 8 * 8
    if hi - lo < _BYTES_HDR:
        return False
    words = np.frombuffer(memoryview((ctypes.c_char * (hi - lo)).from_address(lo)), dtype=np.uint64)
    objs = [lo + 8 * (int(i) - 1) for i in np.flatnonzero(words == id(bytes)) if i >= 1]
    objs.append(map_lo + 16)
    return any(_bytes_data_covers(o, map_lo, map_hi, ptr, nbytes) for o in objs)


def _bytes_data_covers(obj: int, lo: int, hi: int, ptr: int, nbytes: int) -> bool:
    """Whether a ``bytes`` object at ``obj`` owns [ptr, ptr+nbytes); [lo, hi) is readable.

    A word equal to ``id(bytes)`` is not proof (other structures point at the type too), so the
    header must also be plausible: a small reference count, a size that fits the mapping, and
    the NUL byte CPython always keeps after a bytes object's data.
    """
    if obj < lo or obj + _BYTES_HDR > hi:
        return False
    refcnt, typ, size = (ctypes.c_uint64.from_address(obj + 8 * k).value for k in range(3))
    data = obj + _BYTES_HDR
    if typ != id(bytes) or not 0 < refcnt < 1 << 32 or data + size >= hi:
        return False
    return (data <= ptr and ptr + nbytes <= data + size
            and ctypes.c_ubyte.from_address(data + size).value == 0)
