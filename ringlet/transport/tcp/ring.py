"""Ring-family algorithms of the ``tcp`` transport: each rank talks to its two neighbours only.

- :func:`reduce_scatter`: step ``s`` receives the partial result of block ``m-s-2`` from the left,
  adds this rank's contribution and passes it right; used when the result cannot depend on the
  fold order ([Note: tcp reduction order]);
- :func:`all_gather`: step ``s`` forwards block ``m-1-s`` to the right as its chunks land
  (:class:`Forwarder` keeps the frames in order when it is fused with a reduce-scatter);
- :func:`chain_broadcast`: root -> root+1 -> ... -> root-1, each chunk forwarded as it lands.

Every function queues frames on the :class:`~ringlet.transport.tcp.pump.Pump` (it does not run
it); ``R`` is the ordered list of group ranks taking part and ``m`` this rank's index in it.
Tensors move in chunks of ``pump.cap`` elements (:func:`~ringlet.transport.base.chunks`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringlet.transport.base import chunks
from ringlet.transport.reduce import Reduction
from ringlet.transport.tcp.pump import Pump

__all__ = ["Forwarder", "all_gather", "chain_broadcast", "reduce_scatter"]

Blocks = list[tuple[int, int]]           # (offset, count) of each rank's block, in R's order
Final = Callable[[int, int], None]       # called as each chunk (offset, count) of out is final


def reduce_scatter(pump: Pump, src: torch.Tensor, out: torch.Tensor, blocks: Blocks, red: Reduction,
                   R: list[int], m: int, final: Final | None = None) -> None:
    """Block ``m`` of the ranks' ``src`` is reduced into ``out``, passed round the ring."""
    n, cap = len(R), pump.cap(src.dtype)
    left, right = R[(m - 1) % n], R[(m + 1) % n]
    o, c = blocks[(m - 1) % n]
    for co, cc in chunks(c, cap):
        pump.send(right, src[o + co:o + co + cc])
    tmp = pump.scratch(sum(blocks[(m - s - 2) % n][1] for s in range(n - 1)), src.dtype)
    base = 0
    for s in range(n - 1):
        o, c = blocks[(m - s - 2) % n]
        last = s == n - 2
        for co, cc in chunks(c, cap):
            part, own = tmp[base + co:base + co + cc], src[o + co:o + co + cc]

            def step(part: torch.Tensor = part, own: torch.Tensor = own, last: bool = last,
                     co: int = co, cc: int = cc) -> None:
                if last:
                    red.fold_(out[co:co + cc], [part, own])
                    if final is not None:
                        final(co, cc)
                else:
                    red.combine_(part, [part, own])
                    pump.send(right, part)
            pump.recv(left, part, step)
        base += c


def all_gather(pump: Pump, flat: torch.Tensor, blocks: Blocks, R: list[int], m: int,
               fwd: Forwarder | None = None) -> None:
    """Every rank's block of ``flat`` reaches every rank.

    Without ``fwd`` this rank's block is in place and queued now; with one, the caller hands
    its chunks to ``fwd.own`` as they become final (fused with a reduce-scatter).
    """
    n, cap = len(R), pump.cap(flat.dtype)
    left, right = R[(m - 1) % n], R[(m + 1) % n]
    if fwd is None:
        o, c = blocks[m]
        fwd = Forwarder(pump, right, 0)
        for co, cc in chunks(c, cap):
            pump.send(right, flat[o + co:o + co + cc])
    for s in range(n - 1):
        o, c = blocks[(m - 1 - s) % n]
        for co, cc in chunks(c, cap):
            piece = flat[o + co:o + co + cc]
            pump.recv(left, piece, fwd.forward(piece) if s < n - 2 else None)


def chain_broadcast(pump: Pump, flat: torch.Tensor, root: int, R: list[int], m: int) -> None:
    """A chain from ``R[root]`` round the ring, forwarding each chunk as it lands."""
    n = len(R)
    pos = (m - root) % n
    prev, nxt = R[(m - 1) % n], R[(m + 1) % n]
    for co, cc in chunks(flat.numel(), pump.cap(flat.dtype)):
        piece = flat[co:co + cc]
        if pos == 0:
            pump.send(nxt, piece)
        else:
            pump.recv(prev, piece, _forward_to(pump, nxt, piece) if pos < n - 1 else None)


def _forward_to(pump: Pump, peer: int, piece: torch.Tensor) -> Callable[[], None]:
    """A receive callback that sends the chunk just received on to ``peer``."""
    return lambda: pump.send(peer, piece)


class Forwarder:
    """Keeps a ring all-gather's frames to the right neighbour in the order it expects.

    This rank's own chunks (``own``, as a fused reduce-scatter finalises them) must all go out
    before any chunk forwarded from the left: a forwarded chunk that lands early (a direct
    reduce-scatter may still wait on another peer) is held back until then.
    """

    def __init__(self, pump: Pump, right: int, own_chunks: int) -> None:
        self.pump, self.right = pump, right
        self.remaining = own_chunks
        self.held: list[torch.Tensor] = []

    def own(self, piece: torch.Tensor) -> None:
        self.pump.send(self.right, piece)
        self.remaining -= 1
        if self.remaining == 0:
            for t in self.held:
                self.pump.send(self.right, t)
            self.held.clear()

    def forward(self, piece: torch.Tensor) -> Callable[[], None]:
        def cb() -> None:
            if self.remaining > 0:
                self.held.append(piece)
            else:
                self.pump.send(self.right, piece)
        return cb
