"""The ``tcp`` transport's frame pump: one collective's sends and receives, with deadlines.

An algorithm queues, per peer, the frames it will send (``send``) and the frames
it expects (``recv``, with an optional callback run when one has arrived, which
may queue more: that is how ring steps forward chunks as soon as they land).
``run`` then sends on every connection at once, non-blocking, while the
transport's reader thread (``_tcp_link``, [Note: tcp routing]) reads each
expected frame straight into its tensor after checking its header; the pump's
thread runs the callbacks (the reductions) as frames complete, so they overlap
the arrival of the next ones.  Sends are ``sendmsg`` of (header, tensor memory)
under the connection's send lock, one whole frame at a time: no copies besides
the kernel's.  See [Note: tcp frames].

Every wait is a ``poll`` bounded by the operation's deadline on the transport's
wake-up pipe (written by the reader when a frame completes and by ``abort``)
and the connections it still sends on.  An ABORT from any peer fails the
operation at once; a peer that closes or resets a connection this operation
needs is a ``PeerFailureError`` at once; a silent one (cut link, stopped
process) a ``CollectiveTimeoutError`` at the deadline naming it.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
from collections.abc import Callable

from ringlet.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
    GroupAbortedError,
    PeerFailureError,
)
from ringlet.transport._tcp_link import Link, Want
from ringlet.transport._tcp_mesh import Peer
from ringlet.transport._tcp_wire import DATA, FRAME_MAGIC, HEADER, parse_header
from ringlet.transport.base import OpContext, describe_fingerprint

__all__ = ["Pump", "peer_lost"]

_OUT = select.POLLOUT
_EOF_WORDS = "closed the connection: it died, exited or was killed"


def peer_lost(ctx: OpContext, p: Peer, err: BaseException | None, kind: str = "collective") -> DistBackendError:
    """PeerFailureError for a peer whose connection ended (EOF, reset, BYE)."""
    gone = p.gone or ""
    if gone == "bye":
        what = "left the group (destroy_process_group or exit) before joining this operation"
    elif err is not None:
        what = f"reset the connection ({type(err).__name__}: {err}) during a {kind} operation: it died or was killed"
    elif gone.startswith("reset"):
        what = f"{gone[:5]} the connection{gone[5:]}: it died or was killed"
    elif gone in ("", "eof"):
        what = _EOF_WORDS
    else:
        what = f"cannot be read from ({gone})"
    return ctx.error(PeerFailureError, f"rank {p.rank} ({p.where()}) {what}", peer=p.rank, host=p.host,
                     pid=p.pid)


class Pump:
    """Frame queues of one operation on the group's connections (see the module docstring)."""

    def __init__(self, me: int, peers: dict[int, Peer], wake_fd: int, wake_w: int,
                 reader_name: str = "ringlet-tcp-rx") -> None:
        self.me = me
        self.peers = peers
        self.wake_fd = wake_fd                   # non-blocking read end: the reader and abort write
        self.link = Link(me, peers, wake_w, reader_name)   # to ``wake_w``
        self.aborted: str | None = None          # set by the transport's abort(), under lock
        self.active = False                      # a run() is in progress (it owns its sends)
        self.lock = threading.Lock()
        self.abort_hook: Callable[[], None] | None = None   # sends ABORT frames (the transport's)
        self.sendq: dict[int, collections.deque[list[memoryview]]] = {r: collections.deque() for r in peers}
        self._open: dict[int, int] = dict.fromkeys(peers, 0)       # receives posted, not yet run
        self._fd_rank = {p.fd: r for r, p in peers.items()}
        self._wants: list[Want] = []
        self._tx: dict[int, int] = {}
        self._rx: dict[int, int] = {}
        self._rx_done: dict[int, int] = {}
        self._held: set[int] = set()             # peers whose send lock this operation holds
        self._mid: set[int] = set()              # peers whose first queued frame is partly sent
        self._contended = False
        self._stirred: list[int] = []            # other peers whose stream had input at the last wait
        self.ctx: OpContext | None = None
        self._fp = (0, 0, 0)
        self.keep: list[object] = []             # tensors whose memory queued frames use
        self.wait_s = 0.0                        # time spent blocked in poll (stats)
        self.late_s: dict[int, float] = {}

    # -- queueing --------------------------------------------------------------------------
    def begin(self, ctx: OpContext) -> None:
        """Start a new operation: frame indices restart at 0 for every peer."""
        if self.aborted is not None:
            raise ctx.error(GroupAbortedError, f"the group was aborted on this rank: {self.aborted}")
        self.ctx = ctx
        self._fp = ctx.fingerprint()
        self.keep.clear()
        self._wants.clear()
        self._tx.clear()
        self._rx.clear()
        self._rx_done.clear()

    def send(self, peer: int, payload: memoryview) -> None:
        i = self._tx.get(peer, 0)
        self._tx[peer] = i + 1
        seq, word1, numel = self._fp
        frame = [memoryview(HEADER.pack(FRAME_MAGIC, DATA, 0, seq, word1, numel, i, len(payload)))]
        if len(payload):
            frame.append(payload)
        self.sendq[peer].append(frame)

    def recv(self, peer: int, view: memoryview, done: Callable[[], None] | None = None) -> None:
        i = self._rx.get(peer, 0)
        self._rx[peer] = i + 1
        seq, word1, numel = self._fp
        w = Want(peer, HEADER.pack(FRAME_MAGIC, DATA, 0, seq, word1, numel, i, len(view)), view, done)
        self._open[peer] += 1
        self._wants.append(w)
        self.link.want(w)

    # -- running ---------------------------------------------------------------------------
    def run(self) -> None:
        """Move every queued frame; raises the operation's error (and leaves the queues empty).

        An ``abort`` from another thread while this runs wakes the wait; this thread then sends
        the ABORT frames itself once its own frames are settled.
        """
        with self.lock:
            if self.aborted is not None:
                self._fail()
                raise self._ctx().error(GroupAbortedError, f"the group was aborted on this rank: {self.aborted}")
            self.active = True
        link = self.link
        link.take_over()
        try:
            while True:
                progressed = False
                for r, q in self.sendq.items():   # sends first: a callback may overwrite a tensor
                    if q and self._push(r, q):     # that small direct exchanges still send from
                        progressed = True
                # the streams this operation needs, and any other that had something (a message
                # for a waiting receive, an ABORT) at the last wait
                if link.read_all([r for r, k in self._open.items() if k] + self._stirred):
                    progressed = True
                self._stirred.clear()
                if self._settle_received():
                    progressed = True
                if not any(self._open.values()) and not any(self.sendq.values()):
                    break
                self._check_peers()
                if not progressed:
                    self._wait()
        except BaseException:
            self._fail()
            link.hand_back()
            with self.lock:
                self.active = False
                if self.aborted is not None and self.abort_hook is not None:
                    self.abort_hook()
            raise
        self._release_all()
        link.hand_back()
        with self.lock:
            self.active = False
            if self.aborted is not None and self.abort_hook is not None:
                self.abort_hook()          # abort() came while this ran: it left the ABORTs to us

    def _settle_received(self) -> bool:
        """Run the callbacks of the receives the reader completed; raise for a bad header."""
        link, progressed = self.link, False
        while True:
            with link.cv:
                if not link.completed:
                    return progressed
                w = link.completed.popleft()
            r = w.peer
            self._open[r] -= 1
            if not w.ok:
                raise self._bad_header(r, w)
            w.settle()
            self._rx_done[r] = self._rx_done.get(r, 0) + 1
            progressed = True
            if w.done is not None:
                w.done()

    def _push(self, r: int, q: collections.deque[list[memoryview]]) -> bool:
        p = self.peers[r]
        if p.tx_broken:
            raise self._ctx().error(DistBackendError, f"the stream to rank {r} ({p.where()}) was cut "
                                    "mid-frame by an earlier error; the group cannot be used", peer=r)
        if r not in self._held:
            if not self.link.tx[r].acquire(blocking=False):   # a point-to-point frame is going out
                self._contended = True
                return False
            self._held.add(r)
        progressed = False
        while q:
            frame = q[0]
            try:
                n = p.sock.sendmsg(frame)
            except BlockingIOError:
                break
            except OSError as e:
                self._last_words(r)        # a peer that aborted or left said so before it closed
                raise peer_lost(self._ctx(), p, e) from None
            progressed = True
            while frame and n >= len(frame[0]):
                n -= len(frame.pop(0))
            if frame:
                frame[0] = frame[0][n:]
                self._mid.add(r)
                return progressed
            q.popleft()
            self._mid.discard(r)
        self._held.discard(r)              # between frames: point-to-point may go in between
        self.link.tx[r].release()
        return progressed

    def _last_words(self, r: int) -> None:
        """Sending to ``r`` failed: read what it sent before it closed (this thread reads while
        the operation runs; briefly, since an ABORT or BYE is already there if it was sent)."""
        deadline = time.monotonic() + 0.2
        while True:
            self.link.read_all([r])
            self._check_peers(r)
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)

    def _release_all(self) -> None:
        for r in self._held:
            self.link.tx[r].release()
        self._held.clear()

    def _ctx(self) -> OpContext:
        if self.ctx is None:
            raise AssertionError("Pump.run() without begin()")
        return self.ctx

    # -- waiting ---------------------------------------------------------------------------
    def _needed(self) -> list[int]:
        return [r for r in self.peers if self._open[r] or self.sendq[r]]

    def _check_peers(self, only: int | None = None) -> None:
        """Fail now on an ABORT from any peer, or on a needed peer that is gone or out of step."""
        ctx, link = self._ctx(), self.link
        if self.aborted is not None:
            raise ctx.error(GroupAbortedError, f"the group was aborted on this rank: {self.aborted}")
        for r, reason in list(link.aborted_by.items()):
            p = self.peers[r]
            raise ctx.error(GroupAbortedError, f"the group was aborted by rank {r} ({p.where()}): {reason}",
                            aborted_by=r, peer=r)
        for r in ([only] if only is not None else self._needed()):
            p = self.peers[r]
            if r in link.desync:
                raise ctx.error(CollectiveMismatchError, f"the stream from rank {r} ({p.where()}) is out of "
                                "step after an earlier error", peer=r)
            if p.gone is not None and (self._open[r] or only is not None):
                raise peer_lost(ctx, p, None)

    def _wait(self) -> None:
        ctx = self._ctx()
        poller = select.poll()
        waited_on = self._needed()
        with self.link.cv:
            events = self.link.poll_set()
        for r in waited_on:
            if self.sendq[r] and (r in self._held or not self.link.tx[r].locked()):
                fd = self.peers[r].fd
                events[fd] = events.get(fd, 0) | _OUT
        events[self.wake_fd] = select.POLLIN
        for fd, ev in events.items():
            poller.register(fd, ev)
        t0 = time.monotonic()
        remaining = ctx.deadline - t0
        if remaining <= 0:
            raise self._timeout(waited_on)
        limit = min(remaining, 0.001) if self._contended else remaining
        self._contended = False
        ready = poller.poll(limit * 1000.0)
        waited = time.monotonic() - t0
        self.wait_s += waited
        for r in waited_on:
            self.late_s[r] = self.late_s.get(r, 0.0) + waited
        for fd, ev in ready:
            if fd == self.wake_fd:
                try:
                    while os.read(self.wake_fd, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                if ev & (select.POLLHUP | select.POLLERR):
                    self.link.hung_up(fd)
                r = self._fd_rank[fd]
                if not self._open[r]:
                    self._stirred.append(r)
        if not ready and limit == remaining:
            raise self._timeout(waited_on)

    # -- errors ----------------------------------------------------------------------------
    def _bad_header(self, r: int, w: Want) -> DistBackendError:
        ctx, p = self._ctx(), self.peers[r]
        got = w.header or bytes(HEADER.size)
        magic, kind, seq, word1, numel, idx, nbytes = parse_header(got)
        want = parse_header(w.expect)
        if magic != FRAME_MAGIC:
            return ctx.error(CollectiveMismatchError, f"rank {r} ({p.where()}) sent bytes that are not a "
                             "ringlet frame (the connection is out of step)", peer=r)
        mine = f"rank {self.me}: {ctx.describe()}"
        theirs = f"rank {r}: {describe_fingerprint((seq, word1, numel))}"
        if (seq, word1, numel) != want[2:5] or kind != DATA:
            return ctx.error(CollectiveMismatchError, f"ranks called different collectives: {mine}; {theirs}",
                             calls=[mine, theirs], peer=r)
        return ctx.error(CollectiveMismatchError,
                         f"rank {r} sent frame {idx} of {nbytes} bytes, rank {self.me} expected frame "
                         f"{want[5]} of {want[6]} bytes ({ctx.describe()}): the ranks' arguments differ",
                         peer=r)

    def _timeout(self, waited_on: list[int]) -> DistBackendError:
        ctx = self._ctx()
        parts = []
        for r in waited_on:
            p = self.peers[r]
            todo = self._open[r]
            done = self._rx_done.get(r, 0)
            what = [f"{done} of {done + todo} frames received"] if todo else []
            if self.sendq[r]:
                what.append(f"{len(self.sendq[r])} frame(s) still to send")
            parts.append(f"rank {r} ({p.where()}): {', '.join(what)}")
        first = self.peers[waited_on[0]] if waited_on else None
        return ctx.error(CollectiveTimeoutError,
                         f"timed out waiting for ranks {waited_on} over tcp ({'; '.join(parts)}); no bytes "
                         "came in time: a cut link, a stopped process, or a rank that never called this",
                         missing=waited_on, peer=first.rank if first else -1,
                         host=first.host if first else None)

    def _fail(self) -> None:
        """After an error: streams with a partly sent frame are out of step; drop the queues, and
        make sure the reader writes nothing more into this operation's tensors."""
        for r in self._mid:                # the peer would read what follows as this frame's
            p = self.peers[r]                  # payload: end the stream instead
            p.tx_broken = True
            try:
                p.sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass
        self._mid.clear()
        self._release_all()
        self.link.abandon(self._wants)
        self._wants.clear()
        for r in self._open:
            self._open[r] = 0
        for q in self.sendq.values():
            q.clear()
