"""Reducing collectives of the ``tcp`` transport (all-reduce, reduce-scatter, reduce), over any
ordered subset of the group's ranks; the data-movement ones are in ``_tcp_moves``.

Every function takes ``ranks`` (group ranks taking part, in order; the hierarchical
transport runs them over the ranks of one local rank on every host) and queues
frames on the :class:`~ringlet.transport._tcp_pump.Pump`.

[Note: tcp reduction order]
Results must be bit-identical to the ``shm`` transport's, which folds contributions
in rank order: ``((x0 op x1) op x2) op ...``.  A group that spans hosts folds in
*host-major* order instead: each host's contributions in rank order, then those
partial results in host order (hosts ordered by their lowest rank), e.g.
``(x0 op x1) op (x2 op x3)`` for hosts {0, 1} and {2, 3}.  On one host the two are the
same; across hosts it is what the hierarchical ``auto`` transport computes with every
host working at once (its results are bit-identical to this flat path; see
[Note: hierarchical reduction order]).  So:

- small tensors: *direct* exchange -- every rank sends its tensor to every peer and
  folds all of them in that order (one round trip; no recursive doubling, whose tree would
  differ);
- large tensors: reduce-scatter, then a ring all-gather pipelined in chunks of
  ``RINGLET_TCP_CHUNK_BYTES``.  The reduce-scatter is a *ring* (each rank adds its
  contribution to the partial sum it forwards, chunk by chunk) when the result cannot
  depend on the order: two ranks (one commutative operation), integer and bool dtypes,
  bitwise ops.  Otherwise -- floating-point sums, products, min/max, averages over three
  or more ranks -- it is *direct*: block ``j`` of every rank goes straight to rank ``j``,
  which folds the contributions in that order as each chunk completes.  Both move
  ``(n-1)/n`` of the tensor per rank; the direct one opens ``n-1`` streams at once
  instead of two, which a switched network carries as well as a ring.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringlet.transport._tcp_moves import Forwarder, Movement, chunks, mv, pieces
from ringlet.transport._tcp_pump import Pump
from ringlet.transport.base import OpContext
from ringlet.transport.reduce import RedOpType, combine_, finish_, prepare_contribution

__all__ = ["SMALL_ALL_REDUCE", "TcpAlgos", "mv", "order_free", "split_blocks"]

SMALL_ALL_REDUCE = 64 * 1024      # bytes: direct all-reduce at or below this
# Receive buffers for partial sums are kept between operations up to this size: a fresh 8 MiB
# tensor costs ~2000 page faults on first touch, a measurable share of a 16 MiB all_reduce.
SCRATCH_CAP = 64 << 20
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


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


class TcpAlgos(Movement):
    """Collective algorithms on one pump; ``chunk`` is the pipelining unit in bytes.

    ``host_keys`` (one per group rank; None: one host) decides the fold order across hosts.
    """

    def __init__(self, pump: Pump, rank: int, world_size: int, chunk: int,
                 host_keys: list[str] | None = None) -> None:
        super().__init__(pump, rank, world_size, chunk)
        self.host_keys = host_keys if host_keys and len(set(host_keys)) > 1 else None
        self._bufs: dict[torch.dtype, torch.Tensor] = {}

    def _scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused receive buffer (one per dtype; operations on one transport never overlap)."""
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            if numel * dtype.itemsize > SCRATCH_CAP:
                return torch.empty(numel, dtype=dtype)
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def host_groups(self, R: list[int]) -> list[list[int]] | None:
        """Indices into ``R`` grouped by host, hosts in order of first appearance; None when the
        plain left fold is the same (one host, or one rank per host)."""
        if self.host_keys is None:
            return None
        groups: dict[str, list[int]] = {}
        for i, r in enumerate(R):
            groups.setdefault(self.host_keys[r], []).append(i)
        if len(groups) == 1 or len(groups) == len(R):
            return None
        return list(groups.values())

    def fold(self, out: torch.Tensor, parts: list[torch.Tensor], op: RedOpType, R: list[int]) -> None:
        """``out`` = the contributions ``parts`` (indexed like ``R``) folded in the transport's
        order ([Note: tcp reduction order]); ``out`` may alias ``parts[0]``."""
        groups = self.host_groups(R)
        if groups is None:
            combine_(out, parts, op)
            return
        partials = []
        for g in groups:           # read every part before out (which may alias one) is written
            acc = torch.empty_like(out)
            combine_(acc, [parts[i] for i in g], op)
            partials.append(acc)
        combine_(out, partials, op)

    def _start(self, flat: torch.Tensor, op: RedOpType, factor: float | None, ctx: OpContext,
               ranks: list[int] | None) -> tuple[list[int], int, torch.Tensor | None]:
        """(ranks, this rank's index, its contribution) for an in-place reduction; alone, the result
        is written at once and the contribution is None; otherwise the pump has begun ``ctx``."""
        R = ranks or self.all
        src = _contribution(flat, op, factor)
        if len(R) == 1:
            if src is not flat:
                flat.copy_(src)
            return R, 0, None
        self.pump.begin(ctx)
        return R, R.index(self.rank), src

    def all_reduce(self, flat: torch.Tensor, op: RedOpType, factor: float | None, ctx: OpContext,
                   ranks: list[int] | None = None) -> None:
        """Reduce the 1-d contiguous ``flat`` over ``ranks`` in place."""
        R, m, src = self._start(flat, op, factor, ctx, ranks)
        if src is None:
            return
        n = len(R)
        if flat.numel() * flat.element_size() <= SMALL_ALL_REDUCE or flat.numel() < n:
            # The fold writes ``flat`` while a frame of it may still be queued (a point-to-point
            # frame holding the connection, a full socket buffer): send a copy (<= 64 KiB).
            outgoing = self._mv(src.clone() if src.data_ptr() == flat.data_ptr() else src)
            self._fold_from(flat, src, [i for i in range(n) if i != m], R, m, op, ctx,
                            send=lambda i: outgoing)
            self.pump.run()
            return
        # Reduce-scatter and ring all-gather in one pass: each chunk of this rank's block goes
        # round the ring as soon as its reduction is final, while other chunks are still folding.
        blocks = split_blocks(flat.numel(), n)
        off, cnt = blocks[m]
        fwd = Forwarder(self.pump, R[(m + 1) % n], len(chunks(cnt, self._cap(flat.dtype))))

        def final(co: int, cc: int) -> None:
            if cc:
                fwd.own(self._mv(flat[off + co:off + co + cc]))
        self._reduce_scatter(src, flat[off:off + cnt], blocks, op, R, m, ctx, final)
        self._ring_all_gather(flat, blocks, R, m, fwd)
        self.pump.run()

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
        self.pump.run()

    def reduce(self, flat: torch.Tensor, op: RedOpType, factor: float | None, root: int,
               ctx: OpContext, ranks: list[int] | None = None) -> None:
        """Direct reduce into ``ranks[root]``'s ``flat``; the others' ``flat`` is left unchanged."""
        R, m, src = self._start(flat, op, factor, ctx, ranks)
        if src is None:
            return
        n = len(R)
        if m == root:
            self._fold_from(flat, src, [i for i in range(n) if i != m], R, m, op, ctx)
        else:
            for co, cc in pieces(src.numel(), self._cap(src.dtype)):
                self.pump.send(R[root], self._mv(src[co:co + cc]))
        self.pump.run()

    def _reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, blocks: list[tuple[int, int]],
                        op: RedOpType, R: list[int], m: int, ctx: OpContext,
                        final: Callable[[int, int], None] | None = None) -> None:
        """Queue (not run) a reduce-scatter; ``final(offset, count)`` is called as each chunk of
        ``out`` holds its final value, in order."""
        n = len(R)
        if order_free(op, src.dtype, n):
            self._ring_reduce_scatter(src, out, blocks, op, R, m, final)
        else:
            off, cnt = blocks[m]
            peers = [i for i in range(n) if i != m]
            for i in peers:
                o, c = blocks[i]
                for co, cc in pieces(c, self._cap(src.dtype)):
                    self.pump.send(R[i], self._mv(src[o + co:o + co + cc]))
            self._fold_from(out, src[off:off + cnt], peers, R, m, op, ctx, final=final)

    def _fold_from(self, out: torch.Tensor, own: torch.Tensor, peers: list[int], R: list[int], m: int,
                   op: RedOpType, ctx: OpContext, send: Callable[[int], memoryview] | None = None,
                   final: Callable[[int, int], None] | None = None) -> None:
        """Queue receives of every peer's contribution to ``out``, chunk by chunk, and fold each
        chunk in rank order as soon as all its pieces arrived (``send``: also send to each peer)."""
        n = len(R)
        cap = out.numel() if send is not None else self._cap(out.dtype)
        got = self._scratch(len(peers) * out.numel(), out.dtype).view(len(peers), out.numel())
        row = {i: k for k, i in enumerate(peers)}
        if send is not None:
            for i in peers:
                self.pump.send(R[i], send(i))
        in_place = n == 2 and op != RedOpType.PREMUL_SUM and own.data_ptr() == out.data_ptr()
        for co, cc in pieces(out.numel(), cap):
            left = [len(peers)]

            def fold(co: int = co, cc: int = cc, left: list[int] = left) -> None:
                left[0] -= 1
                if left[0]:
                    return
                dst = out[co:co + cc]
                parts = [own[co:co + cc] if i == m else got[row[i], co:co + cc] for i in range(n)]
                if in_place:       # as shm does with two ranks: own op other, bit-identical (commutative)
                    combine_(dst, [dst, parts[1 - m]], op)
                else:
                    if m >= 2 and own.data_ptr() == out.data_ptr():
                        parts[m] = parts[m].clone()     # folding into out would overwrite it first
                    self.fold(dst, parts, op, R)
                finish_(dst, op, n)
                if final is not None:
                    final(co, cc)
            for k, i in enumerate(peers):
                self.pump.recv(R[i], self._mv(got[k, co:co + cc]), fold)

    def _ring_reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, blocks: list[tuple[int, int]],
                             op: RedOpType, R: list[int], m: int,
                             final: Callable[[int, int], None] | None = None) -> None:
        """Step s: receive the partial of block (m-s-2) from the left, add ours, pass it right."""
        n, cap, pump = len(R), self._cap(src.dtype), self.pump
        left, right = R[(m - 1) % n], R[(m + 1) % n]
        o, c = blocks[(m - 1) % n]
        for co, cc in chunks(c, cap):
            pump.send(right, self._mv(src[o + co:o + co + cc]))
        tmp = self._scratch(sum(blocks[(m - s - 2) % n][1] for s in range(n - 1)), src.dtype)
        base = 0
        for s in range(n - 1):
            k = (m - s - 2) % n
            o, c = blocks[k]
            last = s == n - 2
            for co, cc in chunks(c, cap):
                part, own = tmp[base + co:base + co + cc], src[o + co:o + co + cc]

                def step(part: torch.Tensor = part, own: torch.Tensor = own, last: bool = last,
                         co: int = co, cc: int = cc) -> None:
                    if last:
                        dst = out[co:co + cc]
                        combine_(dst, [part, own], op)
                        finish_(dst, op, n)
                        if final is not None:
                            final(co, cc)
                    else:
                        combine_(part, [part, own], op)
                        pump.send(right, self._mv(part))
                pump.recv(left, self._mv(part), step)
            base += c

    # -- data movement ---------------------------------------------------------------------
def _contribution(t: torch.Tensor, op: RedOpType, factor: float | None) -> torch.Tensor:
    """This rank's contribution: ``t`` itself, or for PREMUL_SUM a scaled copy (as shm scales it)."""
    if op != RedOpType.PREMUL_SUM:
        return t
    out = torch.empty_like(t)
    prepare_contribution(t, out, op, factor)
    return out
