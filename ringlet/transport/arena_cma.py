"""All-reduce of ordinary tensors by reading the peers' memory (cross-memory attach).

[Note: peer-read all-reduce]
A large ``all_reduce`` on a tensor that is not a buffer of the group's heap would stream through
the arena's slots: every rank copies its tensor in, folds the slots, and the result out -- 3
reads and 2 writes per byte and rank.  Where the kernel lets the ranks read each other's memory
(``process_vm_readv``: same user, no ptrace restriction between them; proved once per group, see
:class:`PeerReader`), a message of at least ``RINGLET_SHM_PEER_READ_BYTES`` goes another way:

- round ``s0``: each rank publishes, in its slot header, the descriptor ``PEER_READ`` (-1) and its
  tensor's address.  If any rank did not (it passed a heap buffer, or cannot read its peers, or
  has the path switched off), every rank goes on with the ordinary or mixed algorithm from the
  next round, exactly as for a mixed in-place call ([Note: in-place collectives]).
- fold: the tensor is cut into one contiguous block per rank; rank ``r`` reads block ``r`` of
  every peer's tensor, a cache-sized piece at a time, into private scratch and folds the pieces
  in rank order into its own tensor (the bits of every other path).
- round ``s1``: every block is final everywhere.
- gather: rank ``r`` reads block ``p`` of every peer ``p`` straight into its own tensor.
- completion round ``s2``: no peer reads this rank's tensor any more; the caller may reuse it.

Per rank and byte this touches memory about half as often as the slot path.  A rank only
*reads* other processes, never writes them: a peer interrupted mid-operation may free its tensor
at once, and a write would then land in memory it reuses.  The kernel checks every remote
address (a wrong one is ``EFAULT``, reported as an error naming the peer, never a crash); local
addresses are this rank's own tensor and scratch, in bounds by construction.  A peer that dies
stops the rounds: the survivors raise rather than return what they read.

Where it pays (2 ranks, a 2-core VM, docs/benchmarks.md): 17-25% less time than the slots at
4-16 MiB, none at 2 MiB, 6% more at 32 MiB and more beyond (the kernel copies at 7-10 GB/s,
against 13 for a user-space copy, and the gather re-reads from memory what the fold wrote);
hence the window from ``RINGLET_SHM_PEER_READ_BYTES`` (4 MiB) to ``PEER_READ_MAX_BYTES``.
Tried and dropped: gathering each piece as soon as its owner publishes it (a progress word per
piece; slower at every size), and fold-round-gather segments of 4-16 MiB (no gain).
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
from collections.abc import Callable, Sequence

import torch

from ringlet.errors import DistBackendError, PeerFailureError
from ringlet.transport.base import OpContext, chunks, split_blocks

__all__ = ["PEER_ADDR", "PEER_READ", "PEER_READ_MAX_BYTES", "PeerReader", "Token",
           "peer_read_all_reduce"]

PEER_READ = -1            # slot-header descriptor: "my tensor is at PEER_ADDR, read it"
PEER_ADDR = 6             # the slot-header word (int64) holding that address
PIECE_BYTES = 256 * 1024  # per peer and fold: the pieces read stay in cache until folded
# Above this the slot path is faster on the machine measured (the kernel's copy runs
# at 7-10 GB/s, and a tensor this large no longer stays in cache between fold and gather).
PEER_READ_MAX_BYTES = 16 << 20


class _IOVec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def _libc_readv() -> Callable[..., int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).process_vm_readv
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(_IOVec), ctypes.c_ulong,
                   ctypes.POINTER(_IOVec), ctypes.c_ulong, ctypes.c_ulong]
    fn.restype = ctypes.c_ssize_t
    return fn


_READV = _libc_readv()


class Token:
    """8 random bytes in this process's private memory, published (address and value) in the
    arena so that peers can prove they read this very process (see :class:`PeerReader`)."""

    def __init__(self) -> None:
        self._buf = ctypes.create_string_buffer(secrets.token_bytes(8), 8)
        self.address = ctypes.addressof(self._buf)
        self.value = int.from_bytes(self._buf.raw, "little", signed=True)


class PeerReader:
    """Reads the memory of the group's other processes (``process_vm_readv``).

    ``pids[r]`` is rank ``r``'s process as published in the arena; rank ``r`` also published the
    address and value of its :class:`Token` (``addrs[r]``, ``values[r]``).  :meth:`usable` reads
    every peer's token once: the right 64 random bits prove that the kernel permits the reads and
    that the pid names the peer's process *in this rank's pid namespace* (ranks in other
    namespaces, whose pids mean other processes here, fail it).  ``own`` keeps this rank's token
    alive while peers may read it.
    """

    def __init__(self, rank: int, pids: Sequence[int], addrs: Sequence[int],
                 values: Sequence[int], own: Token | None = None) -> None:
        self.rank = rank
        self.pids = list(pids)
        self.addrs = list(addrs)
        self.values = list(values)
        self.own = own
        self._verdict: bool | None = None
        self.why_not = ""

    def usable(self) -> bool:
        """Whether every peer can be read (probed on the first call, then remembered)."""
        if self._verdict is None:
            self._verdict = self._probe()
        return self._verdict

    def _probe(self) -> bool:
        if _READV is None:
            self.why_not = "this C library has no process_vm_readv"
            return False
        seen = ctypes.c_int64()
        for r, pid in enumerate(self.pids):
            if r == self.rank:
                continue
            if not self.addrs[r]:
                self.why_not = f"rank {r} published no token"
                return False
            try:
                self.read(r, self.addrs[r], ctypes.addressof(seen), 8)
            except OSError as e:
                self.why_not = f"reading rank {r} (pid {pid}): {e}"
                return False
            if seen.value != self.values[r]:
                self.why_not = (f"pid {pid} is not rank {r}'s process here (its token differs: "
                                "another pid namespace?)")
                return False
        return True

    def read(self, r: int, remote: int, local: int, nbytes: int) -> None:
        """Copy ``nbytes`` at ``remote`` in rank ``r``'s memory to ``local`` in this process.

        ``local`` must be this process's memory, writable for ``nbytes`` (the callers pass their
        own tensors' storage); the kernel checks ``remote``.  Raises ``OSError`` when the peer's
        memory cannot be read (``EFAULT``: not mapped there; ``ESRCH``: no such process).
        """
        if _READV is None:
            raise OSError(errno.ENOSYS, "process_vm_readv is not available")
        done = 0
        while done < nbytes:
            loc = _IOVec(local + done, nbytes - done)
            rem = _IOVec(remote + done, nbytes - done)
            n = _READV(self.pids[r], ctypes.byref(loc), 1, ctypes.byref(rem), 1, 0)
            if n < 0:
                err = ctypes.get_errno()
                if err == errno.EINTR:
                    continue
                raise OSError(err, os.strerror(err))
            if n == 0:
                raise OSError(errno.EFAULT, f"read 0 of {nbytes - done} bytes")
            done += n


def peer_read_all_reduce(reader: PeerReader, flat: torch.Tensor, addrs: Sequence[int],
                         sync: Callable[[], None],
                         scratch: Callable[[int], torch.Tensor],
                         fold: Callable[[torch.Tensor, list[torch.Tensor]], None],
                         ctx: OpContext) -> None:
    """The fold, the middle round (``sync``) and the gather of [Note: peer-read all-reduce].

    ``flat`` is this rank's (pre-scaled) tensor and ``addrs[r]`` rank ``r``'s; ``scratch(k)``
    gives ``k`` private elements of ``flat``'s dtype; ``fold(out, parts)`` folds ``parts`` (in
    rank order; ``out`` is this rank's part) into ``out``.
    """
    me, n = reader.rank, len(addrs)
    size = flat.element_size()
    spans = split_blocks(flat.numel(), n)
    lo, count = spans[me]
    piece = max(PIECE_BYTES // size, 1)
    buf = scratch(piece * (n - 1))
    for a, c in chunks(count, piece):
        mine = flat[lo + a:lo + a + c]
        parts, k = [], 0
        for r in range(n):
            if r == me:
                parts.append(mine)
                continue
            dst = buf[k * piece:k * piece + c]
            _read(reader, r, addrs[r] + (lo + a) * size, dst, ctx)
            parts.append(dst)
            k += 1
        fold(mine, parts)
    sync()
    for r, (plo, c) in enumerate(spans):
        if r != me and c:
            _read(reader, r, addrs[r] + plo * size, flat[plo:plo + c], ctx)


def _read(reader: PeerReader, r: int, remote: int, dst: torch.Tensor, ctx: OpContext) -> None:
    """Read ``dst``'s size from rank ``r`` into ``dst`` (a contiguous tensor of this process)."""
    try:
        reader.read(r, remote, dst.data_ptr(), dst.numel() * dst.element_size())
    except OSError as e:
        if e.errno == errno.ESRCH:
            raise ctx.error(PeerFailureError, f"rank {r} (pid {reader.pids[r]}) died during this "
                            "operation", peer=r) from None
        raise ctx.error(DistBackendError,
                        f"could not read rank {r}'s tensor (pid {reader.pids[r]}, address "
                        f"{remote:#x}): {e}",
                        peer=r) from None
