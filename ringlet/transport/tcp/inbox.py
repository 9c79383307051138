"""The ``tcp`` transport's receiving side: one reader per moment, every frame routed to its owner.

[Note: tcp routing]
Collectives and point-to-point messages share one connection per pair of ranks.  Exactly one
thread reads the connections at a time (it holds ``Inbox.rd``):

- while a collective runs, its own thread (``Pump.run`` calls :meth:`Inbox.take_over`): frames
  land in its tensors without a hand-off between threads -- unless the operation is *served*
  (:meth:`Inbox.serve`, [Note: tcp I/O overlap]): then the reader thread reads them;
- otherwise, when somebody waits for input (a point-to-point receive), the transport's reader
  thread (``ringlet-tcp-rx <group> r<rank>``); with nobody waiting it sleeps, and frames stay in
  the kernel.

Whoever reads hands each frame to its owner: a collective frame (DATA) to the receive that the
running operation posted for it (:meth:`Inbox.want`), a point-to-point frame (P2P) to the ``recv``
waiting for it -- the header is checked first, then the payload is read straight into the tensor;
ABORT, BYE and the end of a stream are recorded and every waiter is woken.

A frame that arrives before its receive is posted is *held*: its header has been read and its
stream is not read further, so TCP flow control holds the sender and the payload can still go
straight into the tensor once the receive is posted.  Only when somebody waits for a frame
*behind* a held one (a point-to-point receive behind an operation's frame, an operation's frames
behind a message nobody has received yet, or a receive from any rank) is the held frame read into
a private buffer (``Early``), so that neither kind of traffic can block the other.

Writers take the connection's send lock (``Outbox``) for whole frames, so the frames of a
collective and of point-to-point threads never interleave.
"""

from __future__ import annotations

import collections
import os
import select
import socket
import threading
import time
from collections.abc import Iterable

from ringlet.transport.tcp.frames import (
    Early,
    Inbound,
    Want,
    drain,
    pipe,
    poke,
    read_reason,
    read_stream,
)
from ringlet.transport.tcp.mesh import Peer
from ringlet.transport.tcp.wire import ABORT, BYE, DATA, FRAME_MAGIC, parse_header

__all__ = ["Inbox"]

_JOIN_S = 2.0
_REPOLL_MS = 50            # the reader thread re-reads its watch list at least this often
_HUP = select.POLLHUP | select.POLLERR


class Inbox:
    """The connections' receiving side and its reader thread (see [Note: tcp routing]).

    ``cv`` guards the routing state; point-to-point receives wait on it.  A running collective
    waits on :attr:`notify_fd`, which becomes readable when one of its receives completes or
    :meth:`wake_all` is called.
    """

    def __init__(self, me: int, peers: dict[int, Peer], name: str = "ringlet-tcp-rx") -> None:
        self.me = me
        self.peers = peers
        lock = threading.RLock()
        self.cv = threading.Condition(lock)         # guards the state below; point-to-point waits
        self._park = threading.Condition(lock)      # the reader thread sleeps here
        self.inb = {r: Inbound() for r in peers}
        self.posted: dict[int, collections.deque[Want]] = {r: collections.deque() for r in peers}
        self.early: dict[int, collections.deque[Early]] = {r: collections.deque() for r in peers}
        self.mail: dict[int, collections.deque[Early]] = {r: collections.deque() for r in peers}
        self.p2p_want: dict[int, Want | None] = dict.fromkeys(peers)
        self.any_source = 0                         # receives from any rank now waiting
        self.completed: collections.deque[Want] = collections.deque()
        self.aborted_by: dict[int, str] = {}        # peer -> reason of its ABORT frame
        self.desync: set[int] = set()               # streams out of step (bad header)
        self._fd_rank = {p.fd: r for r, p in peers.items()}
        self.notify_fd, self._notify_w = pipe()    # a collective's wake-up
        self._wake_r, self._wake_w = pipe()        # the reader thread's wake-up
        self._closing = False
        self.rd = threading.Lock()                  # held by whoever reads the connections
        self.pump_reads = False                     # a running collective holds ``rd``
        self.serving = False                        # the reader thread reads for a collective
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # -- posting receives (any thread, for its own operation) ----------------------------------
    def want(self, w: Want) -> None:
        """Post a collective receive from ``w.peer``; frames are matched in posting order."""
        with self.cv:
            if not self._claim(self.early[w.peer], w):
                self.posted[w.peer].append(w)
                self._reconsider(w.peer)

    def want_p2p(self, w: Want) -> None:
        """Post the point-to-point receive from ``w.peer`` (one at a time per peer)."""
        with self.cv:
            if not self._claim(self.mail[w.peer], w):
                self.p2p_want[w.peer] = w
                self._reconsider(w.peer)
                self._park.notify()                # the reader thread may sleep

    def _claim(self, q: collections.deque[Early], w: Want) -> bool:
        """Under ``cv``: give ``w`` the privately buffered frame at the head of ``q``, if any."""
        if not q:
            return False
        e = q.popleft()
        w.header, w.early = e.header, e
        if e.complete:
            self._done(w, q is self.early[w.peer])
        else:
            e.waiter = w
            self._park.notify()                    # the reader thread may have to finish it
        return True

    def _done(self, w: Want, collective: bool) -> None:
        """Under ``cv``: ``w`` has its frame (or a header that differs from the one it wanted)."""
        if collective:
            self._complete(w)
        else:
            w.finished = True
            self.cv.notify_all()

    def take_any(self) -> int | None:
        """Under ``cv``: the lowest rank with a point-to-point message buffered, if any."""
        for r in sorted(self.mail):
            if self.mail[r]:
                return r
        return None

    def any_waiting(self, delta: int) -> None:
        """Under ``cv``: a receive from any rank starts (+1) or ends (-1) waiting."""
        self.any_source += delta
        if delta > 0:
            for r in self.peers:
                self._reconsider(r)
            self._park.notify()

    def withdraw(self, w: Want) -> None:
        """Under ``cv``: ``w``'s waiter gives up; a payload half read into its view goes to
        scratch."""
        if self.p2p_want.get(w.peer) is w:
            self.p2p_want[w.peer] = None
        if w.early is not None and w.early.waiter is w:
            w.early.waiter = None
        self._stop_filling(self.inb[w.peer], w)

    def abandon(self, wants: list[Want]) -> None:
        """A collective failed: forget its receives; none may write into its tensors afterwards."""
        with self.cv:
            for w in wants:
                q = self.posted[w.peer]
                if w in q:
                    q.remove(w)
                if w.early is not None and w.early.waiter is w:
                    w.early.waiter = None
                self._stop_filling(self.inb[w.peer], w)
            self.completed.clear()

    def _stop_filling(self, st: Inbound, w: Want) -> None:
        """Under ``cv``: if the reader is filling ``w``'s view, the rest of that payload goes to
        scratch; wait out a ``recv_into`` in progress ([busy / discard] in ``frames``)."""
        if st.owner is w:
            st.discard = True
            st.watched = True
            deadline = time.monotonic() + 1.0      # one non-blocking recv_into: microseconds
            while st.busy:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self.cv.wait(remaining)
            st.watched = False

    def out_of_step(self, r: int) -> None:
        """The stream from ``r`` cannot be trusted any more (a receive got a header it did not
        expect)."""
        with self.cv:
            self.desync.add(r)
            self.cv.notify_all()

    def next_completed(self) -> Want | None:
        """The next collective receive the reader completed (for the running collective)."""
        with self.cv:
            return self.completed.popleft() if self.completed else None

    # -- who reads: the reader thread, or a running collective -------------------------------
    def take_over(self) -> None:
        """A collective starts: its thread reads the connections itself (no hand-off per frame)
        until :meth:`hand_back`; the reader thread parks meanwhile."""
        self.rd.acquire()
        with self.cv:
            self.pump_reads = True

    def hand_back(self) -> None:
        with self.cv:
            self.pump_reads = False
            if self._demand():
                self._park.notify()
                self._wake_reader()                # it may be in poll() with an old watch list
        self.rd.release()

    def serve(self, on: bool) -> None:
        """A collective starts (``on``) or ends: the reader thread reads its frames into its
        tensors while the collective's thread sends and reduces ([Note: tcp I/O overlap])."""
        with self.cv:
            self.serving = on
            if on:
                self._park.notify()
                poke(self._wake_w)                 # it may be in poll() with an old watch list

    def await_end(self, r: int, timeout: float) -> None:
        """Wait (at most ``timeout``) until the reader thread has seen ``r``'s stream end or an
        ABORT from it: what a collective whose send to ``r`` failed reports, when it does not
        read the connections itself."""
        p = self.peers[r]
        with self.cv:
            self.cv.wait_for(lambda: p.gone is not None or r in self.aborted_by
                             or r in self.desync or self._closing, timeout)

    def _demand(self) -> bool:
        """Under ``cv``: whether the reader thread has reading to do: a running collective lets
        it read (:meth:`serve`), a point-to-point receive waits, or a frame is half read.
        Otherwise it sleeps and frames stay in the kernel until a collective or a receive wants
        them (TCP holds their senders)."""
        if self.serving or self.any_source or any(w is not None
                                                  for w in self.p2p_want.values()):
            return True
        return any(st.owner is not None or (st.header is not None and not st.held)
                   for st in self.inb.values())

    def poll_set(self) -> dict[int, int]:
        """What the reading thread polls: POLLIN on streams it can read, nothing (hang-ups only)
        on held ones, none on streams that ended."""
        want = {}
        with self.cv:
            for r, p in self.peers.items():
                if p.gone is not None or r in self.desync or r in self.aborted_by:
                    continue
                st = self.inb[r]
                if st.held:
                    if not st.hup:
                        want[p.fd] = 0
                else:
                    want[p.fd] = select.POLLIN
        return want

    def polled(self, fd: int, events: int) -> int | None:
        """``poll`` reported ``events`` on ``fd``: note a hang-up of a held stream (its reader
        finds the end later); returns the peer's rank (None: not a connection)."""
        r = self._fd_rank.get(fd)
        if r is not None and events & _HUP and self.inb[r].held:
            self.inb[r].hup = True
        return r

    def read_all(self, ranks: Iterable[int] | None = None) -> bool:
        """Read what the streams of ``ranks`` (default all) have, unless held (non-blocking);
        True if anything came."""
        progressed = False
        for r in self.inb if ranks is None else ranks:
            if not self.inb[r].held and self._read(r):
                progressed = True
        return progressed

    def _loop(self) -> None:
        poller = select.poll()
        registered: dict[int, int] = {}
        try:
            while not self._closing:
                with self.cv:
                    while not self._closing and (self.pump_reads or not self._demand()):
                        self._park.wait()
                    want = self.poll_set()
                want[self._wake_r] = select.POLLIN
                for fd in list(registered):
                    if fd not in want:
                        poller.unregister(fd)
                        del registered[fd]
                for fd, ev in want.items():
                    if registered.get(fd) != ev:
                        poller.register(fd, ev)
                        registered[fd] = ev
                events = poller.poll(_REPOLL_MS)   # bounded: the watch list may change meanwhile
                drain(self._wake_r)
                if not self.rd.acquire(blocking=False):
                    continue                       # a collective reads now
                try:
                    for fd, ev in events:
                        self.polled(fd, ev)
                    self.read_all()                # also frames just given an owner
                finally:
                    self.rd.release()
        except BaseException as e:        # never silently: every waiter learns the reader died
            with self.cv:
                for p in self.peers.values():
                    p.gone = p.gone or f"reader failed: {type(e).__name__}: {e}"
                self.cv.notify_all()
            self.nudge()
            if not self._closing:
                raise

    # -- reading one stream ---------------------------------------------------------------------
    def _read(self, r: int) -> bool:
        """Read what connection ``r`` has, frame by frame, until it would block or is held."""
        p = self.peers[r]
        if p.gone is not None or r in self.desync or r in self.aborted_by:
            return False
        return read_stream(r, self.inb[r], p.sock, self, self.cv)

    # -- what the stream reader reports (``frames.read_stream``) ---------------------------------
    def header(self, r: int, sock: socket.socket) -> bool:
        """A complete header arrived from ``r``: route it.  False: stop reading ``r`` (ended or out
        of step)."""
        st = self.inb[r]
        raw = bytes(st.hbuf)
        magic, kind, _seq, _w1, _numel, _idx, nbytes = parse_header(raw)
        if magic != FRAME_MAGIC:
            with self.cv:
                self.desync.add(r)
                self._fail_waiters(r, raw)
            return False
        if kind == ABORT:
            reason = read_reason(sock, nbytes)
            with self.cv:
                self.aborted_by[r] = reason
                self.cv.notify_all()
            self.nudge()
            return False
        if kind == BYE:
            self.gone(r, "bye")
            return False
        st.header, st.kind, st.nbytes = raw, kind, nbytes
        with self.cv:
            self._route(r)
            return r not in self.desync

    def _route(self, r: int) -> None:
        """Under ``cv``: give the frame at the head of ``r``'s stream a destination, or hold it.

        ``held`` is cleared only after ``owner`` and ``dest`` are set: the reading thread looks at
        ``held`` without the lock."""
        st = self.inb[r]
        hdr = st.header
        if hdr is None or st.owner is not None:
            return
        dest: Want | Early | None = None
        if st.kind == DATA:
            q = self.posted[r]
            if q:
                w = q.popleft()
                w.header = hdr
                if not w.ok:                       # nothing is read into the tensor
                    self.desync.add(r)
                    self._complete(w)
                    self.cv.notify_all()           # point-to-point waiters on r look again
                    return
                dest = w
            elif self.p2p_want.get(r) is not None or self.any_source:
                dest = Early(hdr, st.nbytes)
                self.early[r].append(dest)
        else:
            pw = self.p2p_want.get(r)
            if pw is not None:
                self.p2p_want[r] = None
                pw.header = hdr
                if not pw.ok:
                    self.desync.add(r)
                    pw.finished = True
                    self.cv.notify_all()
                    return
                dest = pw
            elif self.posted[r] or self.any_source:
                dest = Early(hdr, st.nbytes)
                self.mail[r].append(dest)
                self.cv.notify_all()               # a receive from any rank may take it
        if dest is None:
            st.held = True
            return
        st.owner = dest
        st.dest = dest.view if isinstance(dest, Want) else memoryview(dest.buf)
        st.held = False

    def _reconsider(self, r: int) -> None:
        """Under ``cv``: somebody now waits on ``r``; a held frame may have an owner now."""
        st = self.inb[r]
        if st.held:
            self._route(r)
            if not st.held:
                self._wake_reader()

    def frame_done(self, r: int) -> None:
        """The payload of the frame at the head of ``r``'s stream is complete."""
        st = self.inb[r]
        with self.cv:
            owner = st.owner
            if isinstance(owner, Early):
                owner.complete = True
                w = owner.waiter
                if w is not None:
                    owner.waiter = None
                    self._done(w, st.kind == DATA)
            elif isinstance(owner, Want):
                self._done(owner, st.kind == DATA)
            st.reset()

    def _complete(self, w: Want) -> None:
        """Under ``cv``: a collective receive is done (or failed its header check): tell its thread
        (unless that thread is the one reading)."""
        w.finished = True
        self.completed.append(w)
        if not self.pump_reads:
            self.nudge()

    def _fail_waiters(self, r: int, raw: bytes) -> None:
        """Under ``cv``: bytes that are not a frame came from ``r``: fail whoever waits on it."""
        for w in list(self.posted[r]):
            w.header = raw
            self._complete(w)
        self.posted[r].clear()
        pw = self.p2p_want.get(r)
        if pw is not None:
            pw.header, pw.finished = raw, True
            self.p2p_want[r] = None
        self.cv.notify_all()

    def gone(self, r: int, why: str) -> None:
        """``r``'s stream ended (``why``: "eof", "bye", "reset ...")."""
        with self.cv:
            p = self.peers[r]
            p.gone = p.gone or why
            self.cv.notify_all()
        self.nudge()

    # -- waking ---------------------------------------------------------------------------------
    def nudge(self) -> None:
        """Wake the running collective (its wait on :attr:`notify_fd`)."""
        poke(self._notify_w)

    def drain(self) -> None:
        """The running collective woke up: empty :attr:`notify_fd`."""
        drain(self.notify_fd)

    def wake_all(self) -> None:
        """Every waiter looks at the transport's state again (after an abort or a close)."""
        self.nudge()
        with self.cv:
            self.cv.notify_all()

    def _wake_reader(self) -> None:
        """Whoever reads should look again (a held frame got an owner, or closing)."""
        poke(self._notify_w if self.pump_reads else self._wake_w)

    def close(self) -> None:
        """Stop the reader thread (bounded); the sockets stay open for the caller to close."""
        with self.cv:
            self._closing = True
            self._park.notify_all()
            self.cv.notify_all()                 # a receive still waiting sees the group is gone
        poke(self._wake_w)
        self._thread.join(timeout=_JOIN_S)
        for fd in (self._wake_r, self._wake_w, self.notify_fd, self._notify_w):
            try:
                os.close(fd)
            except OSError:
                pass
