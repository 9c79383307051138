"""Data-movement algorithms of the ``tcp`` transport (no arithmetic): ring and direct all-gather,
broadcast (direct or a pipelined chain), gather, scatter, all-to-all and barrier, plus the helpers
that every algorithm shares (byte views of tensors, chunking, keeping ring frames in order).

:class:`Movement` is the base of :class:`~ringlet.transport._tcp_algos.TcpAlgos`; both queue frames
on one :class:`~ringlet.transport._tcp_pump.Pump`.  See [Note: tcp frames] in ``_tcp_wire``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch

from ringlet.errors import CollectiveMismatchError
from ringlet.transport._tcp_pump import Pump
from ringlet.transport.base import OpContext

__all__ = ["SMALL_ALL_GATHER", "SMALL_BROADCAST", "Movement", "chunks", "mv", "pieces"]

SMALL_ALL_GATHER = 64 * 1024      # bytes: direct all-gather at or below this (or with 2 ranks)
SMALL_BROADCAST = 256 * 1024      # bytes: root sends to every peer at or below this, else a chain


def mv(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def chunks(count: int, cap: int) -> list[tuple[int, int]]:
    """(offset, count) pieces of at most ``cap`` items covering ``count`` (none for 0)."""
    return [(o, min(cap, count - o)) for o in range(0, count, cap)]


def pieces(count: int, cap: int) -> list[tuple[int, int]]:
    """Like ``chunks`` but one empty piece for an empty range: point-to-point pairs of the
    direct algorithms always exchange at least one frame, so that the streams stay in step."""
    return chunks(count, max(1, cap)) or [(0, 0)]



class Movement:
    """Data movement over ``pump`` among the group's ranks; ``chunk`` is the pipelining unit."""

    def __init__(self, pump: Pump, rank: int, world_size: int, chunk: int) -> None:
        self.pump = pump
        self.rank = rank
        self.all = list(range(world_size))
        self.chunk = chunk

    def _cap(self, dtype: torch.dtype) -> int:
        return max(1, self.chunk // dtype.itemsize)

    def _mv(self, t: torch.Tensor) -> memoryview:
        """``mv(t)``, with ``t`` kept alive until the operation ends (a queued send may outlive
        every other reference to a scratch tensor)."""
        self.pump.keep.append(t)
        return mv(t)

    # -- reductions ------------------------------------------------------------------------
    def _ring_all_gather(self, flat: torch.Tensor, blocks: list[tuple[int, int]], R: list[int], m: int,
                         fwd: Forwarder | None = None) -> None:
        """Queue a ring all-gather: step s forwards block (m-1-s) to the right as its chunks land.

        Without ``fwd`` this rank's block is in place and queued now; with one, the caller hands
        its chunks to ``fwd.own`` as they become final (fused with a reduce-scatter).
        """
        n, cap, pump = len(R), self._cap(flat.dtype), self.pump
        left, right = R[(m - 1) % n], R[(m + 1) % n]
        if fwd is None:
            o, c = blocks[m]
            fwd = Forwarder(pump, right, 0)
            for co, cc in chunks(c, cap):
                pump.send(right, self._mv(flat[o + co:o + co + cc]))
        for s in range(n - 1):
            o, c = blocks[(m - 1 - s) % n]
            for co, cc in chunks(c, cap):
                view = self._mv(flat[o + co:o + co + cc])
                pump.recv(left, view, fwd.forward(view) if s < n - 2 else None)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: list[int] | None = None) -> None:
        """``out`` (len(ranks) blocks of ``inp.numel()``) receives every rank's ``inp`` in order."""
        R = ranks or self.all
        n, m, N = len(R), R.index(self.rank), inp.numel()
        out[m * N:(m + 1) * N].copy_(inp)
        if n == 1:
            return
        self.pump.begin(ctx)
        if out.numel() * out.element_size() > SMALL_ALL_GATHER and n > 2:
            self._ring_all_gather(out, [(i * N, N) for i in range(n)], R, m)
            self.pump.run()
            return
        mine = self._mv(inp)
        for i in range(n):
            if i != m:
                self.pump.send(R[i], mine)
                self.pump.recv(R[i], self._mv(out[i * N:(i + 1) * N]))
        self.pump.run()

    def broadcast(self, flat: torch.Tensor, root: int, ctx: OpContext, ranks: list[int] | None = None) -> None:
        R = ranks or self.all
        n, m, pump = len(R), R.index(self.rank), self.pump
        if n == 1:
            return
        pump.begin(ctx)
        if n == 2 or flat.numel() * flat.element_size() <= SMALL_BROADCAST:
            if m == root:
                whole = self._mv(flat)
                for i in range(n):
                    if i != m:
                        pump.send(R[i], whole)
            else:
                pump.recv(R[root], self._mv(flat))
            pump.run()
            return
        # A chain root -> root+1 -> ... -> root-1, forwarding each chunk as it lands.
        pos = (m - root) % n
        prev, nxt = R[(m - 1) % n], R[(m + 1) % n]
        for co, cc in chunks(flat.numel(), self._cap(flat.dtype)):
            view = self._mv(flat[co:co + cc])
            if pos == 0:
                pump.send(nxt, view)
            else:
                pump.recv(prev, view, forward_to(pump, nxt, view) if pos < n - 1 else None)
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
                    self.pump.recv(R[i], self._mv(out[i * N:(i + 1) * N]))
        else:
            self.pump.send(R[root], self._mv(inp))
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
                    self.pump.send(R[i], self._mv(inp[i * N:(i + 1) * N]))
        else:
            self.pump.recv(R[root], self._mv(out))
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
                self.pump.send(j, self._mv(inp[in_off[j]:in_off[j] + in_splits[j]]))
                self.pump.recv(j, self._mv(out[out_off[j]:out_off[j] + out_splits[j]]))
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


def forward_to(pump: Pump, peer: int, view: memoryview) -> Callable[[], None]:
    """A receive callback that sends the chunk just received on to ``peer`` (chain)."""
    return lambda: pump.send(peer, view)


class Forwarder:
    """Keeps a ring all-gather's frames to the right neighbour in the order it expects.

    This rank's own chunks (``own``, as a fused reduce-scatter finalises them) must all go out
    before any chunk forwarded from the left: a forwarded chunk that lands early (a direct
    reduce-scatter may still wait on another peer) is held back until then.
    """

    def __init__(self, pump: Pump, right: int, own_chunks: int) -> None:
        self.pump, self.right = pump, right
        self.remaining = own_chunks
        self.held: list[memoryview] = []

    def own(self, view: memoryview) -> None:
        self.pump.send(self.right, view)
        self.remaining -= 1
        if self.remaining == 0:
            for v in self.held:
                self.pump.send(self.right, v)
            self.held.clear()

    def forward(self, view: memoryview) -> Callable[[], None]:
        def cb() -> None:
            if self.remaining > 0:
                self.held.append(view)
            else:
                self.pump.send(self.right, view)
        return cb
