"""Collective algorithms of the ``tcp`` transport, over any ordered subset of the group's ranks.

Every function takes ``ranks`` (group ranks taking part, in order; the hierarchical
transport runs them over the ranks of one local rank on every host) and queues
frames on the :class:`~ringlet.transport._tcp_pump.Pump`.

[Note: tcp reduction order]
Results must be bit-identical to the ``shm`` transport's, which folds contributions
in rank order: ``((x0 op x1) op x2) op ...``.  So:

- small tensors: *direct* exchange -- every rank sends its tensor to every peer and
  folds all of them in rank order (one round trip; no tree, whose order would differ);
- large tensors: reduce-scatter, then a ring all-gather pipelined in chunks of
  ``RINGLET_TCP_CHUNK_BYTES``.  The reduce-scatter is a *ring* (each rank adds its
  contribution to the partial sum it forwards, chunk by chunk) when the result cannot
  depend on the order: two ranks (one commutative operation), integer and bool dtypes,
  bitwise ops.  Otherwise -- floating-point sums, products, min/max, averages over three
  or more ranks -- it is *direct*: block ``j`` of every rank goes straight to rank ``j``,
  which folds the contributions in rank order as each chunk completes.  Both move
  ``(n-1)/n`` of the tensor per rank; the direct one opens ``n-1`` streams at once
  instead of two, which a switched network carries as well as a ring.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ringlet.errors import CollectiveMismatchError
from ringlet.transport._tcp_pump import Pump
from ringlet.transport.base import OpContext
from ringlet.transport.reduce import RedOpType, combine_, finish_, prepare_contribution

__all__ = ["TcpAlgos", "mv", "order_free", "split_blocks"]

SMALL_ALL_REDUCE = 64 * 1024      # bytes: direct all-reduce / all-gather at or below this
SMALL_BROADCAST = 256 * 1024      # bytes: root sends to every peer at or below this, else a chain
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def mv(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def order_free(op: RedOpType, dtype: torch.dtype, n: int) -> bool:
    """Whether any fold order gives the same bits (see [Note: tcp reduction order])."""
    if n <= 2 or op in _BITWISE:
        return True
    return not (dtype.is_floating_point or dtype.is_complex)


def split_blocks(numel: int, n: int) -> list[tuple[int, int]]:
    """(offset, count) of ``n`` nearly equal blocks covering ``numel`` elements."""
    q, rem = divmod(numel, n)
    out, off = [], 0
    for i in range(n):
        c = q + (1 if i < rem else 0)
        out.append((off, c))
        off += c
    return out


def _chunks(count: int, cap: int) -> list[tuple[int, int]]:
    return [(o, min(cap, count - o)) for o in range(0, count, cap)]


def _pieces(count: int, cap: int) -> list[tuple[int, int]]:
    """Like ``_chunks`` but one empty piece for an empty range: point-to-point pairs of the
    direct algorithms always exchange at least one frame, so that the streams stay in step."""
    return _chunks(count, max(1, cap)) or [(0, 0)]


class TcpAlgos:
    """Collective algorithms on one pump; ``chunk`` is the pipelining unit in bytes."""

    def __init__(self, pump: Pump, rank: int, world_size: int, chunk: int) -> None:
        self.pump = pump
        self.rank = rank
        self.all = list(range(world_size))
        self.chunk = chunk

    def _cap(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk // dtype.itemsize)

    # -- reductions ------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, op: RedOpType, factor: float | None, ctx: OpContext,
                   ranks: list[int] | None = None) -> None:
        """Reduce the 1-d contiguous ``flat`` over ``ranks`` in place."""
        R = ranks or self.all
        n, m = len(R), R.index(self.rank)
        src = _contribution(flat, op, factor)
        if n == 1:
            if src is not flat:
                flat.copy_(src)
            return
        self.pump.begin(ctx)
        if flat.numel() * flat.element_size() <= SMALL_ALL_REDUCE or flat.numel() < n:
            self._fold_from(flat, src, [i for i in range(n) if i != m], R, m, op, ctx,
                            send=lambda i: mv(src))
            self.pump.run()
            return
        blocks = split_blocks(flat.numel(), n)
        off, cnt = blocks[m]
        self._reduce_scatter(src, flat[off:off + cnt], blocks, op, R, m, ctx)
        self._ring_all_gather(flat, blocks, R, m)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: RedOpType, factor: float | None,
                       ctx: OpContext, ranks: list[int] | None = None) -> None:
        """Block ``i`` of every rank's ``inp`` is reduced into rank ``ranks[i]``'s ``out``."""
        R = ranks or self.all
        n, m = len(R), R.index(self.rank)
        src = _contribution(inp, op, factor)
        if n == 1:
            out.copy_(src)
            return
        N = out.numel()
        self.pump.begin(ctx)
        self._reduce_scatter(src, out, [(i * N, N) for i in range(n)], op, R, m, ctx)

    def reduce(self, flat: torch.Tensor, op: RedOpType, factor: float | None, root: int,
               ctx: OpContext, ranks: list[int] | None = None) -> None:
        """Direct reduce into ``ranks[root]``'s ``flat``; the others' ``flat`` is left unchanged."""
        R = ranks or self.all
        n, m = len(R), R.index(self.rank)
        src = _contribution(flat, op, factor)
        if n == 1:
            if src is not flat:
                flat.copy_(src)
            return
        self.pump.begin(ctx)
        if m == root:
            self._fold_from(flat, src, [i for i in range(n) if i != m], R, m, op, ctx)
        else:
            for co, cc in _pieces(src.numel(), self._cap(src.dtype)):
                self.pump.send(R[root], mv(src[co:co + cc]))
        self.pump.run()

    def _reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, blocks: list[tuple[int, int]],
                        op: RedOpType, R: list[int], m: int, ctx: OpContext) -> None:
        n = len(R)
        if order_free(op, src.dtype, n):
            self._ring_reduce_scatter(src, out, blocks, op, R, m)
        else:
            off, cnt = blocks[m]
            peers = [i for i in range(n) if i != m]
            for i in peers:
                o, c = blocks[i]
                for co, cc in _pieces(c, self._cap(src.dtype)):
                    self.pump.send(R[i], mv(src[o + co:o + co + cc]))
            self._fold_from(out, src[off:off + cnt], peers, R, m, op, ctx)
        self.pump.run()

    def _fold_from(self, out: torch.Tensor, own: torch.Tensor, peers: list[int], R: list[int], m: int,
                   op: RedOpType, ctx: OpContext, send: Callable[[int], memoryview] | None = None) -> None:
        """Queue receives of every peer's contribution to ``out``, chunk by chunk, and fold each
        chunk in rank order as soon as all its pieces arrived (``send``: also send to each peer)."""
        n = len(R)
        cap = out.numel() if send is not None else self._cap(out.dtype)
        pieces = torch.empty((len(peers), out.numel()), dtype=out.dtype)
        row = {i: k for k, i in enumerate(peers)}
        if send is not None:
            for i in peers:
                self.pump.send(R[i], send(i))
        in_place = n == 2 and op != RedOpType.PREMUL_SUM and own.data_ptr() == out.data_ptr()
        for co, cc in _pieces(out.numel(), cap):
            left = [len(peers)]

            def fold(co: int = co, cc: int = cc, left: list[int] = left) -> None:
                left[0] -= 1
                if left[0]:
                    return
                dst = out[co:co + cc]
                parts = [own[co:co + cc] if i == m else pieces[row[i], co:co + cc] for i in range(n)]
                if in_place:       # as shm does with two ranks: own op other, bit-identical (commutative)
                    combine_(dst, [dst, parts[1 - m]], op)
                else:
                    if m >= 2 and own.data_ptr() == out.data_ptr():
                        parts[m] = parts[m].clone()     # folding into out would overwrite it first
                    combine_(dst, parts, op)
                finish_(dst, op, n)
            for k, i in enumerate(peers):
                self.pump.recv(R[i], mv(pieces[k, co:co + cc]), fold)

    def _ring_reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, blocks: list[tuple[int, int]],
                             op: RedOpType, R: list[int], m: int) -> None:
        """Step s: receive the partial of block (m-s-2) from the left, add ours, pass it right."""
        n, cap, pump = len(R), self._cap(src.dtype), self.pump
        left, right = R[(m - 1) % n], R[(m + 1) % n]
        o, c = blocks[(m - 1) % n]
        for co, cc in _chunks(c, cap):
            pump.send(right, mv(src[o + co:o + co + cc]))
        tmp = torch.empty(sum(blocks[(m - s - 2) % n][1] for s in range(n - 1)), dtype=src.dtype)
        base = 0
        for s in range(n - 1):
            k = (m - s - 2) % n
            o, c = blocks[k]
            last = s == n - 2
            for co, cc in _chunks(c, cap):
                part, own = tmp[base + co:base + co + cc], src[o + co:o + co + cc]

                def step(part: torch.Tensor = part, own: torch.Tensor = own, last: bool = last,
                         co: int = co, cc: int = cc) -> None:
                    if last:
                        dst = out[co:co + cc]
                        combine_(dst, [part, own], op)
                        finish_(dst, op, n)
                    else:
                        combine_(part, [part, own], op)
                        pump.send(right, mv(part))
                pump.recv(left, mv(part), step)
            base += c

    # -- data movement ---------------------------------------------------------------------
    def _ring_all_gather(self, flat: torch.Tensor, blocks: list[tuple[int, int]], R: list[int], m: int) -> None:
        """Own block is in place; step s forwards block (m-1-s) to the right as its chunks land."""
        n, cap, pump = len(R), self._cap(flat.dtype), self.pump
        left, right = R[(m - 1) % n], R[(m + 1) % n]
        o, c = blocks[m]
        for co, cc in _chunks(c, cap):
            pump.send(right, mv(flat[o + co:o + co + cc]))
        for s in range(n - 1):
            o, c = blocks[(m - 1 - s) % n]
            for co, cc in _chunks(c, cap):
                view = mv(flat[o + co:o + co + cc])
                pump.recv(left, view, (lambda v=view: pump.send(right, v)) if s < n - 2 else None)
        pump.run()

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: list[int] | None = None) -> None:
        """``out`` (len(ranks) blocks of ``inp.numel()``) receives every rank's ``inp`` in order."""
        R = ranks or self.all
        n, m, N = len(R), R.index(self.rank), inp.numel()
        out[m * N:(m + 1) * N].copy_(inp)
        if n == 1:
            return
        self.pump.begin(ctx)
        if out.numel() * out.element_size() > SMALL_ALL_REDUCE and n > 2:
            self._ring_all_gather(out, [(i * N, N) for i in range(n)], R, m)
            return
        mine = mv(inp)
        for i in range(n):
            if i != m:
                self.pump.send(R[i], mine)
                self.pump.recv(R[i], mv(out[i * N:(i + 1) * N]))
        self.pump.run()

    def broadcast(self, flat: torch.Tensor, root: int, ctx: OpContext, ranks: list[int] | None = None) -> None:
        R = ranks or self.all
        n, m, pump = len(R), R.index(self.rank), self.pump
        if n == 1:
            return
        pump.begin(ctx)
        if n == 2 or flat.numel() * flat.element_size() <= SMALL_BROADCAST:
            if m == root:
                whole = mv(flat)
                for i in range(n):
                    if i != m:
                        pump.send(R[i], whole)
            else:
                pump.recv(R[root], mv(flat))
            pump.run()
            return
        # A chain root -> root+1 -> ... -> root-1, forwarding each chunk as it lands.
        pos = (m - root) % n
        prev, nxt = R[(m - 1) % n], R[(m + 1) % n]
        for co, cc in _chunks(flat.numel(), self._cap(flat.dtype)):
            view = mv(flat[co:co + cc])
            if pos == 0:
                pump.send(nxt, view)
            else:
                pump.recv(prev, view, (lambda v=view: pump.send(nxt, v)) if pos < n - 1 else None)
        pump.run()

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: list[int] | None = None) -> None:
        R = ranks or self.all
        n, m, N = len(R), R.index(self.rank), inp.numel()
        if out is not None:
            out[m * N:(m + 1) * N].copy_(inp)
        if n == 1:
            return
        self.pump.begin(ctx)
        if m == root:
            if out is None:
                raise AssertionError("gather: the root needs an output tensor")
            for i in range(n):
                if i != m:
                    self.pump.recv(R[i], mv(out[i * N:(i + 1) * N]))
        else:
            self.pump.send(R[root], mv(inp))
        self.pump.run()

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: list[int] | None = None) -> None:
        R = ranks or self.all
        n, m, N = len(R), R.index(self.rank), out.numel()
        if m == root:
            if inp is None:
                raise AssertionError("scatter: the root needs an input tensor")
            out.copy_(inp[m * N:(m + 1) * N])
        if n == 1:
            return
        self.pump.begin(ctx)
        if m == root and inp is not None:
            for i in range(n):
                if i != m:
                    self.pump.send(R[i], mv(inp[i * N:(i + 1) * N]))
        else:
            self.pump.recv(R[root], mv(out))
        self.pump.run()

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext) -> None:
        """Byte-level; a frame's size is checked against the receiver's split before it is read."""
        n, m = len(self.all), self.rank
        in_off = [sum(in_splits[:j]) for j in range(n)]
        out_off = [sum(out_splits[:j]) for j in range(n)]
        if in_splits[m] != out_splits[m]:
            raise ctx.error(CollectiveMismatchError, f"all_to_all split sizes disagree: rank {m} sends "
                            f"{in_splits[m]} bytes to itself but expects {out_splits[m]}")
        out[out_off[m]:out_off[m] + out_splits[m]].copy_(inp[in_off[m]:in_off[m] + in_splits[m]])
        if n == 1:
            return
        self.pump.begin(ctx)
        for j in range(n):
            if j != m:
                self.pump.send(j, mv(inp[in_off[j]:in_off[j] + in_splits[j]]))
                self.pump.recv(j, mv(out[out_off[j]:out_off[j] + out_splits[j]]))
        self.pump.run()

    def barrier(self, ctx: OpContext, ranks: list[int] | None = None) -> None:
        R = ranks or self.all
        if len(R) == 1:
            return
        self.pump.begin(ctx)
        empty = memoryview(bytearray(0))
        for r in R:
            if r != self.rank:
                self.pump.send(r, empty)
                self.pump.recv(r, memoryview(bytearray(0)))
        self.pump.run()


def _contribution(t: torch.Tensor, op: RedOpType, factor: float | None) -> torch.Tensor:
    """This rank's contribution: ``t`` itself, or for PREMUL_SUM a scaled copy (as shm scales it)."""
    if op != RedOpType.PREMUL_SUM:
        return t
    out = torch.empty_like(t)
    prepare_contribution(t, out, op, factor)
    return out
