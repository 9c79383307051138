"""The ``shm`` transport: ranks on one host exchange through one shared arena per group.

The arena is a file in /dev/shm opened with ``os.open`` + ``mmap`` (not
``multiprocessing.shared_memory``, whose resource tracker on Python 3.11
unlinks segments that an attaching process does not own).  Group rank 0
creates it exclusively (``O_EXCL``, mode 0600) under an unpredictable name,
``posix_fallocate``s it so that a full /dev/shm is an error now rather than a
SIGBUS later, and unlinks it as soon as every rank has attached: a crash
leaves nothing behind.  A creator killed before that moment leaves a name that
the launcher and the next creator remove ([Note: segment lifecycle] in
``ringlet._segments``).  Each rank watches its peers through pidfds, so a dead
peer becomes an error in every survivor within ``LIVENESS_PERIOD``.

The same file carries the group's buffer heap past the arena ([Note: arena buffers] in
``arena_buffers``): sparse, mapped separately, each rank committing pages of its own region as
it allocates buffers (so every rank keeps its descriptor of the file open until it closes).
"""

from __future__ import annotations

import mmap
import os
import select
import socket
from datetime import timedelta

from ringlet import _env
from ringlet._segments import SHM_DIR, SHM_PREFIX, new_segment_name, sweep_stale
from ringlet.errors import DistBackendError, DistStoreError
from ringlet.transport.arena import (
    C_PID,
    C_TOKEN,
    C_TOKEN_AT,
    H_ABORT,
    Arena,
    ArenaLayout,
    default_p2p_bytes,
)
from ringlet.transport.arena_algos import ArenaTransport
from ringlet.transport.arena_buffers import BufferHeap, file_commit, region_bytes_for
from ringlet.transport.arena_cma import PeerReader, Token

__all__ = ["SHM_DIR", "SHM_PREFIX", "ShmTransport"]

HEAP_ALIGN = 2 << 20     # the heap starts on a 2 MiB boundary of the file (huge-page friendly)


def _heap_off(layout: ArenaLayout) -> int:
    return (layout.total + HEAP_ALIGN - 1) // HEAP_ALIGN * HEAP_ALIGN


def _no_room(path: str, nbytes: int, group: str, err: OSError) -> DistBackendError:
    try:
        st = os.statvfs(SHM_DIR)
        free = f"{st.f_bavail * st.f_frsize} bytes free"
    except OSError:
        free = "free space unknown"
    return DistBackendError(
        f"group {group}: cannot reserve the shared-memory arena {path}: requested {nbytes} bytes, "
        f"{free} in {SHM_DIR} ({err.strerror}). Enlarge /dev/shm (docker --shm-size) or lower "
        "RINGLET_SHM_SLOT_BYTES.", group=group, requested=nbytes)


class ShmTransport(ArenaTransport):
    """Shared-memory transport among processes of one host (see module docstring)."""

    name = "shm"

    def __init__(self, arena: Arena, mm: mmap.mmap, pids: list[int]) -> None:
        super().__init__(arena)
        self._mm = mm
        self._pids = pids
        self._heap_fd = -1
        self._host = socket.gethostname()
        self._poll = select.poll()
        self._fd_rank: dict[int, int] = {}
        self._dead: set[int] = set()
        for r, pid in enumerate(pids):
            if r == self.rank:
                continue
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                self._dead.add(r)
                continue
            self._fd_rank[fd] = r
            self._poll.register(fd, select.POLLIN)

    def _alive(self, rank: int) -> bool:
        if rank not in self._dead:
            for fd, _ in self._poll.poll(0):
                self._dead.add(self._fd_rank[fd])
        return rank not in self._dead

    def _describe(self, rank: int) -> str:
        return f"pid {self._pids[rank]} on {self._host}"

    @classmethod
    def create(cls, store, rank: int, world_size: int, timeout: float, group: str,
               slot_bytes: int | None = None) -> ShmTransport:
        """Create (rank 0) or attach to the arena of ``group``; every rank of the group calls this.

        ``store`` is already prefixed for the group.  Raises ``DistBackendError``
        when /dev/shm has no room, ``DistStoreError`` naming the ranks that never attached.
        """
        slot = slot_bytes or _env.shm_slot_bytes()
        layout = ArenaLayout(world_size, slot, default_p2p_bytes(world_size, slot))
        if rank == 0:
            region = region_bytes_for(_env.shm_buffer_bytes(), world_size)
            mm, path, fd = _create_segment(layout, group, world_size * region)
        else:
            name, _, region_s = store.get("shm/name").decode().partition(":")
            region = int(region_s or 0)
            mm, fd = _attach_segment(name, layout, group, world_size * region)
            path = os.path.join(SHM_DIR, name)
        try:
            arena = Arena(mm, layout, rank, alive=lambda r: True, describe_peer=str)
            if rank == 0:
                arena.init_header(os.getpid())   # before the name is published: attachers check it
                store.set("shm/name", f"{os.path.basename(path)}:{region}")
            else:
                arena.check_header()
            token = Token()
            _rendezvous(store, arena, path, timeout, group, token)
            pids = [arena.q[arena.ctrl(r, C_PID)] for r in range(world_size)]
            transport = cls(arena, mm, pids)
            q = arena.q
            reader = PeerReader(rank, pids,
                                [q[arena.ctrl(r, C_TOKEN_AT)] for r in range(world_size)],
                                [q[arena.ctrl(r, C_TOKEN)] for r in range(world_size)], token)
            transport.inplace.use_reader(reader, _env.shm_peer_read_bytes())
        except BaseException:
            os.close(fd)
            if rank == 0:
                _unlink_quietly(path)
            raise
        arena.alive = transport._alive
        arena.describe_peer = transport._describe
        transport._attach_heap(fd, layout, region)
        return transport

    def _attach_heap(self, fd: int, layout: ArenaLayout, region: int) -> None:
        """Map the buffer heap (or, with none reserved, close the file now)."""
        if not region:
            os.close(fd)
            return
        self._heap_fd = fd
        base = _heap_off(layout)
        memory = mmap.mmap(fd, self.world_size * region, offset=base)
        q = self.q
        self.inplace.use_heap(BufferHeap(memory, region, self.rank, self.world_size,
                                         commit=file_commit(fd, base + self.rank * region),
                                         healthy=lambda: not q[H_ABORT]))

    def close(self) -> None:
        """Mark this rank as departed and unmap (bounded; never waits for peers).

        A collective still running on another thread (one that outlived the group's bounded
        teardown) may be about to ``memmove`` to the arena's raw addresses: then the mapping is
        not closed here but when the last reference to it goes, after that thread."""
        try:
            in_flight = self.q[self._entered_i] != self.q[self._done_i]
            self.mark_departed()
        except (ValueError, AttributeError):
            return
        for fd in list(self._fd_rank):
            try:
                self._poll.unregister(fd)
                os.close(fd)
            except OSError:
                pass
        self._fd_rank.clear()
        self._fast.clear()
        self._close_heap()
        self.arena.release()
        if in_flight:
            return
        try:
            self._mm.close()
        except BufferError:
            pass  # tensors that view the arena are still alive; the mapping goes with them

    def _close_heap(self) -> None:
        self.inplace.close()        # before the arena's views go: a late free reads its flag
        fd, self._heap_fd = self._heap_fd, -1
        if fd >= 0:
            os.close(fd)


def _rendezvous(store, arena: Arena, path: str, timeout: float, group: str,
                token: Token) -> None:
    """Every rank publishes its pid and attaches; rank 0 unlinks the name once all have."""
    rank, world_size = arena.rank, arena.world_size
    td = timedelta(seconds=timeout)
    arena.set_ctrl(C_PID, os.getpid())
    arena.set_ctrl(C_TOKEN_AT, token.address)      # for [Note: peer-read all-reduce]'s probe
    arena.set_ctrl(C_TOKEN, token.value)
    if rank != 0:
        store.set(f"shm/attached/{rank}", b"1")
        store.wait(["shm/ready"], td)
        return
    keys = [f"shm/attached/{r}" for r in range(1, world_size)]
    try:
        store.wait(keys, td)
    except DistStoreError:
        missing = [r for r in range(1, world_size) if not store.check([f"shm/attached/{r}"])]
        raise DistStoreError(f"group {group}: ranks {missing} never attached to the shared-memory "
                             f"arena within {timeout:.1f} s",
                             group=group, missing=missing) from None
    finally:
        _unlink_quietly(path)
    store.set("shm/ready", b"1")


def _file_size(layout: ArenaLayout, heap_bytes: int) -> int:
    return _heap_off(layout) + heap_bytes if heap_bytes else layout.total


def _create_segment(layout: ArenaLayout, group: str,
                    heap_bytes: int) -> tuple[mmap.mmap, str, int]:
    """The new segment's arena mapping, path and open descriptor (kept for the heap's commits)."""
    # segments of creators killed before they could unlink ([Note: segment lifecycle])
    sweep_stale(SHM_DIR)
    path = os.path.join(SHM_DIR, new_segment_name())
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, layout.total)   # the arena only: the heap stays sparse
            if heap_bytes:
                os.ftruncate(fd, _file_size(layout, heap_bytes))
        except OSError as e:
            raise _no_room(path, layout.total, group, e) from None
        return mmap.mmap(fd, layout.total), path, fd
    except BaseException:
        os.close(fd)
        _unlink_quietly(path)
        raise


def _attach_segment(name: str, layout: ArenaLayout, group: str,
                    heap_bytes: int) -> tuple[mmap.mmap, int]:
    """The arena mapping of an existing segment and its open descriptor."""
    if "/" in name or not name.startswith(SHM_PREFIX):
        raise DistBackendError(f"group {group}: refusing shared-memory name {name!r} from the "
                               "store")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        size = _file_size(layout, heap_bytes)
        if st.st_uid != os.getuid() or st.st_size != size:
            raise DistBackendError(
                f"group {group}: shared-memory segment {path} has owner uid {st.st_uid} and size "
                f"{st.st_size}; expected uid {os.getuid()} and size {size}")
        return mmap.mmap(fd, layout.total), fd
    except BaseException:
        os.close(fd)
        raise


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
