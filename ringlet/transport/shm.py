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
from ringlet.transport.arena import C_PID, Arena, ArenaLayout, default_p2p_bytes
from ringlet.transport.arena_algos import ArenaTransport

__all__ = ["SHM_DIR", "SHM_PREFIX", "ShmTransport"]



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
        td = timedelta(seconds=timeout)
        if rank == 0:
            mm, path = _create_segment(layout, group)
            arena = Arena(mm, layout, rank, alive=lambda r: True, describe_peer=str)
            arena.init_header(os.getpid())   # before the name is published: attachers check it
            store.set("shm/name", os.path.basename(path))
        else:
            name = store.get("shm/name").decode()
            mm, path = _attach_segment(name, layout, group), os.path.join(SHM_DIR, name)
            arena = Arena(mm, layout, rank, alive=lambda r: True, describe_peer=str)
            arena.check_header()
        arena.set_ctrl(C_PID, os.getpid())
        if rank != 0:
            store.set(f"shm/attached/{rank}", b"1")
            store.wait(["shm/ready"], td)
        else:
            keys = [f"shm/attached/{r}" for r in range(1, world_size)]
            try:
                store.wait(keys, td)
            except DistStoreError:
                missing = [r for r in range(1, world_size) if not store.check([f"shm/attached/{r}"])]
                raise DistStoreError(f"group {group}: ranks {missing} never attached to the shared-memory "
                                     f"arena within {timeout:.1f} s", group=group, missing=missing) from None
            finally:
                _unlink_quietly(path)
            store.set("shm/ready", b"1")
        pids = [arena.q[arena.ctrl(r, C_PID)] for r in range(world_size)]
        transport = cls(arena, mm, pids)
        arena.alive = transport._alive
        arena.describe_peer = transport._describe
        return transport

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
        self.arena.release()
        if in_flight:
            return
        try:
            self._mm.close()
        except BufferError:
            pass  # tensors that view the arena are still alive; the mapping goes with them


def _create_segment(layout: ArenaLayout, group: str) -> tuple[mmap.mmap, str]:
    sweep_stale(SHM_DIR)   # segments of creators killed before they could unlink ([Note: segment lifecycle])
    path = os.path.join(SHM_DIR, new_segment_name())
    flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(path, flags, 0o600)
    try:
        try:
            os.posix_fallocate(fd, 0, layout.total)
        except OSError as e:
            raise _no_room(path, layout.total, group, e) from None
        return mmap.mmap(fd, layout.total), path
    except BaseException:
        _unlink_quietly(path)
        raise
    finally:
        os.close(fd)


def _attach_segment(name: str, layout: ArenaLayout, group: str) -> mmap.mmap:
    if "/" in name or not name.startswith(SHM_PREFIX):
        raise DistBackendError(f"group {group}: refusing shared-memory name {name!r} from the store")
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or st.st_size != layout.total:
            raise DistBackendError(
                f"group {group}: shared-memory segment {path} has owner uid {st.st_uid} and size "
                f"{st.st_size}; expected uid {os.getuid()} and size {layout.total}")
        return mmap.mmap(fd, layout.total)
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
