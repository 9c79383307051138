"""Communication buffers that live in a group's shared memory, read by peers in place.

[Note: arena buffers]
Beside its arena (flags, slots, mailboxes), a group of the ``shm`` and ``inproc`` transports maps
a *buffer heap*: a region of ``H`` bytes per rank (``RINGLET_SHM_BUFFER_BYTES``), rank ``r``'s
at ``r * H``.  A rank allocates buffers in its own region only (:meth:`BufferHeap.allocate`, no
communication) and a buffer is addressed by ``(rank, offset)``: a collective on a buffer writes
its offset into the round header, and each peer reads the buffer in its own mapping of that
rank's region (``arena_inplace.py``), so nothing is copied into the arena's slots or back out.

Reserving, not growing.  The heap is reserved once, when the group is created, and it is sparse:
nothing is committed until a buffer is allocated, which commits exactly its pages
(``posix_fallocate`` on the shared file: a full ``/dev/shm`` is an error at allocation, never a
``SIGBUS`` at first touch).  A large reservation (16 GiB per rank by default) costs address space
and page tables for touched pages only, so no second segment is ever needed: growing by mapping
new segments would need a name exchange and an attach handshake in the middle of a run, and a
name left behind by a crash; the reservation needs neither.  Where the reservation is exhausted
(or 0), :meth:`allocate` returns None and callers use ordinary tensors.

Lifetime.  A buffer is a tensor over a ``memoryview`` of the heap mapping; its views keep that
``memoryview`` alive, and when the last one dies its region returns to the free list (blocks of
``RELEASE_BYTES`` or more also give their pages back, as glibc does for large blocks).  A region
is never reused while a peer may read it: every in-place collective ends with a completion round,
so once it returns no peer reads this rank's buffers any more.  After the group was aborted (a
peer may have been reading when an error unwound this rank) freed regions are *quarantined*:
never reused, never released, until the heap is closed.  Closing the group drops this rank's
mapping of the heap only when no buffer still views it (an exported ``memoryview`` keeps the
mapping, so a tensor that outlives its group stays valid memory; collectives on it simply treat it
as an ordinary tensor).
"""

from __future__ import annotations

import bisect
import mmap
import os
import threading
import weakref
from collections.abc import Callable

import torch

__all__ = ["ALIGN", "RELEASE_BYTES", "BufferHeap", "anonymous_heap", "file_commit",
           "region_bytes_for"]

ALIGN = 64                  # every buffer starts on a cache line (and suits every dtype)
PAGE_ALIGN_BYTES = 64 << 10  # buffers this large start on a page
RELEASE_BYTES = 32 << 20    # freed blocks this large give their pages back (glibc's mmap max)
_PAGE = mmap.PAGESIZE
_VIEW_CACHE_MAX = 64


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


class BufferHeap:
    """One rank's allocator over its region of the group's buffer heap, and views of peers' regions.

    Args:
        memory: the heap mapping (``world_size * region_bytes`` bytes), an ``mmap``.
        region_bytes: bytes per rank (a multiple of the page size).
        rank, world_size: this rank and the group's size.
        commit: ``commit(offset, nbytes)`` makes bytes of this rank's region real before use
            (``posix_fallocate`` on the shared file) and raises ``OSError`` when there is no room;
            None where memory needs no commit (anonymous memory of ``inproc``).
        healthy: False once the group is aborted (freed regions are then quarantined).
        shared_mapping: ``memory`` is shared with other ranks of this process (``inproc``): closing
            drops this rank's reference instead of unmapping.
    """

    def __init__(self, memory: mmap.mmap, region_bytes: int, rank: int, world_size: int,
                 commit: Callable[[int, int], None] | None, healthy: Callable[[], bool],
                 shared_mapping: bool = False) -> None:
        if region_bytes <= 0 or region_bytes % _PAGE:
            raise ValueError(f"buffer heap: expected a positive multiple of {_PAGE} bytes "
                             f"per rank, got {region_bytes}")
        self.memory: mmap.mmap | None = memory
        self.region_bytes = region_bytes
        self.rank = rank
        self.world_size = world_size
        self._commit = commit
        self._healthy = healthy
        self._owns_mapping = not shared_mapping
        self._u8: torch.Tensor | None = torch.frombuffer(memory, dtype=torch.uint8)
        base = self._u8.data_ptr()
        self.lo = base + rank * region_bytes       # this rank's region, as addresses
        self.hi = self.lo + region_bytes
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, region_bytes)]   # (offset, size), by offset
        self._live: dict[int, int] = {}            # offset -> size of allocated blocks
        self._views: dict[tuple[int, int, int, torch.dtype], torch.Tensor] = {}
        self.quarantined = 0                       # bytes never reused after an abort
        self.closed = False

    def __repr__(self) -> str:
        return (f"BufferHeap(rank {self.rank}/{self.world_size}, {self.region_bytes >> 20} MiB per "
                f"rank, {self.live_bytes()} B live)")

    # -- allocation ------------------------------------------------------------------------------
    def allocate(self, nbytes: int) -> torch.Tensor | None:
        """A ``uint8`` tensor of ``nbytes`` in this rank's region, or None when the region has no
        room (or the heap is closed).  Raises ``OSError`` when the shared memory cannot be
        committed (``/dev/shm`` full)."""
        if nbytes < 0:
            raise ValueError(f"buffer heap: expected nbytes >= 0, got {nbytes}")
        align = _PAGE if nbytes >= PAGE_ALIGN_BYTES else ALIGN
        size = _round_up(max(nbytes, 1), ALIGN)
        with self._lock:
            if self.closed or self.memory is None:
                return None
            off = self._take(size, align)
            if off < 0:
                return None
            self._live[off] = size
        try:
            if self._commit is not None:
                lo = off // _PAGE * _PAGE
                self._commit(lo, _round_up(off + size, _PAGE) - lo)
            view = memoryview(self.memory)[self.rank * self.region_bytes + off:
                                           self.rank * self.region_bytes + off + nbytes]
        except BaseException:
            self._release(off)
            raise
        weakref.finalize(view, self._release, off)
        return (torch.frombuffer(view, dtype=torch.uint8) if nbytes
                else torch.empty(0, dtype=torch.uint8))

    def _take(self, size: int, align: int) -> int:
        """First fit of ``size`` bytes at ``align`` in the free list; -1 if none (lock held)."""
        for k, (off, avail) in enumerate(self._free):
            start = _round_up(off, align)
            if start + size > off + avail:
                continue
            pieces = []
            if start > off:
                pieces.append((off, start - off))
            if start + size < off + avail:
                pieces.append((start + size, off + avail - start - size))
            self._free[k:k + 1] = pieces
            return start
        return -1

    def _release(self, off: int) -> None:
        """The last view of the block at ``off`` died: free it (see the module docstring)."""
        with self._lock:
            size = self._live.pop(off, None)
            if size is None:
                return
            if self.closed or not self._healthy():
                self.quarantined += size
                return
            lo, hi = self._merge(off, size)
        if hi - lo >= RELEASE_BYTES:
            self._punch(lo, hi)

    def _merge(self, off: int, size: int) -> tuple[int, int]:
        """Insert a free block, merging neighbours; returns the merged
        block's bounds (lock held)."""
        k = bisect.bisect_left(self._free, (off, 0))
        lo, hi = off, off + size
        if k < len(self._free) and self._free[k][0] == hi:
            hi += self._free.pop(k)[1]
        if k > 0 and sum(self._free[k - 1]) == lo:
            lo = self._free[k - 1][0]
            self._free[k - 1] = (lo, hi - lo)
        else:
            self._free.insert(k, (lo, hi - lo))
        return lo, hi

    def _punch(self, lo: int, hi: int) -> None:
        """Give the whole pages inside [lo, hi) of this rank's region back to the system."""
        a, b = _round_up(lo, _PAGE), hi // _PAGE * _PAGE
        mem = self.memory
        if b <= a or mem is None:
            return
        try:
            mem.madvise(mmap.MADV_REMOVE, self.rank * self.region_bytes + a, b - a)
        except (OSError, ValueError, AttributeError):
            pass   # the pages stay committed; they are reused by later buffers

    def live_bytes(self) -> int:
        with self._lock:
            return sum(self._live.values())

    # -- addressing -------------------------------------------------------------------------------
    def offset_of(self, t: torch.Tensor) -> int:
        """Offset of ``t``'s bytes in this rank's region, or -1 if they are not all inside it."""
        p = t.data_ptr()
        if self.lo <= p and p + t.numel() * t.element_size() <= self.hi and not self.closed:
            return p - self.lo
        return -1

    def view(self, rank: int, off: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at ``off`` of ``rank``'s region (a peer's buffer).

        Raises ``ValueError`` for a range outside that region (a corrupt descriptor)."""
        key = (rank, off, numel, dtype)
        t = self._views.get(key)
        if t is not None:
            return t
        nbytes = numel * dtype.itemsize
        if not (0 <= rank < self.world_size and 0 <= off and off + nbytes <= self.region_bytes
                and off % dtype.itemsize == 0) or self._u8 is None:
            raise ValueError(f"buffer heap: rank {rank}'s buffer at offset {off} of {nbytes} bytes "
                             f"is outside its {self.region_bytes}-byte region")
        start = rank * self.region_bytes + off
        t = self._u8[start:start + nbytes].view(dtype)
        if len(self._views) >= _VIEW_CACHE_MAX:
            self._views.clear()
        self._views[key] = t
        return t

    # -- lifecycle
    # ----------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop allocating; unmap now if no buffer views the heap, else when the last one dies."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._views.clear()
            self._u8 = None
            mem, self.memory = self.memory, None
        if mem is not None and self._owns_mapping:
            try:
                mem.close()
            except BufferError:
                pass   # live buffers export it: the mapping goes with the last of them


def anonymous_heap(world_size: int, region_bytes: int) -> mmap.mmap:
    """Shared anonymous memory for the buffer heap of ranks that are threads (``inproc``); reserved
    without committing (``MAP_NORESERVE``)."""
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_NORESERVE", 0x4000)
    return mmap.mmap(-1, world_size * region_bytes, flags=flags)


def file_commit(fd: int, base: int) -> Callable[[int, int], None]:
    """``commit(offset, nbytes)`` for a heap in a shared file at ``base`` + this rank's region."""
    def commit(off: int, nbytes: int) -> None:
        os.posix_fallocate(fd, base + off, nbytes)
    return commit


def region_bytes_for(requested: int, world_size: int, cap: int = 1 << 40) -> int:
    """Per-rank bytes of a heap: ``requested`` rounded down to pages, the whole at most ``cap``."""
    per = min(max(requested, 0), cap // max(world_size, 1))
    return per // _PAGE * _PAGE
