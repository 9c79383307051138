"""Collectives on arena buffers: peers read each other's buffers in place, results land in place.

[Note: in-place collectives]
When a tensor handed to ``all_reduce``, ``all_gather`` or ``reduce_scatter`` lives in this rank's
region of the buffer heap ([Note: arena buffers]) and the message is larger
than ``INPLACE_MIN_BYTES``,
nothing is copied into the arena's slots.  The first round (``s0``) publishes, beside the usual
fingerprint, a *descriptor* in the slot header's word ``DESC``: the buffer's offset in the heap,
plus one (0 means "an ordinary tensor").  After it every rank knows where every peer's data is.

- ``all_reduce`` (reduce-scatter + all-gather, in place, in two rounds): the tensor is cut into
  chunks of ``INPLACE_CHUNK_BYTES`` per rank and each chunk into one block per rank.  Rank ``r``
  folds block ``r`` of every rank's buffer, in rank order, into its own buffer (the fold writes a
  part only once it has read it: see :func:`fold_into`) and then writes the result into block
  ``r`` of every peer's buffer while it is still in cache.  Block ``r`` of any buffer is read and
  written by rank ``r`` alone, so no round is needed between the fold and the writes; the
  completion round then says that every block everywhere is final.  Per rank and byte of the
  tensor this reads ``2 - 1/n`` and writes 1, against 3 and 2 for the path through the slots, and
  takes two flag rounds.  (Pulling the peers' results instead needs a third round between fold
  and copy; measured at 1 MiB, 2 ranks: 130 us pulled, 55 us pushed.)  The fold order is the
  ordinary path's, so the bits are the same.
- ``all_gather``: when every rank's output is a buffer, each rank writes its input into block
  ``rank`` of every output (local, hot source; measured at 4 MiB, 2 ranks: 373 us, against 585 us
  for copying from the peers and 527 us through the slots).  Otherwise each rank copies every
  peer's contribution -- its input if that is a buffer, else block ``rank`` of its output
  buffer, where the input was copied first -- into its own output.
- ``reduce_scatter``: every rank folds block ``rank`` of every peer's input buffer into its
  output, in rank order.

Every in-place collective ends with a *completion round*: a rank returns only when no peer can
still be reading its buffers, so a caller may reuse or free them at once.  A descriptor word is
cleared once every peer has passed the round after it.

Mixed calls.  The ranks decide independently whether their own tensor is a buffer, so some may
pass buffers and others ordinary tensors (or, for all_reduce, publish the descriptor ``PEER_READ``
of [Note: peer-read all-reduce], which the rules below treat like a buffer's).  The ordinary
algorithms check the peers' descriptor words after their first round
(:meth:`InplaceCollectives.peers_inplace`); if any rank passed a buffer, or an in-place rank
sees a peer without one, every rank restarts the operation on the ordinary path from the next
round (whatever was copied into a slot in round ``s0`` is simply
written again).  A rank that errors or is interrupted in the middle of an in-place collective
aborts the group, so that no peer goes on reading a buffer that its owner may be reusing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

import torch

from ringlet.transport.arena_buffers import BufferHeap
from ringlet.transport.arena_cma import (
    PEER_ADDR,
    PEER_READ,
    PEER_READ_MAX_BYTES,
    PeerReader,
    peer_read_all_reduce,
)
from ringlet.transport.base import OpContext, chunks
from ringlet.transport.reduce import Reduction

if TYPE_CHECKING:
    from ringlet.transport.arena import Arena

__all__ = ["DESC", "INPLACE_CHUNK_BYTES", "INPLACE_MIN_BYTES", "InplaceCollectives", "Rounds",
           "fold_into"]

DESC = 5                          # the slot-header word (int64) carrying the descriptor
# at or below the slot path is as fast (measured: 22 vs 26 us at 64 KiB)
INPLACE_MIN_BYTES = 64 * 1024
INPLACE_CHUNK_BYTES = 1 << 20     # per rank and fold of all_reduce (cache blocking only, no round)
_LINE = 64                        # blocks start on cache lines where the dtype allows
_PLAN_CACHE_MAX = 64


def fold_into(red: Reduction, out: torch.Tensor, parts: list[torch.Tensor], own: int,
              scratch: torch.Tensor) -> None:
    """``out`` = ``parts`` folded left to right, then post-scaled: the bits of ``red.fold_``.

    ``out`` may *be* ``parts[own]`` (``own`` = -1: it is none of them).  A fold writes its output
    at every step, so parts after the second that are the output are read first: steps before
    ``own`` accumulate in ``scratch`` (a slot of the arena, cut into pieces of its size), the step
    that reads ``parts[own]`` writes ``out``, and the rest fold in ``out`` in place.
    """
    pair = red.pair
    if len(parts) == 1:
        if out.data_ptr() != parts[0].data_ptr():
            out.copy_(parts[0])
    elif own < 2:
        pair(parts[0], parts[1], out=out)
        for k in range(2, len(parts)):
            pair(out, parts[k], out=out)
    else:
        step = max(scratch.numel(), 1)
        for a in range(0, out.numel(), step):
            b = min(a + step, out.numel())
            acc = scratch[:b - a]
            pair(parts[0][a:b], parts[1][a:b], out=acc)
            for k in range(2, own):
                pair(acc, parts[k][a:b], out=acc)
            pair(acc, parts[own][a:b], out=out[a:b])
            for k in range(own + 1, len(parts)):
                pair(out[a:b], parts[k][a:b], out=out[a:b])
    red.finish_(out)


def blocks(lo: int, count: int, n: int, itemsize: int) -> list[tuple[int, int]]:
    """(start, end) of each rank's block of the chunk ``[lo, lo + count)``: equal blocks rounded
    up to whole cache lines, the last ones shorter (or empty)."""
    per_line = max(_LINE // itemsize, 1)
    sub = -(-count // n)
    sub = -(-sub // per_line) * per_line
    end = lo + count
    return [(min(lo + r * sub, end), min(lo + (r + 1) * sub, end)) for r in range(n)]


class Rounds(Protocol):
    """What the in-place algorithms use of the transport that holds them: its round counter
    (the last round completed) and one round ([Note: arena protocol] in ``arena.py``)."""

    step: int

    def sync_round(self, s: int, fp: tuple[int, int, int], chunk: int, ctx: OpContext) -> None:
        """Publish round ``s``, wait for every peer, check their fingerprints."""


class InplaceCollectives:
    """The in-place algorithms of one rank's ``ArenaTransport``, which holds this object as
    ``inplace`` (see the module docstring).  Its state is its own: the buffer heap, the peer
    reader, the descriptor words of the arena's slot headers and the kept plans; of the transport
    it uses only :class:`Rounds`."""

    def __init__(self, arena: Arena, rounds: Rounds) -> None:
        self.arena = arena
        self.rounds = rounds
        self.rank = arena.rank
        self.world_size = n = arena.world_size
        self.q = arena.q
        self._hdr_i = [[arena.layout.slot_hdr_off(r, b) // 8 for b in (0, 1)] for r in range(n)]
        self._ranks = list(range(n))
        self.heap: BufferHeap | None = None
        self.reader: PeerReader | None = None   # [Note: peer-read all-reduce]
        self.peer_read_bytes = 0                # ordinary all_reduce from this size reads peers
        self.mixed = False      # whether peers may publish descriptors: a heap, or peer reads
        self._plans: dict[tuple[int, torch.dtype, tuple[int, ...]], list] | None = None
        self._scratch: dict[torch.dtype, torch.Tensor] | None = None

    def use_heap(self, heap: BufferHeap) -> None:
        """Take ``heap`` (this group's buffer heap): its buffers then run in place."""
        self.heap = heap
        self.mixed = True

    def use_reader(self, reader: PeerReader, nbytes: int) -> None:
        """Read the peers' ordinary tensors of all_reduce from ``nbytes`` up (0: never)."""
        self.reader = reader
        self.peer_read_bytes = nbytes
        self.mixed = True

    def buffer(self, nbytes: int) -> torch.Tensor | None:
        """A buffer of ``nbytes`` from the heap, or None (no heap, or no room)."""
        heap = self.heap
        return None if heap is None else heap.allocate(nbytes)

    def close(self) -> None:
        """Stop allocating and drop the views kept of the heap (its mapping then goes as soon as
        no buffer views it)."""
        self._plans = None
        if self.heap is not None:
            self.heap.close()

    # -- the protocol's pieces ---------------------------------------------------------------------
    def offset(self, t: torch.Tensor, nbytes: int) -> int:
        """``t``'s offset in this rank's heap region, or -1 when the op (whose deciding size,
        the same on every rank, is ``nbytes``) takes the ordinary path whatever ``t`` is."""
        heap = self.heap
        if heap is None or nbytes <= INPLACE_MIN_BYTES or self.world_size == 1:
            return -1
        return heap.offset_of(t)

    def peers_inplace(self, b: int) -> bool:
        """After an ordinary first round in slot ``b``: whether some peer passed a buffer (or
        published ``PEER_READ``); always False when no peer can (see the module note)."""
        if not self.mixed:
            return False
        q = self.q
        for r in self._ranks:
            if q[self._hdr_i[r][b] + DESC]:
                return True
        return False

    def _start(self, fp: tuple[int, int, int], off: int, ctx: OpContext) -> list[int] | None:
        """Round ``s0``: publish this rank's buffer offset; every rank's offset, or None when some
        rank passed an ordinary tensor (then every rank restarts on the ordinary path)."""
        s = self.rounds.step + 1
        b = s & 1
        q = self.q
        q[self._hdr_i[self.rank][b] + DESC] = off + 1
        self.rounds.sync_round(s, fp, 0, ctx)
        descs = [q[self._hdr_i[r][b] + DESC] - 1 for r in self._ranks]
        return None if min(descs) < 0 else descs

    def _complete(self, fp: tuple[int, int, int], k: int, ctx: OpContext) -> None:
        """The completion round: afterwards no peer reads this rank's buffers."""
        self.rounds.sync_round(self.rounds.step + 1, fp, k, ctx)
        self.clear_desc()

    def clear_desc(self) -> None:
        q, h = self.q, self._hdr_i[self.rank]
        q[h[0] + DESC] = 0
        q[h[1] + DESC] = 0

    def _abort_in_place(self, op: str, err: BaseException) -> None:
        """A rank leaving an in-place collective early aborts the group (see the module note)."""
        self.arena.abort(f"rank {self.rank} left an in-place {op} early: "
                         f"{type(err).__name__}: {err}")

    # -- the collectives ---------------------------------------------------------------------------
    def _in_place(self, op: str, off: int, ctx: OpContext,
                  body: Callable[[BufferHeap, list[int]], None]) -> bool:
        """The frame of every in-place collective: the first round (False: a mixed call, see the
        note), ``body(heap, peers' offsets)``, the completion round; leaving early aborts."""
        fp = ctx.fingerprint()
        descs = self._start(fp, off, ctx)
        if descs is None:
            return False
        heap = self.heap
        if heap is None:
            raise AssertionError(f"in-place {op} without a buffer heap")
        self._guarded(op, fp, ctx, lambda: body(heap, descs))
        return True

    def _guarded(self, op: str, fp: tuple[int, int, int], ctx: OpContext,
                 body: Callable[[], None]) -> None:
        """``body``, then the completion round; a rank leaving early aborts the group (peers may
        be reading its tensor: see the module note)."""
        try:
            body()
            self._complete(fp, 1, ctx)
        except BaseException as e:
            self._abort_in_place(op, e)
            raise

    @staticmethod
    def _prescaled(buf: torch.Tensor, red: Reduction) -> torch.Tensor:
        """``buf`` flat, with the reduction's pre-scale (if any) applied in place: the first step
        of both descriptor all-reduces, which a mixed call then continues with
        ``red.completing()``."""
        flat = buf.view(-1)
        if red.pre is not None:
            torch.mul(flat, red.pre, out=flat)
        return flat

    def all_reduce(self, buf: torch.Tensor, red: Reduction, off: int, ctx: OpContext) -> bool:
        """All-reduce a heap buffer in place; False when the peers did not all pass buffers (the
        pre-scale, if any, is then already applied: the caller continues with
        ``red.completing()``)."""
        flat = self._prescaled(buf, red)
        return self._in_place("all_reduce", off, ctx,
                              lambda heap, descs: self._fold_and_push(flat, red, heap, descs))

    def _fold_and_push(self, flat: torch.Tensor, red: Reduction, heap: BufferHeap,
                       descs: list[int]) -> None:
        """Fold this rank's block of every buffer, then write it into every buffer, a chunk at a
        time (the result is still in cache when it is pushed)."""
        plans = self._plans
        if plans is None:
            plans = self._plans = {}
        key = (flat.numel(), flat.dtype, tuple(descs))
        plan = plans.get(key)
        if plan is None:
            if len(plans) >= _PLAN_CACHE_MAX:
                plans.clear()
            plan = plans[key] = self._push_plan(flat, heap, descs)
        scratch = self.arena.slot(self.rank, 0, flat.dtype)
        for mine, parts, targets in plan:
            fold_into(red, mine, parts, self.rank, scratch)
            for t in targets:
                t.copy_(mine)

    def _push_plan(self, flat: torch.Tensor, heap: BufferHeap,
                   descs: list[int]) -> list[tuple[torch.Tensor, list[torch.Tensor],
                                                   list[torch.Tensor]]]:
        """Per chunk: this rank's block, the blocks it folds, the peers' blocks it writes.  Kept
        per (size, offsets): training loops reduce the same buffers every step.  Views of the
        heap's mapping only (this rank's too), so a kept plan never keeps a buffer alive."""
        me, n = self.rank, self.world_size
        N, dt = flat.numel(), flat.dtype
        views = [heap.view(r, descs[r], N, dt) for r in self._ranks]
        plan = []
        for lo, c in chunks(N, max(INPLACE_CHUNK_BYTES // dt.itemsize, 1) * n):
            a, b = blocks(lo, c, n, dt.itemsize)[me]
            if b > a:
                parts = [v[a:b] for v in views]
                plan.append((parts[me], parts, [p for r, p in enumerate(parts) if r != me]))
        return plan

    def peer_reads(self, nbytes: int) -> bool:
        """Whether an ordinary all_reduce of ``nbytes`` tries [Note: peer-read all-reduce]."""
        reader = self.reader
        return (reader is not None and 0 < self.peer_read_bytes <= nbytes <= PEER_READ_MAX_BYTES
                and self.world_size > 1 and reader.usable())

    def peer_read_all_reduce(self, buf: torch.Tensor, red: Reduction, ctx: OpContext) -> bool:
        """All-reduce an ordinary tensor by reading the peers' copies; False when some rank did
        not publish its tensor (the caller goes on with ``red.completing()``, as for a mixed
        in-place call)."""
        reader = self.reader
        if reader is None:
            raise AssertionError("peer reads without a reader")
        flat = self._prescaled(buf, red)
        fp = ctx.fingerprint()
        s = self.rounds.step + 1
        b = s & 1
        q, h = self.q, self._hdr_i[self.rank][b]
        q[h + PEER_ADDR] = flat.data_ptr()
        q[h + DESC] = PEER_READ
        self.rounds.sync_round(s, fp, 0, ctx)
        if any(q[self._hdr_i[r][b] + DESC] != PEER_READ for r in self._ranks):
            return False
        addrs = [q[self._hdr_i[r][b] + PEER_ADDR] for r in self._ranks]
        scratch = self.arena.slot(self.rank, 0, flat.dtype)
        self._guarded("all_reduce", fp, ctx, lambda: peer_read_all_reduce(
            reader, flat, addrs, lambda: self.rounds.sync_round(self.rounds.step + 1, fp, 1, ctx),
            lambda k: self._private(k, flat.dtype),
            lambda out, parts: fold_into(red, out, parts, self.rank, scratch), ctx))
        return True

    def _private(self, k: int, dtype: torch.dtype) -> torch.Tensor:
        """``k`` elements of private scratch (kept per dtype: pages are touched once)."""
        bufs = self._scratch
        if bufs is None:
            bufs = self._scratch = {}
        t = bufs.get(dtype)
        if t is None or t.numel() < k:
            t = bufs[dtype] = torch.empty(k, dtype=dtype)
        return t[:k]

    def gather_offsets(self, inp: torch.Tensor, out: torch.Tensor, nbytes: int
                       ) -> tuple[int, int] | None:
        """Where an all_gather of ``nbytes`` per rank finds its input and output in the heap
        (-1: not a buffer), or None when it takes the ordinary path: neither is a buffer, or the
        input overlaps the output other than as this rank's block of it."""
        if self.heap is None or nbytes <= INPLACE_MIN_BYTES:
            return None
        in_off, out_off = self.offset(inp, nbytes), self.offset(out, nbytes)
        alias = (overlaps(inp, out)
                 and inp.data_ptr() != out.view(-1)[self.rank * inp.numel():].data_ptr())
        return None if (in_off < 0 and out_off < 0) or alias else (in_off, out_off)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, in_off: int, out_off: int,
                   ctx: OpContext) -> bool:
        """All-gather through the heap; False as for all_reduce.  When every rank's output is a
        buffer, each rank writes its input into block ``rank`` of every output (its source is
        local and hot); otherwise each rank copies every peer's contribution -- its input, or
        block ``rank`` of its output buffer -- into its own output."""
        fi, fo = inp.view(-1), out.view(-1)
        me, N, size = self.rank, inp.numel(), inp.element_size()
        mine = fo[me * N:(me + 1) * N]
        if mine.data_ptr() != fi.data_ptr():
            mine.copy_(fi)
        # The descriptor word: where the contribution is, and (low bit) whether it is block `me`
        # of an output buffer, i.e. whether peers may write this rank's output.
        word = 2 * (out_off + me * N * size) + 1 if out_off >= 0 else 2 * in_off

        def gather(heap: BufferHeap, descs: list[int]) -> None:
            push = all(d & 1 for d in descs)
            for r in self._ranks:
                if r == me:
                    continue
                if push:          # peer r's output block `me`: its block r is at descs[r] >> 1
                    off = (descs[r] >> 1) + (me - r) * N * size
                    heap.view(r, off, N, fi.dtype).copy_(fi)
                else:
                    fo[r * N:(r + 1) * N].copy_(heap.view(r, descs[r] >> 1, N, fi.dtype))
        return self._in_place("all_gather", word, ctx, gather)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, red: Reduction, in_off: int,
                       ctx: OpContext) -> bool:
        """Fold block ``rank`` of every peer's input buffer into ``out``;
        False as for all_reduce."""
        fi, fo = inp.view(-1), out.view(-1)
        me, N, whole = self.rank, fo.numel(), fi.numel()
        own = me if fo.data_ptr() == fi[me * N:].data_ptr() else -1

        def fold(heap: BufferHeap, descs: list[int]) -> None:
            views = [fi if r == me else heap.view(r, descs[r], whole, fi.dtype)
                     for r in self._ranks]
            scratch = self.arena.slot(me, 0, fo.dtype)
            piece = max(INPLACE_CHUNK_BYTES // fo.element_size(), 1)
            for lo, c in chunks(N, piece):     # pieces: a fold of n parts stays in cache
                fold_into(red, fo[lo:lo + c], [v[me * N + lo:me * N + lo + c] for v in views],
                          own, scratch)
        return self._in_place("reduce_scatter", in_off, ctx, fold)


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the bytes of two contiguous tensors overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
