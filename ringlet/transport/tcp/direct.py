"""Direct-family algorithms of the ``tcp`` transport: each rank talks to every rank it needs.

- :func:`fold_from`: receive every peer's contribution to a tensor, chunk by chunk, and fold each
  chunk in rank order as soon as all its pieces are there (direct all-reduce, reduce-scatter and
  reduce are this plus the matching sends);
- :func:`exchange`: send one tensor to every peer and receive theirs (direct all-gather);
- :func:`rooted`: broadcast, scatter and gather;
- :func:`all_to_all`, :func:`barrier`.

Every function queues frames on the :class:`~ringlet.transport.tcp.pump.Pump` (it does not run
it); ``R`` is the ordered list of group ranks taking part and ``m`` this rank's index in it.  A
pair of ranks always exchanges at least one frame (:func:`~ringlet.transport.base.chunks` gives
one empty piece for an empty range), so that their streams stay in step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ringlet.errors import CollectiveMismatchError
from ringlet.transport.base import OpContext, chunks
from ringlet.transport.reduce import Reduction
from ringlet.transport.tcp.pump import Pump

__all__ = ["all_to_all", "barrier", "exchange", "fold_from", "rooted", "send_blocks", "send_pieces"]

_EMPTY = torch.empty(0, dtype=torch.uint8)


def fold_from(pump: Pump, out: torch.Tensor, own: torch.Tensor, R: list[int], m: int,
              red: Reduction, groups: Sequence[Sequence[int]] | None, cap: int,
              final: Callable[[int, int], None] | None = None) -> None:
    """Queue receives of every peer's contribution to ``out`` in pieces of ``cap`` elements and
    fold each piece -- ``own`` as this rank's contribution -- once all of it arrived (``groups``:
    host-major order, [Note: tcp reduction order]); ``final(offset, count)`` follows each piece."""
    n, numel = len(R), out.numel()
    peers = [i for i in range(n) if i != m]
    got = pump.scratch(len(peers) * numel, out.dtype).view(len(peers), numel)
    row = {i: k for k, i in enumerate(peers)}
    for co, cc in chunks(numel, cap):
        left = [len(peers)]

        def fold(co: int = co, cc: int = cc, left: list[int] = left) -> None:
            left[0] -= 1
            if left[0]:
                return
            parts = [own[co:co + cc] if i == m else got[row[i], co:co + cc] for i in range(n)]
            red.fold_(out[co:co + cc], parts, groups)
            if final is not None:
                final(co, cc)
        for k, i in enumerate(peers):
            pump.recv(R[i], got[k, co:co + cc], fold)


def send_pieces(pump: Pump, t: torch.Tensor, peer: int) -> None:
    """Send ``t`` to ``peer`` in pieces of ``pump.cap`` elements (as :func:`fold_from` expects)."""
    cap = pump.cap(t.dtype)
    for co, cc in chunks(t.numel(), cap):
        pump.send(peer, t[co:co + cc])


def send_blocks(pump: Pump, src: torch.Tensor, blocks: list[tuple[int, int]], R: list[int],
                m: int) -> None:
    """Send block ``i`` of ``src`` to ``R[i]`` for every peer (:func:`send_pieces`)."""
    for i, (o, c) in enumerate(blocks):
        if i != m:
            send_pieces(pump, src[o:o + c], R[i])


def exchange(pump: Pump, mine: torch.Tensor, out: torch.Tensor | None, R: list[int],
             m: int) -> None:
    """Send ``mine`` to every peer; with ``out`` (blocks of ``mine.numel()``), receive peer
    ``i``'s into block ``i``."""
    N = mine.numel()
    for i in range(len(R)):
        if i != m:
            pump.send(R[i], mine)
            if out is not None:
                pump.recv(R[i], out[i * N:(i + 1) * N])


def rooted(pump: Pump, root: int, R: list[int], m: int, peer_side: torch.Tensor,
           root_side: torch.Tensor | None, inbound: bool, whole: bool = False) -> None:
    """One root and its peers.  ``inbound`` (gather): every peer sends ``peer_side`` and the root
    receives peer ``i``'s into block ``i`` of ``root_side``.  Otherwise (scatter, broadcast): the
    root sends block ``i`` of ``root_side`` to peer ``i`` (all of it with ``whole``) and every peer
    receives into ``peer_side``."""
    if m != root:
        (pump.send if inbound else pump.recv)(R[root], peer_side)
        return
    if root_side is None:
        raise AssertionError("the root needs its tensor")
    N = peer_side.numel()
    move = pump.recv if inbound else pump.send
    for i in range(len(R)):
        if i != m:
            move(R[i], root_side if whole else root_side[i * N:(i + 1) * N])


def all_to_all(pump: Pump, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
               out_splits: list[int], R: list[int], m: int, ctx: OpContext) -> None:
    """Byte-level; a frame's size is checked against the receiver's split before it is read."""
    n = len(R)
    in_off = [sum(in_splits[:j]) for j in range(n)]
    out_off = [sum(out_splits[:j]) for j in range(n)]
    if in_splits[m] != out_splits[m]:
        raise ctx.error(CollectiveMismatchError, f"all_to_all split sizes disagree: rank {R[m]} "
                        f"sends {in_splits[m]} bytes to itself but expects {out_splits[m]}")
    out[out_off[m]:out_off[m] + out_splits[m]].copy_(inp[in_off[m]:in_off[m] + in_splits[m]])
    for j in range(n):
        if j != m:
            pump.send(R[j], inp[in_off[j]:in_off[j] + in_splits[j]])
            pump.recv(R[j], out[out_off[j]:out_off[j] + out_splits[j]])


def barrier(pump: Pump, R: list[int], m: int) -> None:
    """An empty frame to and from every peer."""
    for i in range(len(R)):
        if i != m:
            pump.send(R[i], _EMPTY)
            pump.recv(R[i], _EMPTY)
