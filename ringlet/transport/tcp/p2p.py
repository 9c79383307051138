"""Point-to-point messages of the ``tcp`` transport, on the same connections as the collectives.

One P2P frame per message, in order per pair of ranks: its header carries the tag, the size, the
dtype's code and the message's index, and the receiver checks it against its own ``recv`` before
the payload is read ([Note: tcp frames]); a mismatch is a ``CollectiveMismatchError`` naming both
sides.  A receive waits on the inbox's condition, which every change that can end it notifies (the
frame arriving, an ABORT or BYE, a broken stream, an abort or destroy on this rank), with the
deadline.
"""

from __future__ import annotations

import threading
import time

import torch

from ringlet.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
    GroupAbortedError,
)
from ringlet.transport.base import OpContext, message_code, message_mismatch
from ringlet.transport.tcp.faults import local_trouble, peer_lost, peer_trouble
from ringlet.transport.tcp.frames import Want
from ringlet.transport.tcp.inbox import Inbox
from ringlet.transport.tcp.mesh import Peer
from ringlet.transport.tcp.outbox import Outbox
from ringlet.transport.tcp.pump import mv
from ringlet.transport.tcp.wire import HEADER, P2P, header, parse_header

__all__ = ["Messages"]

# Waits are notified; this only bounds how long a notification that never comes could delay the
# deadline's check (a safety net, not a polling period).
_RECHECK_S = 1.0


class Messages:
    """Sends and receives of whole messages to and from single ranks (or any rank)."""

    def __init__(self, rank: int, peers: dict[int, Peer], inbox: Inbox, outbox: Outbox) -> None:
        self.rank = rank
        self.peers = peers
        self.inbox = inbox
        self.outbox = outbox
        self._tx = dict.fromkeys(peers, 0)
        self._rx = dict.fromkeys(peers, 0)
        self._rx_locks = {r: threading.Lock() for r in peers}

    def trouble(self, p: Peer, ctx: OpContext) -> DistBackendError | None:
        """Why a message to or from ``p`` cannot go on (None: it can)."""
        return local_trouble(ctx, self.outbox) or peer_trouble(ctx, self.inbox, p, "point-to-point")

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        p = self.peers[dst]
        data = mv(buf)
        idx = self._tx[dst]
        self._tx[dst] = idx + 1
        frame = [memoryview(header(P2P, tag, len(data), message_code(ctx), idx & 0xFFFFFFFF,
                                   len(data))), data]

        def stopped() -> BaseException:
            return self.trouble(p, ctx) or ctx.error(
                CollectiveTimeoutError, f"timed out waiting for rank {dst} ({p.where()}) to take "
                "the message over tcp", missing=[dst], peer=dst, host=p.host)
        self.outbox.send_frame(dst, frame, ctx.deadline, lambda: self.trouble(p, ctx) is not None,
                               stopped, lambda e: peer_lost(ctx, p, e, "point-to-point"))

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        if src is None:
            src = self._wait_any_source(ctx)
        elif not self._rx_locks[src].acquire(timeout=max(ctx.deadline - time.monotonic(), 0.0)):
            raise ctx.error(CollectiveTimeoutError,
                            f"timed out waiting for another receive from rank {src}")
        inbox = self.inbox
        try:
            p = self.peers[src]
            data = mv(buf)
            idx = self._rx[src]
            w = Want(src, header(P2P, tag, len(data), message_code(ctx), idx & 0xFFFFFFFF,
                                 len(data)), data, None)
            inbox.want_p2p(w)
            with inbox.cv:
                while not w.finished:
                    problem = self.trouble(p, ctx)
                    remaining = ctx.deadline - time.monotonic()
                    if problem is None and remaining <= 0:
                        problem = ctx.error(CollectiveTimeoutError,
                                            f"timed out waiting for rank {src} ({p.where()}) to "
                                            "send its message over tcp", missing=[src], peer=src,
                                            host=p.host)
                    if problem is not None:
                        inbox.withdraw(w)
                        raise problem
                    inbox.cv.wait(min(remaining, _RECHECK_S))
            if not w.ok:
                got = parse_header(w.header or bytes(HEADER.size))
                inbox.out_of_step(src)
                raise ctx.error(CollectiveMismatchError, message_mismatch(
                    src, (got[2], got[3], got[4]), ctx, (tag, len(data))), peer=src)
            w.settle()
            self._rx[src] = idx + 1
            return src
        finally:
            self._rx_locks[src].release()
            if inbox.any_source:            # a receive from any rank may wait for this lock
                with inbox.cv:
                    inbox.cv.notify_all()

    # -- from any rank ----------------------------------------------------------------------------
    def watch(self, delta: int) -> None:
        """A receive from any rank that also watches another transport starts (+1) or stops (-1):
        meanwhile messages are read as they come, for :meth:`pending_source`."""
        with self.inbox.cv:
            self.inbox.any_waiting(delta)

    def pending_source(self) -> int | None:
        """The lowest rank whose next message has arrived (or is arriving); no waiting."""
        with self.inbox.cv:
            return self.inbox.take_any()

    def check_any_source(self, ctx: OpContext) -> None:
        """Raise if a receive from any rank cannot succeed: this side destroyed or aborted, a peer
        aborted the group, or no peer is left that could send."""
        live = []
        for p in self.peers.values():
            problem = self.trouble(p, ctx)
            ended = isinstance(problem, GroupAbortedError) or p.rank in self.inbox.aborted_by
            if problem is not None and ended:
                raise problem
            if problem is None:
                live.append(p.rank)
        if not live:
            raise ctx.error(DistBackendError, f"no rank is left to send a message: every peer of "
                            f"rank {self.rank} has left, died or is out of step",
                            missing=sorted(self.peers))

    def _wait_any_source(self, ctx: OpContext) -> int:
        """The lowest rank with a message waiting; returns with that rank's receive lock held."""
        inbox = self.inbox
        with inbox.cv:
            inbox.any_waiting(+1)
            try:
                while True:
                    self.check_any_source(ctx)
                    r = inbox.take_any()
                    if r is not None and self._rx_locks[r].acquire(blocking=False):
                        return r
                    remaining = ctx.deadline - time.monotonic()
                    if remaining <= 0:
                        raise ctx.error(CollectiveTimeoutError, f"timed out waiting for a message "
                                        f"from any of ranks {sorted(self.peers)}",
                                        missing=sorted(self.peers))
                    inbox.cv.wait(min(remaining, _RECHECK_S))
            finally:
                inbox.any_waiting(-1)
