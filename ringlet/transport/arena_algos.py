"""Collective algorithms over an :class:`~ringlet.transport.arena.Arena` (``shm``, ``inproc``).

See [Note: arena protocol] in ``arena.py``.  Every collective is a sequence of
rounds; large tensors stream through the slots in chunks of ``slot_bytes``
(:func:`~ringlet.transport.base.chunks`).  At the sizes and rank counts of one
host (2-8 ranks) the "direct" algorithm -- every rank reads every slot and
reduces in rank order -- needs one flag wait per chunk and beat reduce-scatter +
all-gather when measured (16 us vs 46 us at 8 B, 2 ranks; see
docs/architecture.md#shared-memory-transport).  Reducing in rank order on every
rank makes the results bit-identical across ranks ([Note: reductions]).
Point-to-point messages use the pair mailboxes (``arena_p2p``).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import torch

from ringlet import _env
from ringlet.errors import CollectiveMismatchError, DistBackendError
from ringlet.transport.arena import C_DEPARTED, C_DONE, C_ENTERED, C_PID, Arena
from ringlet.transport.arena_buffers import BufferHeap
from ringlet.transport.arena_inplace import InplaceCollectives, overlaps
from ringlet.transport.arena_p2p import Mailboxes
from ringlet.transport.base import (
    OpContext,
    Ranks,
    ReduceArg,
    Transport,
    chunks,
    describe_fingerprint,
    whole_group,
)
from ringlet.transport.reduce import NP_DTYPES, Reduction, reads_first, reduction

__all__ = ["FAST_BYTES", "ArenaTransport"]

# Messages up to FAST_BYTES take the small-message path: byte copies in and out of the arena
# (numpy/memoryview copies through views of the user's memory, ArenaTransport._user)
# and the numpy kernel for the reduction.  torch ops cost 3-6 us each in fixed overhead here
# (measured on this 2-core machine), numpy ~1 us: that is the difference between ~90 us and
# ~15 us for an 8-byte all_reduce (~7 us today, docs/benchmarks.md).
FAST_BYTES = 16 * 1024
_BYTE = torch.uint8
_FAST_CACHE_MAX = 256
# numpy views of every slot (buffer 0, buffer 1), and this rank's slot bytes (buffer 0, 1)
_Views = tuple[list[np.ndarray], list[np.ndarray], tuple[memoryview, memoryview]]
# a user tensor's memory: its bytes and a numpy view of its elements (see ArenaTransport._user)
_UserViews = tuple[memoryview, np.ndarray]


def _foldable_in_place(fi: torch.Tensor, fo: torch.Tensor, me: int, N: int) -> bool:
    """Whether reduce-scatter may fold block ``me`` of ``fi`` straight into ``fo``: they do not
    overlap, or ``fo`` *is* that block and the fold reads it before writing (``reads_first``)."""
    size = fo.element_size()
    lo, hi = fi.data_ptr(), fi.data_ptr() + fi.numel() * size
    olo, ohi = fo.data_ptr(), fo.data_ptr() + N * size
    if ohi <= lo or olo >= hi:
        return True
    return olo == lo + me * N * size and reads_first(me)


class ArenaTransport(Transport):
    """Algorithms shared by the ``shm`` (processes) and ``inproc`` (threads) transports.  Those on
    buffers of the group's heap, and the peer-read all-reduce, belong to the object it holds as
    ``inplace`` (``arena_inplace.InplaceCollectives``: [Note: in-place collectives]), which uses
    only its round counter ``step`` and :meth:`sync_round`."""

    def __init__(self, arena: Arena) -> None:
        self.arena = arena
        self.rank = arena.rank
        self.world_size = arena.world_size
        self.step = 0
        lay = arena.layout
        n = self.world_size
        self.q = arena.q
        self._hdr_i = [[lay.slot_hdr_off(r, b) // 8 for b in (0, 1)] for r in range(n)]
        self._ranks = list(range(n))
        self._flag_me = arena.flag_i[self.rank]
        self._verify = _env.fingerprint_checks()
        self._peer_hdr = [[self._hdr_i[r][b] for r in arena.peers] for b in (0, 1)]
        self._entered_i = arena.ctrl(self.rank, C_ENTERED)
        self._done_i = arena.ctrl(self.rank, C_DONE)
        self._fast: dict[tuple[torch.dtype, int, int], _Views] = {}
        self._users: dict[tuple[int, torch.dtype, int], _UserViews] = {}
        # the largest message of the small-message path (-1: none; see _small)
        self._small_max = FAST_BYTES if lay.slot_bytes >= FAST_BYTES and n > 1 else -1
        self.mail = Mailboxes(arena)
        self.inplace = InplaceCollectives(arena, self)

    def buffer(self, nbytes: int) -> torch.Tensor | None:
        return self.inplace.buffer(nbytes)

    @property
    def heap(self) -> BufferHeap | None:
        """The group's buffer heap, if any (``is_comm_buffer`` asks a transport for it)."""
        return self.inplace.heap

    def _small(self, nbytes: int, ranks: Ranks) -> bool:
        """The start-of-collective fast check of all_reduce, reduce_scatter and all_gather: whether
        a call moving ``nbytes`` per rank (the same on every rank, so all decide alike) goes
        straight to the small-message path, skipping the ordinary path's prologue, its flat views
        and the in-place checks (sizes this small never run in place).  Measured on the 2-core
        machine while other jobs loaded it (8-byte all_reduce, 2 ranks, the fastest of 40 batches
        of 500 calls in each of 4 worlds): 13.2 us a call through this check, 16.8 us with every
        call sent through ``_reduce``; the check itself, a method call, costs within 0.1 us of the
        five inline conditions it replaced (timeit: -49 to +94 ns)."""
        return nbytes <= self._small_max and ranks is None

    def _views(self, dtype: torch.dtype, k: int, off: int) -> _Views:
        """numpy views of ``k`` elements at byte ``off`` of every slot (buffer 0, buffer 1) and
        this rank's slot bytes there.  Cached: training loops repeat the same sizes, and slicing
        costs ~0.3 us."""
        views = self._fast.get((dtype, k, off))
        if views is None:
            if len(self._fast) >= _FAST_CACHE_MAX:
                self._fast.clear()
            npdt = np.dtype(NP_DTYPES[dtype])
            lay, mem = self.arena.layout, cast(Any, self.arena.memory)
            b0 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 0) + off) for r in self._ranks]
            b1 = [np.frombuffer(mem, npdt, k, lay.slot_data_off(r, 1) + off) for r in self._ranks]
            mine = (b0[self.rank].data.cast("B"), b1[self.rank].data.cast("B"))
            views = self._fast[(dtype, k, off)] = (b0, b1, mine)
        return views

    def _user(self, ptr: int, dtype: torch.dtype, k: int) -> _UserViews:
        """Views of the ``k`` elements of ``dtype`` at address ``ptr``: a user tensor's memory,
        which the caller has just read from the tensor (``data_ptr()``) and the validation gate
        proved in bounds.  A view holds only the address, so one made for an earlier call on the
        same address and size reads and writes exactly what ``memmove(ptr, ...)`` would; cached
        because ctypes.memmove costs ~0.35 us a call and a memoryview copy ~0.05 us."""
        views = self._users.get((ptr, dtype, k))
        if views is None:
            if len(self._users) >= _FAST_CACHE_MAX:
                self._users.clear()
            raw = (ctypes.c_char * (k * dtype.itemsize)).from_address(ptr)
            views = memoryview(raw).cast("B"), np.frombuffer(memoryview(raw), NP_DTYPES[dtype], k)
            self._users[(ptr, dtype, k)] = views
        return views

    # -- round machinery -----------------------------------------------------------
    def sync_round(self, s: int, fp: tuple[int, int, int], chunk: int, ctx: OpContext) -> None:
        """Publish round ``s`` with this rank's fingerprint, wait for all peers, check theirs."""
        q = self.q
        b = s & 1
        f0, f1, f2 = fp
        h = self._hdr_i[self.rank][b]
        q[h + 1] = f0
        q[h + 2] = f1
        q[h + 3] = f2
        q[h + 4] = chunk
        q[h] = s
        q[self._flag_me] = s
        self.arena.notify()
        self.arena.wait_all_step(s, ctx)
        if self._verify:
            for hr in self._peer_hdr[b]:
                if q[hr + 1] != f0 or q[hr + 2] != f1 or q[hr + 3] != f2 or q[hr + 4] != chunk:
                    raise self._mismatch(s, ctx)
        self.step = s

    def _mismatch(self, s: int, ctx: OpContext) -> DistBackendError:
        q = self.q
        calls = []
        for r in self._ranks:
            h = self._hdr_i[r][s & 1]
            fp = describe_fingerprint((q[h + 1], q[h + 2], q[h + 3]))
            calls.append(f"rank {r}: {fp} (chunk {q[h + 4]})")
        return ctx.error(CollectiveMismatchError,
                         "ranks called different collectives: " + "; ".join(calls), calls=calls)

    def _alone(self, ctx: OpContext, ranks: Ranks) -> bool:
        """The prologue of every collective: True for a group of one (the caller finishes locally);
        otherwise record that this rank entered ``ctx`` (for timeout reports)."""
        if ranks is not None:
            whole_group(self, ranks)
        if self.world_size == 1:
            return True
        self.q[self._entered_i] = ctx.seq
        return False

    def _done(self, ctx: OpContext) -> None:
        self.q[self._done_i] = ctx.seq

    def _cap(self, dtype: torch.dtype) -> int:
        return self.arena.layout.slot_bytes // dtype.itemsize

    # -- reductions ------------------------------------------------------------------
    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        red = reduction(op, factor, buf.dtype, self.world_size)
        k = buf.numel()
        nbytes = k * buf.element_size()
        if self._small(nbytes, ranks) and red.ufunc is not None:
            q = self.q
            q[self._entered_i] = ctx.seq
            self._small_reduce(buf, red, None, ctx, k, nbytes)
            q[self._done_i] = ctx.seq
            return
        inplace = self.inplace
        off = -1 if ranks is not None else inplace.offset(buf, nbytes)
        if off >= 0 or (ranks is None and inplace.peer_reads(nbytes)):
            # a descriptor path: the tensor is a heap buffer, or the peers may read it
            self.q[self._entered_i] = ctx.seq
            if (inplace.all_reduce(buf, red, off, ctx) if off >= 0
                    else inplace.peer_read_all_reduce(buf, red, ctx)):
                self._done(ctx)
                return
            self._clear_desc_after(lambda: self._reduce(buf, red.completing(), None, ctx, ranks))
            return
        self._reduce(buf, red, None, ctx, ranks)

    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        self._reduce(buf, reduction(op, factor, buf.dtype, self.world_size), root, ctx, ranks)

    def _reduce(self, buf: torch.Tensor, red: Reduction, root: int | None, ctx: OpContext,
                ranks: Ranks) -> None:
        # the prologue (``_alone``), inlined for the common case: this is the latency path
        if (ranks is not None or self.world_size == 1) and self._alone(ctx, ranks):
            red.contribute(buf, buf)
            return
        self.q[self._entered_i] = ctx.seq
        k = buf.numel()
        nbytes = k * buf.element_size()
        if nbytes <= self._small_max and red.ufunc is not None:
            self._small_reduce(buf, red, root, ctx, k, nbytes)
            self.q[self._done_i] = ctx.seq
            return
        me, a, dt = self.rank, self.arena, buf.dtype
        flat = buf.view(-1)
        fp = ctx.fingerprint()
        whole = flat.numel()
        own = red.exact and reads_first(me)    # fold this rank's input in place, not its slot copy
        for k, (off, c) in enumerate(chunks(whole, self._cap(dt))):
            s = self.step + 1
            b = s & 1
            piece = flat if c == whole else flat[off:off + c]
            red.contribute(piece, a.slot(me, b, dt)[:c])
            self.sync_round(s, fp, k, ctx)
            if k == 0 and self.inplace.peers_inplace(b):
                return self._reduce(buf, red, root, ctx, ranks)    # [Note: in-place collectives]
            if root is None or root == me:
                parts = [piece if own and r == me else a.slot(r, b, dt)[:c] for r in self._ranks]
                red.fold_(piece, parts)
        self._done(ctx)

    def _small_reduce(self, buf: torch.Tensor, red: Reduction, root: int | None, ctx: OpContext,
                      k: int, nbytes: int) -> None:
        """One round: copy in, flag, numpy fold in rank order straight into ``buf``."""
        s = self.step + 1
        b = s & 1
        dt = buf.dtype
        ptr = buf.data_ptr()
        user = self._users.get((ptr, dt, k)) or self._user(ptr, dt, k)
        views = self._fast.get((dt, k, 0)) or self._views(dt, k, 0)
        views[2][b][:] = user[0]
        self.sync_round(s, ctx.fingerprint(), 0, ctx)
        if root is not None and root != self.rank:
            return
        # reads only the slots: buf may be written as it goes (views[b], b in {0, 1}, is a list of
        # slot arrays; mypy types a tuple indexed by a variable as the union of all its items)
        red.np_fold(user[1], views[b])  # type: ignore[arg-type]

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        n, me = self.world_size, self.rank
        red = reduction(op, factor, out.dtype, n)
        nbytes = out.numel() * out.element_size()
        if self._small(nbytes * n, ranks) and red.ufunc is not None:
            q = self.q      # addresses only (both tensors are contiguous): no flat views
            q[self._entered_i] = ctx.seq
            self._small_reduce_scatter(inp, out, red, nbytes, ctx)
            q[self._done_i] = ctx.seq
            return
        if (ranks is not None or n == 1) and self._alone(ctx, ranks):
            red.contribute(inp.view(-1), out.view(-1))
            return
        self.q[self._entered_i] = ctx.seq
        fo, fi = out.view(-1), inp.view(-1)
        N = fo.numel()
        off = self.inplace.offset(fi, nbytes * n) if ranks is None else -1
        if off >= 0 and red.exact and (not overlaps(fi, fo)
                                       or fo.data_ptr() == fi[me * N:].data_ptr()):
            if self.inplace.reduce_scatter(fi, fo, red, off, ctx):
                self._done(ctx)
                return
            self._clear_desc_after(lambda: self._reduce_scatter(fi, fo, red, ctx))  # a mixed call
            return
        self._reduce_scatter(fi, fo, red, ctx)

    def _reduce_scatter(self, fi: torch.Tensor, fo: torch.Tensor, red: Reduction,
                        ctx: OpContext) -> None:
        """reduce_scatter through the slots (flat input and output)."""
        n, me, a = self.world_size, self.rank, self.arena
        N, dt = fo.numel(), fo.dtype
        fp = ctx.fingerprint()
        sub = self._cap(dt) // n
        # Only this rank reads its own block: fold it from the input instead of a copy in the
        # arena when that copy would be exact and folding cannot overwrite it before it is read.
        own = red.exact and _foldable_in_place(fi, fo, me, N)
        for k, (off, c) in enumerate(chunks(N, sub)):
            s = self.step + 1
            b = s & 1
            mine = a.slot(me, b, dt)
            for r in self._ranks:
                if r != me or not own:
                    red.contribute(fi[r * N + off:r * N + off + c], mine[r * sub:r * sub + c])
            self.sync_round(s, fp, k, ctx)
            if k == 0 and self.inplace.peers_inplace(b):
                return self._reduce_scatter(fi, fo, red, ctx)   # [Note: in-place collectives]
            parts = [a.slot(r, b, dt)[me * sub:me * sub + c] for r in self._ranks]
            if own:
                parts[me] = fi[me * N + off:me * N + off + c]
            red.fold_(fo[off:off + c], parts)
        self._done(ctx)

    def _small_reduce_scatter(self, fi: torch.Tensor, fo: torch.Tensor, red: Reduction, nbytes: int,
                              ctx: OpContext) -> None:
        """Whole input into this rank's slot in one memmove; fold block ``rank`` of every slot."""
        me = self.rank
        s = self.step + 1
        b = s & 1
        total = nbytes * self.world_size
        src = fi.data_ptr()
        inv = self._users.get((src, _BYTE, total)) or self._user(src, _BYTE, total)
        mine = self._fast.get((_BYTE, total, 0)) or self._views(_BYTE, total, 0)
        mine[2][b][:] = inv[0]
        self.sync_round(s, ctx.fingerprint(), 0, ctx)
        dt, k = fo.dtype, fo.numel()
        views = self._fast.get((dt, k, me * nbytes)) or self._views(dt, k, me * nbytes)
        dst = fo.data_ptr()
        # straight into fo: the fold reads only the slots, so fo may be a block of fi
        red.np_fold((self._users.get((dst, dt, k)) or self._user(dst, dt, k))[1],
                    views[b])  # type: ignore[arg-type]  # b in {0, 1}: see _small_reduce

    # -- data movement ---------------------------------------------------------------
    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        if self._alone(ctx, ranks):
            return
        me, a = self.rank, self.arena
        fp = ctx.fingerprint()
        nbytes = buf.numel() * buf.element_size()
        if nbytes <= self._small_max:    # bytes, whatever the dtype
            s = self.step + 1
            b = s & 1
            ptr = buf.data_ptr()
            user = self._users.get((ptr, _BYTE, nbytes)) or self._user(ptr, _BYTE, nbytes)
            views = self._fast.get((_BYTE, nbytes, 0)) or self._views(_BYTE, nbytes, 0)
            if me == root:
                views[2][b][:] = user[0]
            self.sync_round(s, fp, 0, ctx)
            if me != root:
                user[1][:] = views[b][root]
            self._done(ctx)
            return
        flat = buf.view(-1)
        dt = flat.dtype
        for k, (off, c) in enumerate(chunks(flat.numel(), self._cap(dt))):
            s = self.step + 1
            b = s & 1
            if me == root:
                a.slot(me, b, dt)[:c].copy_(flat[off:off + c])
            self.sync_round(s, fp, k, ctx)
            if me != root:
                flat[off:off + c].copy_(a.slot(root, b, dt)[:c])
        self._done(ctx)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        nbytes = inp.numel() * inp.element_size()
        if self._small(nbytes, ranks):
            q = self.q      # both tensors are contiguous: the small path reads their addresses
            q[self._entered_i] = ctx.seq
            self._small_gather(inp, out, nbytes, ctx)
            q[self._done_i] = ctx.seq
            return
        offs = None if ranks is not None else self.inplace.gather_offsets(inp, out, nbytes)
        if offs is not None:
            self.q[self._entered_i] = ctx.seq
            if self.inplace.all_gather(inp, out, *offs, ctx):
                self._done(ctx)
                return
            self._clear_desc_after(lambda: self._gather(inp, out, None, ctx, ranks))
            return
        self._gather(inp, out, None, ctx, ranks)

    def _clear_desc_after(self, ordinary: Callable[[], None]) -> None:
        """Run a mixed call on the ordinary path, then clear this rank's descriptor (the peers
        read it in the round before)."""
        try:
            ordinary()
        finally:
            self.inplace.clear_desc()

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        self._gather(inp, out, root, ctx, ranks)

    def _gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int | None, ctx: OpContext,
                ranks: Ranks) -> None:
        fi = inp.view(-1)
        fo = out.view(-1) if out is not None else None
        me, a = self.rank, self.arena
        N = fi.numel()
        if self._alone(ctx, ranks):
            if fo is not None:
                fo.copy_(fi)
            return
        dt = fi.dtype
        nbytes = N * fi.element_size()
        if nbytes <= self._small_max:
            self._small_gather(fi, fo, nbytes, ctx)
            self._done(ctx)
            return
        fp = ctx.fingerprint()
        for k, (off, c) in enumerate(chunks(N, self._cap(dt))):
            s = self.step + 1
            b = s & 1
            a.slot(me, b, dt)[:c].copy_(fi[off:off + c])
            self.sync_round(s, fp, k, ctx)
            if k == 0 and self.inplace.peers_inplace(b):
                return self._gather(inp, out, root, ctx, ranks)    # [Note: in-place collectives]
            if fo is not None:
                for r in self._ranks:
                    src = fi[off:off + c] if r == me else a.slot(r, b, dt)[:c]
                    dst = fo[r * N + off:r * N + off + c]
                    if dst.data_ptr() != src.data_ptr():     # the input may be its own block of out
                        dst.copy_(src)
        self._done(ctx)

    def _small_gather(self, fi: torch.Tensor, fo: torch.Tensor | None, nbytes: int,
                      ctx: OpContext) -> None:
        s = self.step + 1
        b = s & 1
        src = fi.data_ptr()
        inv = self._users.get((src, _BYTE, nbytes)) or self._user(src, _BYTE, nbytes)
        views = self._fast.get((_BYTE, nbytes, 0)) or self._views(_BYTE, nbytes, 0)
        views[2][b][:] = inv[0]
        self.sync_round(s, ctx.fingerprint(), 0, ctx)
        if fo is not None:
            dst, total = fo.data_ptr(), nbytes * self.world_size
            out = (self._users.get((dst, _BYTE, total)) or self._user(dst, _BYTE, total))[1]
            for r, slot in enumerate(views[b]):
                if r != self.rank:
                    out[r * nbytes:(r + 1) * nbytes] = slot
                elif dst + r * nbytes != src:    # the input may be its own block of the output
                    out[r * nbytes:(r + 1) * nbytes] = inv[1]   # numpy copes with any overlap

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        fo = out.view(-1)
        fi = inp.view(-1) if inp is not None else None
        n, me, a = self.world_size, self.rank, self.arena
        N = fo.numel()
        if self._alone(ctx, ranks):
            if fi is not None:
                fo.copy_(fi)
            return
        fp = ctx.fingerprint()
        dt = fo.dtype
        sub = self._cap(dt) // n
        for k, (off, c) in enumerate(chunks(N, sub)):
            s = self.step + 1
            b = s & 1
            if fi is not None:
                mine = a.slot(me, b, dt)
                for r in self._ranks:
                    mine[r * sub:r * sub + c].copy_(fi[r * N + off:r * N + off + c])
            self.sync_round(s, fp, k, ctx)
            fo[off:off + c].copy_(a.slot(root, b, dt)[me * sub:me * sub + c])
        self._done(ctx)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        n, me, a = self.world_size, self.rank, self.arena
        fi, fo = inp.view(-1), out.view(-1)
        if self._alone(ctx, ranks):
            fo.copy_(fi)
            return
        fp = ctx.fingerprint()
        biggest = self._check_splits(in_splits, out_splits, fp, ctx)
        in_off = [sum(in_splits[:j]) for j in range(n)]
        out_off = [sum(out_splits[:j]) for j in range(n)]
        sub = (a.layout.slot_bytes // n) // 64 * 64
        rounds = max(1, -(-biggest // sub))
        for k in range(rounds):
            s = self.step + 1
            b = s & 1
            mine = a.slot(me, b, torch.uint8)
            for j in self._ranks:
                lo = min(k * sub, in_splits[j])
                c = min(sub, in_splits[j] - lo)
                if c > 0:
                    mine[j * sub:j * sub + c].copy_(fi[in_off[j] + lo:in_off[j] + lo + c])
            self.sync_round(s, fp, k + 1, ctx)
            for r in self._ranks:
                lo = min(k * sub, out_splits[r])
                c = min(sub, out_splits[r] - lo)
                if c > 0:
                    src = a.slot(r, b, torch.uint8)[me * sub:me * sub + c]
                    fo[out_off[r] + lo:out_off[r] + lo + c].copy_(src)
        self._done(ctx)

    def _check_splits(self, in_splits: list[int], out_splits: list[int], fp: tuple[int, int, int],
                      ctx: OpContext) -> int:
        """Round 0 of all_to_all: every rank publishes its split table; all check that rank r
        sends to j exactly what j expects from r, so bytes are never misread.  Returns the
        largest split of any rank (every rank then runs the same number of rounds)."""
        n, a = self.world_size, self.arena
        s = self.step + 1
        table = a.slot(self.rank, s & 1, torch.int64)
        table[:2 * n].copy_(torch.tensor(list(in_splits) + list(out_splits), dtype=torch.int64))
        self.sync_round(s, fp, 0, ctx)
        sends = [a.slot(r, s & 1, torch.int64)[:n].tolist() for r in self._ranks]
        for r in self._ranks:
            expect = a.slot(r, s & 1, torch.int64)[n:2 * n].tolist()
            for j in self._ranks:
                if sends[j][r] != expect[j]:
                    raise ctx.error(CollectiveMismatchError,
                                    f"all_to_all split sizes disagree: rank {j} sends "
                                    f"{sends[j][r]} bytes to rank {r}, which expects {expect[j]}")
        return max(max(row) for row in sends)

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        if self._alone(ctx, ranks):
            return
        self.sync_round(self.step + 1, ctx.fingerprint(), 0, ctx)
        self._done(ctx)

    # -- point to point (the pair mailboxes) -----------------------------------------
    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        self.mail.send(buf, dst, tag, ctx)

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        return self.mail.recv(buf, src, tag, ctx)

    def pending_source(self) -> int | None:
        return self.mail.pending_source()

    # -- lifecycle -------------------------------------------------------------------
    def share_cpus(self, busy_ranks: int) -> None:
        self.arena.share_cpus(busy_ranks)

    def wait_stats(self) -> tuple[float, dict[int, float]]:
        return self.arena.wait_total(), dict(self.arena.late_s)

    def abort(self, reason: str) -> None:
        self.arena.abort(reason)

    def mark_departed(self) -> None:
        self.q[self.arena.ctrl(self.rank, C_DEPARTED)] = 1
        self.arena.ring()        # sleepers waiting for this rank learn it at once

    def peer_id(self, rank: int) -> int:
        return self.q[self.arena.ctrl(rank, C_PID)]
