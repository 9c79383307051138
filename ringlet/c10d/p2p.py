"""Point-to-point: ``send``, ``recv``, ``isend``, ``irecv``, ``batch_isend_irecv`` and ``P2POp``.

Messages between two ranks are delivered in order; a receive must name the
same tag, dtype and number of elements as the matching send (ringlet matches in
order; each message's header carries its tag, byte size and dtype, and a
disagreement is an error naming both sides, instead of waiting for a tag that
will never come or reading float32 bytes as float64).  The receiver raises
``CollectiveMismatchError``; the group is aborted, so the sender's next call
raises the same error with the receiver's text.  Shapes need not agree (a
flat buffer may be received into a shaped one).  On the torch engines
(``gloo``/``nccl`` through torch) the header is torch's: only the size is
checked.  Each (peer, direction) has its own thread, so a large
``isend`` that waits for the peer to drain it never blocks an ``irecv``: a
batch of sends and receives in any order cannot deadlock.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import _call, checks
from ringlet.c10d.work import Work, _Completed
from ringlet.transport.base import OpContext

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = ["P2POp", "batch_isend_irecv", "irecv", "isend", "recv", "send"]


def _p2p_ctx(pg: ProcessGroup, op: str, peer: int, t: torch.Tensor) -> OpContext:
    pg.check_usable()
    return OpContext.make(op, 0, pg.rank(), pg.size(), pg.group_desc, pg.timeout, dtype=t.dtype,
                          numel=t.numel(), root=peer, shape=tuple(t.shape))


def _peer(pg: ProcessGroup, rank: Any, group_rank: Any, op: str, arg: str) -> int:
    peer = checks.peer(pg, rank, group_rank, op, arg)
    if peer == pg.rank():
        raise checks.fail(ValueError, op, arg if group_rank is None else f"group_{arg}",
                          f"expected a rank other than this rank ({pg.ranks[peer]})")
    return peer


def isend(tensor: torch.Tensor, dst: int | None = None, group: GroupArg = None, tag: int = 0,
          group_dst: int | None = None) -> Work | None:
    """Send ``tensor`` to ``dst`` asynchronously; returns a :class:`Work`.

    Raises:
        TypeError, ValueError: before anything is sent, for an argument the gate refuses
            (``checks``: the tensor, ``dst``/``group_dst``, ``tag``).
    """
    pg = _call.resolve(group, "isend")
    if pg is None:
        return None
    t = checks.tensor(tensor, "isend", "tensor", pg.transport.devices)
    peer = _peer(pg, dst, group_dst, "isend", "dst")
    tg = checks.tag(tag, "isend")
    data = checks.contiguous_input(t)
    ctx = _p2p_ctx(pg, "send", peer, t)
    tr = pg.transport
    return _call.launch_p2p(pg, "send", lambda work: tr.send(data, peer, tg, ctx), peer, "send",
                            ctx, [data])


def irecv(tensor: torch.Tensor, src: int | None = None, group: GroupArg = None, tag: int = 0,
          group_src: int | None = None) -> Work | None:
    """Receive into ``tensor`` from ``src`` (None: any rank) asynchronously;
    returns a :class:`Work`."""
    pg = _call.resolve(group, "irecv")
    if pg is None:
        return None
    t = checks.tensor(tensor, "irecv", "tensor", pg.transport.devices, out=True)
    peer: int | None = None
    if src is not None or group_src is not None:
        peer = _peer(pg, src, group_src, "irecv", "src")
    tg = checks.tag(tag, "irecv")
    ctx = _p2p_ctx(pg, "recv", -1 if peer is None else peer, t)
    st = checks.Staged(t)
    tr = pg.transport

    def fn(work: Work) -> None:
        got = tr.recv(st.buf, peer, tg, ctx)
        st.finish()
        work._src = pg.ranks[got]
    key = -1 if peer is None else peer
    return _call.launch_p2p(pg, "recv", fn, key, "recv", ctx, [t])


def send(tensor: torch.Tensor, dst: int | None = None, group: GroupArg = None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Send ``tensor`` to ``dst``; returns once the bytes are handed over."""
    work = isend(tensor, dst, group, tag, group_dst)
    if work is not None:
        work.wait()


def recv(tensor: torch.Tensor, src: int | None = None, group: GroupArg = None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Receive into ``tensor`` from ``src`` (None: any rank); returns the sender's global rank."""
    work = irecv(tensor, src, group, tag, group_src)
    if work is None:
        return -1
    work.wait()
    return work._src


class P2POp:
    """One operation of :func:`batch_isend_irecv`: ``P2POp(dist.isend, tensor, peer)``."""

    def __init__(self, op: Any, tensor: torch.Tensor, peer: int | None = None,
                 group: GroupArg = None, tag: int = 0, group_peer: int | None = None) -> None:
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


def _check_op(p: P2POp, i: int) -> None:
    """Everything ``isend``/``irecv`` would refuse, for one entry, without issuing it."""
    name = "batch_isend_irecv"
    pg = _call.resolve(p.group, name)
    if pg is None:
        return
    sending = p.op is isend
    checks.tensor(p.tensor, name, f"p2p_op_list[{i}].tensor", pg.transport.devices, out=not sending)
    _peer(pg, p.peer, p.group_peer, name, f"p2p_op_list[{i}].peer")
    checks.tag(p.tag, name)


def batch_isend_irecv(p2p_op_list: list[P2POp]) -> list[Work]:
    """Start every send and receive of the list; returns their Works (in list order).

    Every entry is checked before the first one starts, so a bad entry leaves nothing
    half-issued that a peer would wait for.
    """
    if not isinstance(p2p_op_list, (list, tuple)) or not p2p_op_list:
        raise checks.fail(ValueError, "batch_isend_irecv", "p2p_op_list",
                          f"expected a non-empty list of P2POp, got {p2p_op_list!r}")
    for i, p in enumerate(p2p_op_list):
        if not isinstance(p, P2POp):      # torch's ValueError and text first: scripts catch them
            ours = checks.fail(ValueError, "batch_isend_irecv", f"p2p_op_list[{i}]",
                               f"expected a P2POp, got {type(p).__name__}")
            raise ValueError(  # noqa: TRY004
                f"Invalid ``p2p_op_list``. Each op is expected to be a ``P2POp``: {ours}")
        _check_op(p, i)
    works: list[Work] = []
    for p in p2p_op_list:
        if p.op is isend:
            w = isend(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        else:
            w = irecv(p.tensor, p.peer, p.group, p.tag, p.group_peer)
        works.append(w if w is not None else _Completed(op="p2p (not a member)"))
    return works


def send_one(tensor: torch.Tensor, dst: Any, group: GroupArg, group_dst: Any,
             use_batch: bool) -> None:
    """``send``, or (``use_batch``) a one-entry ``batch_isend_irecv`` as torch's object p2p does."""
    if not use_batch:
        send(tensor, dst, group, group_dst=group_dst)
        return
    for work in batch_isend_irecv([P2POp(isend, tensor, dst, group, group_peer=group_dst)]):
        work.wait()


def recv_one(tensor: torch.Tensor, src: Any, group: GroupArg, group_src: Any,
             use_batch: bool) -> int:
    """``recv`` (returns the sender's global rank), or a one-entry ``batch_isend_irecv``."""
    if not use_batch:
        return recv(tensor, src, group, group_src=group_src)
    if src is None and group_src is None:
        raise checks.fail(ValueError, "recv_object_list", "src", "expected a rank with "
                          "use_batch=True (a batched receive names its peer), got None")
    (work,) = batch_isend_irecv([P2POp(irecv, tensor, src, group, group_peer=group_src)])
    work.wait()
    return work._src
