"""Which algorithm each collective of the ``tcp`` transport runs, over any ordered subset of ranks.

The algorithms themselves are grouped by family: ``ring`` (neighbours only: ring reduce-scatter
and all-gather, chain broadcast) and ``direct`` (every rank to every rank it needs).  This module
holds the choice (by size, rank count, operator and dtype), the common prologue of every
collective (who takes part, a group of one, starting the pump) and the fold order.

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

import torch

from ringlet.transport.base import OpContext, Ranks, chunks, split_blocks
from ringlet.transport.reduce import RedOpType, Reduction
from ringlet.transport.tcp import direct, ring
from ringlet.transport.tcp.pump import Pump

__all__ = ["SMALL_ALL_GATHER", "SMALL_ALL_REDUCE", "SMALL_BROADCAST", "Algorithms", "order_free"]

SMALL_ALL_REDUCE = 64 * 1024      # bytes: direct all-reduce at or below this
SMALL_ALL_GATHER = 64 * 1024      # bytes: direct all-gather at or below this (or with 2 ranks)
SMALL_BROADCAST = 256 * 1024      # bytes: root sends to every peer at or below this, else a chain
_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)


def order_free(op: RedOpType, dtype: torch.dtype, n: int) -> bool:
    """Whether any fold order gives the same bits (see [Note: tcp reduction order])."""
    if n <= 2 or op in _BITWISE:
        return True
    return not (dtype.is_floating_point or dtype.is_complex)


class Algorithms:
    """The collectives of one transport, run on its ``pump``; tensors are 1-d and contiguous.

    ``ranks`` (group ranks taking part, in order; default all) may be any subset that contains
    this rank ([Note: rank subsets]).  ``host_keys`` (one per group rank; None: one host) decides
    the fold order across hosts.
    """

    def __init__(self, pump: Pump, rank: int, world_size: int,
                 host_keys: list[str] | None = None) -> None:
        self.pump = pump
        self.rank = rank
        self.all = list(range(world_size))
        self.host_keys = host_keys if host_keys and len(set(host_keys)) > 1 else None

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

    def _start(self, ctx: OpContext, ranks: Ranks) -> tuple[list[int], int]:
        """The prologue of every collective: the ranks taking part and this rank's index; with
        others taking part, the pump has begun ``ctx``."""
        R = list(ranks) if ranks is not None else self.all
        if self.rank not in R:
            raise ValueError(f"{ctx.op}: rank {self.rank} is not among the ranks taking part, {R}")
        if len(R) > 1:
            self.pump.begin(ctx)
        return R, R.index(self.rank)

    # -- reductions ----------------------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, red: Reduction, ctx: OpContext, ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        n, pump = len(R), self.pump
        src = red.contribution(flat)
        if n == 1:
            red.fold_(flat, [src])
            return
        if flat.numel() * flat.element_size() <= SMALL_ALL_REDUCE or flat.numel() < n:
            # The fold writes ``flat`` while a frame of it may still be queued (a point-to-point
            # frame holding the connection, a full socket buffer): send a copy (<= 64 KiB).
            direct.exchange(pump, src.clone() if src is flat else src, None, R, m)
            direct.fold_from(pump, flat, src, R, m, red, self.host_groups(R), flat.numel())
            pump.run()
            return
        # Reduce-scatter and ring all-gather in one pass: each chunk of this rank's block goes
        # round the ring as soon as its reduction is final, while other chunks are still folding.
        blocks = split_blocks(flat.numel(), n)
        off, cnt = blocks[m]
        fwd = ring.Forwarder(pump, R[(m + 1) % n], len(chunks(cnt, pump.cap(flat.dtype))))

        def final(co: int, cc: int) -> None:
            fwd.own(flat[off + co:off + co + cc])
        self._reduce_scatter(src, flat[off:off + cnt], blocks, red, R, m, final)
        ring.all_gather(pump, flat, blocks, R, m, fwd)
        pump.run()

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, red: Reduction, ctx: OpContext,
                       ranks: Ranks) -> None:
        """Block ``i`` of every rank's ``inp`` is reduced into rank ``R[i]``'s ``out``."""
        R, m = self._start(ctx, ranks)
        if len(R) == 1:
            red.contribute(inp, out)
            red.finish_(out)
            return
        N = out.numel()
        blocks = [(i * N, N) for i in range(len(R))]
        self._reduce_scatter(red.contribution(inp), out, blocks, red, R, m)
        self.pump.run()

    def reduce(self, flat: torch.Tensor, red: Reduction, root: int, ctx: OpContext,
               ranks: Ranks) -> None:
        """Direct reduce into ``R[root]``'s ``flat``; the others' ``flat`` is left unchanged."""
        R, m = self._start(ctx, ranks)
        src = red.contribution(flat)
        if len(R) == 1:
            red.fold_(flat, [src])
            return
        if m == root:
            cap = self.pump.cap(flat.dtype)
            direct.fold_from(self.pump, flat, src, R, m, red, self.host_groups(R), cap)
        else:
            direct.send_pieces(self.pump, src, R[root])
        self.pump.run()

    def _reduce_scatter(self, src: torch.Tensor, out: torch.Tensor, blocks: list[tuple[int, int]],
                        red: Reduction, R: list[int], m: int,
                        final: ring.Final | None = None) -> None:
        """Queue (not run) a reduce-scatter; ``final(offset, count)`` is called as each chunk of
        ``out`` holds its final value, in order."""
        if order_free(red.fold, src.dtype, len(R)):
            ring.reduce_scatter(self.pump, src, out, blocks, red, R, m, final)
            return
        off, cnt = blocks[m]
        direct.send_blocks(self.pump, src, blocks, R, m)
        direct.fold_from(self.pump, out, src[off:off + cnt], R, m, red, self.host_groups(R),
                         self.pump.cap(src.dtype), final)

    # -- data movement ---------------------------------------------------------------------------
    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks) -> None:
        """``out`` (one block of ``inp.numel()`` per rank taking part) receives every ``inp``."""
        R, m = self._start(ctx, ranks)
        n, N = len(R), inp.numel()
        out[m * N:(m + 1) * N].copy_(inp)
        if n == 1:
            return
        if out.numel() * out.element_size() > SMALL_ALL_GATHER and n > 2:
            ring.all_gather(self.pump, out, [(i * N, N) for i in range(n)], R, m)
        else:
            direct.exchange(self.pump, inp, out, R, m)
        self.pump.run()

    def broadcast(self, flat: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        n = len(R)
        if n == 1:
            return
        if n == 2 or flat.numel() * flat.element_size() <= SMALL_BROADCAST:
            direct.rooted(self.pump, root, R, m, flat, flat, inbound=False, whole=True)
        else:
            ring.chain_broadcast(self.pump, flat, root, R, m)
        self.pump.run()

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        N = inp.numel()
        if out is not None:
            out[m * N:(m + 1) * N].copy_(inp)
        if len(R) > 1:
            direct.rooted(self.pump, root, R, m, inp, out, inbound=True)
            self.pump.run()

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        N = out.numel()
        if m == root:
            if inp is None:
                raise AssertionError("scatter: the root needs an input tensor")
            out.copy_(inp[m * N:(m + 1) * N])
        if len(R) > 1:
            direct.rooted(self.pump, root, R, m, out, inp, inbound=False)
            self.pump.run()

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        direct.all_to_all(self.pump, inp, in_splits, out, out_splits, R, m, ctx)
        if len(R) > 1:
            self.pump.run()

    def barrier(self, ctx: OpContext, ranks: Ranks) -> None:
        R, m = self._start(ctx, ranks)
        if len(R) > 1:
            direct.barrier(self.pump, R, m)
            self.pump.run()
