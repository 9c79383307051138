"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` and ``P2POp``.

Messages between two ranks are delivered in order; a receive must name the
same tag and size as the matching send (ringlet matches in order and reports a
disagreement as an error naming both sides, instead of waiting for a tag that
will never come).  Each (peer, direction) has its own thread, so a large
``isend`` that waits for the peer to drain it never blocks an ``irecv``: a
batch of sends and receives in any order cannot deadlock.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.c10d import checks
from ringlet.c10d.collectives import peer_rank
from ringlet.c10d.work import Work, _Completed
from ringlet.c10d.world import resolve_group
from ringlet.transport.base import OpContext

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _p2p_ctx(pg: Any, op: str, peer: int, t: torch.Tensor) -> OpContext:
    pg.check_usable()
    return OpContext.make(op, 0, pg.rank(), pg.size(), pg.group_desc, pg.timeout, dtype=t.dtype,
                          numel=t.numel(), root=peer)


def isend(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Send ``tensor`` to ``dst`` asynchronously; returns a :class:`Work`."""
    pg = resolve_group(group)
    if pg is None:
        return None
    t = checks.tensor(tensor, "isend", "tensor", pg.transport.devices)
    peer = peer_rank(pg, dst, group_dst, "send", "dst")
    if peer == pg.rank():
        raise ValueError(f"send: dst: expected a rank other than this rank ({pg.ranks[peer]})")
    data = t.contiguous()
    ctx = _p2p_ctx(pg, "send", peer, t)
    tr = pg.transport
    return pg.run_p2p(lambda work: tr.send(data, peer, tag, ctx), peer, "send", ctx, [t])


def irecv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Receive into ``tensor`` from ``src`` (None: any rank) asynchronously; returns a :class:`Work`."""
    pg = resolve_group(group)
    if pg is None:
        return None
    t = checks.tensor(tensor, "irecv", "tensor", pg.transport.devices)
    checks.writable(t, "irecv", "tensor")
    peer: int | None = None
    if src is not None or group_src is not None:
        peer = peer_rank(pg, src, group_src, "recv", "src")
        if peer == pg.rank():
            raise ValueError(f"recv: src: expected a rank other than this rank ({pg.ranks[peer]})")
    ctx = _p2p_ctx(pg, "recv", -1 if peer is None else peer, t)
    st = checks.Staged(t)
    tr = pg.transport

    def fn(work: Work) -> None:
        got = tr.recv(st.buf, peer, tag, ctx)
        st.finish()
        work._src = pg.ranks[got]
    key = -1 if peer is None else peer
    return pg.run_p2p(fn, key, "recv", ctx, [t])


def send(tensor: torch.Tensor, dst: int | None = None, group: Any = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst``; returns once the bytes are handed over."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: Any = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank); returns the sender's global rank."""
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    work.wait()
    return work._src


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``P2POp(dist.isend, tensor, peer)``."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int | None = None, group: Any = None,
                 tag: int = 0, group_peer: int | None = None) -> None:
        name = getattr(op, "__name__", "")
        if name not in ("isend", "irecv", "send", "recv"):
            raise ValueError(f"P2POp: op: expected dist.isend or dist.irecv, got {op!r}")
        if peer is None and group_peer is None:
            raise ValueError("P2POp: expected peer or group_peer")
        self.op = isend if name in ("isend", "send") else irecv
        self.tensor = tensor
        self.peer = peer
        self.group = group
        self.tag = tag
        self.group_peer = group_peer

    def __repr__(self) -> str:
        return f"P2POp({self.op.__name__}, peer={self.peer}, tag={self.tag})"


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; returns their Works (in list order)."""
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise ValueError("batch_isend_irecv: expected a non-empty list of P2POp")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):
            raise TypeError(f"batch_isend_irecv: p2p_op_list[{i}]: expected a P2POp, got {type(p).__name__}")
    works: list[Work] = []
    for p in p2p_op_list:
        if p.op is isend:
            w = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            w = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        works.append(w if w is not None else _Completed(op="p2p (not a member)"))
    return works
