"""The ``tcp`` transport's frame pump: non-blocking sends and receives with deadlines.

An algorithm queues, per peer, the frames it will send (``send``) and the frames
it expects (``recv``, with an optional callback run when one has arrived, which
may queue more: that is how ring steps forward chunks as soon as they land).
``run`` then moves bytes on every connection at once until both queues are
empty, so two ranks that send large frames to each other never deadlock.
Sends are ``sendmsg`` of (header, tensor memory); receives ``recv_into`` the
tensor's memory: no copies besides the kernel's.  See [Note: tcp frames].

Every wait is a ``poll`` bounded by the operation's deadline; it also watches
(1) the transport's wake-up pipe, written by ``abort``, and (2) the connections
of peers this rank does not currently wait on: an ABORT frame there fails the
operation at once, a BYE or a closed connection is remembered.  A peer that
closes or resets a connection this rank needs is a ``PeerFailureError`` at once;
a silent one (cut link, stopped process) a ``CollectiveTimeoutError`` at the
deadline naming it.  Frames up to ``SMALL`` bytes are read together with their
header into a private buffer and copied into the tensor only after the header
matched; larger ones are read header first, payload straight into the tensor.
"""

from __future__ import annotations

import collections
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
from ringlet.transport._tcp_mesh import Peer
from ringlet.transport._tcp_wire import (
    ABORT,
    BYE,
    DATA,
    FRAME_MAGIC,
    HEADER,
    MAX_REASON,
    parse_header,
)
from ringlet.transport.base import OpContext, describe_fingerprint

__all__ = ["SMALL", "Pump", "peer_lost", "read_reason"]

HSIZE = HEADER.size
SMALL = 64 * 1024          # frames up to this are read in one recv with their header
_IN, _OUT = select.POLLIN, select.POLLOUT
_EOF_WORDS = "closed the connection: it died, exited or was killed"


class _Recv:
    __slots__ = ("buf", "done", "expect", "got", "hgot", "view")

    def __init__(self, expect: bytes, view: memoryview, done: Callable[[], None] | None) -> None:
        self.expect = expect
        self.view = view
        n = len(view)
        self.buf = bytearray(HSIZE + n if n <= SMALL else HSIZE)   # header (+ small payload)
        self.got = 0       # payload bytes placed in view (large frames)
        self.hgot = 0      # bytes read into buf
        self.done = done


def peer_lost(ctx: OpContext, p: Peer, err: BaseException | None, kind: str = "collective") -> DistBackendError:
    """PeerFailureError for a peer whose connection ended (EOF, reset, BYE)."""
    if p.gone == "bye":
        what = "left the group (destroy_process_group or exit) before joining this operation"
    elif err is None:
        what = _EOF_WORDS
    else:
        what = f"reset the {kind} connection ({type(err).__name__}: {err}): it died or was killed"
    return ctx.error(PeerFailureError, f"rank {p.rank} ({p.where()}) {what}", peer=p.rank, host=p.host,
                     pid=p.pid)


def read_reason(sock: socket.socket, have: bytes, nbytes: int) -> str:
    """An ABORT frame's reason: ``have`` already read, the rest for at most one second."""
    want = min(nbytes, MAX_REASON)
    data = bytearray(have[:want])
    deadline = time.monotonic() + 1.0
    while len(data) < want and time.monotonic() < deadline:
        try:
            chunk = sock.recv(want - len(data))
        except BlockingIOError:
            select.select([sock], [], [], 0.05)
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace")


class Pump:
    """Frame queues of one operation on the collective connections (see the module docstring)."""

    def __init__(self, me: int, peers: dict[int, Peer], wake_fd: int) -> None:
        self.me = me
        self.peers = peers
        self.wake_fd = wake_fd
        self.aborted: str | None = None          # set by the transport's abort(), under lock
        self.active = False                      # a run() is in progress (it owns the sockets)
        self.lock = threading.Lock()
        self.abort_hook: Callable[[], None] | None = None   # sends ABORT frames (the transport's)
        self._fd_rank = {p.fd: r for r, p in peers.items()}
        self.sendq: dict[int, collections.deque[list[memoryview]]] = {r: collections.deque() for r in peers}
        self.recvq: dict[int, collections.deque[_Recv]] = {r: collections.deque() for r in peers}
        self._tx: dict[int, int] = {}
        self._rx: dict[int, int] = {}
        self._rx_done: dict[int, int] = {}
        self._quiet: set[int] = set()
        self._mid: set[int] = set()              # peers whose first queued frame is partly sent
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
        self._tx.clear()
        self._rx.clear()
        self._rx_done.clear()
        self._quiet.clear()

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
        self.recvq[peer].append(_Recv(HEADER.pack(FRAME_MAGIC, DATA, 0, seq, word1, numel, i, len(view)),
                                      view, done))

    # -- running ---------------------------------------------------------------------------
    def run(self) -> None:
        """Move every queued frame; raises the operation's error (and leaves the queues empty).

        An ``abort`` from another thread while this runs wakes the wait; this thread, which
        owns the sockets, then sends the ABORT frames itself once its streams are settled.
        """
        with self.lock:
            if self.aborted is not None:
                self._fail()
                raise self._ctx().error(GroupAbortedError, f"the group was aborted on this rank: {self.aborted}")
            self.active = True
        try:
            while True:
                progressed = False
                for r, q in self.sendq.items():
                    if q and self._push(r, q):
                        progressed = True
                pending = False
                for r, rq in self.recvq.items():
                    if rq:
                        if self._pull(r, rq):
                            progressed = True
                        pending = pending or bool(rq)
                if not pending and not any(self.sendq.values()):
                    break
                if not progressed:
                    self._wait()
        except BaseException:
            self._fail()
            with self.lock:
                self.active = False
                if self.aborted is not None and self.abort_hook is not None:
                    self.abort_hook()
            raise
        with self.lock:
            self.active = False

    def _push(self, r: int, q: collections.deque[list[memoryview]]) -> bool:
        sock = self.peers[r].sock
        progressed = False
        while q:
            frame = q[0]
            try:
                n = sock.sendmsg(frame)
            except BlockingIOError:
                return progressed
            except OSError as e:
                self._inspect(r)       # a peer that aborted or left said so before it closed
                raise peer_lost(self._ctx(), self.peers[r], e) from None
            progressed = True
            while frame and n >= len(frame[0]):
                n -= len(frame.pop(0))
            if frame:
                frame[0] = frame[0][n:]
                self._mid.add(r)
                return progressed
            q.popleft()
            self._mid.discard(r)
        return progressed

    def _pull(self, r: int, q: collections.deque[_Recv]) -> bool:
        sock = self.peers[r].sock
        progressed = False
        while q:
            it = q[0]
            try:
                while True:
                    if it.hgot < len(it.buf):            # the header (with a small frame's payload)
                        n = sock.recv_into(memoryview(it.buf)[it.hgot:])
                        if n == 0:
                            raise peer_lost(self._ctx(), self.peers[r], None)
                        progressed = True
                        before, it.hgot = it.hgot, it.hgot + n
                        if before < HSIZE <= it.hgot and it.buf[:HSIZE] != it.expect:
                            raise self._bad_header(r, it)
                    elif len(it.buf) > HSIZE:            # small frame complete: header checked
                        it.view[:] = memoryview(it.buf)[HSIZE:]
                        break
                    elif it.got < len(it.view):          # large frame: straight into the tensor
                        n = sock.recv_into(it.view[it.got:])
                        if n == 0:
                            raise peer_lost(self._ctx(), self.peers[r], None)
                        progressed = True
                        it.got += n
                    else:
                        break
            except BlockingIOError:
                return progressed
            except (ConnectionError, TimeoutError) as e:
                raise peer_lost(self._ctx(), self.peers[r], e) from None
            q.popleft()
            self._rx_done[r] = self._rx_done.get(r, 0) + 1
            if it.done is not None:
                it.done()
        return progressed

    def _ctx(self) -> OpContext:
        if self.ctx is None:
            raise AssertionError("Pump.run() without begin()")
        return self.ctx

    # -- waiting ---------------------------------------------------------------------------
    def _wait(self) -> None:
        ctx = self._ctx()
        poller = select.poll()
        waited_on = []
        for r, p in self.peers.items():
            mask = (_IN if self.recvq[r] else 0) | (_OUT if self.sendq[r] else 0)
            if mask:
                poller.register(p.fd, mask)
                waited_on.append(r)
            elif r not in self._quiet and p.gone is None:
                poller.register(p.fd, _IN)
        poller.register(self.wake_fd, _IN)
        t0 = time.monotonic()
        remaining = ctx.deadline - t0
        if remaining <= 0:
            raise self._timeout(waited_on)
        events = poller.poll(remaining * 1000.0)
        waited = time.monotonic() - t0
        self.wait_s += waited
        for r in waited_on:
            self.late_s[r] = self.late_s.get(r, 0.0) + waited
        if not events:
            raise self._timeout(waited_on)
        for fd, _ev in events:
            if fd == self.wake_fd:
                raise ctx.error(GroupAbortedError, f"the group was aborted on this rank: {self.aborted}")
            r = self._fd_rank[fd]
            if not self.recvq[r] and not self.sendq[r]:
                self._inspect(r)

    def _inspect(self, r: int) -> None:
        """A peer this rank does not wait on sent something: an ABORT fails us now."""
        p = self.peers[r]
        self._quiet.add(r)
        try:
            raw = p.sock.recv(HSIZE + MAX_REASON, socket.MSG_PEEK)
        except BlockingIOError:
            return
        except OSError:
            p.gone = p.gone or "eof"
            return
        if not raw:
            p.gone = p.gone or "eof"
            return
        if len(raw) >= HSIZE:
            magic, kind, _seq, _w1, _numel, _idx, nbytes = parse_header(raw[:HSIZE])
            if magic == FRAME_MAGIC and kind == ABORT:
                reason = raw[HSIZE:HSIZE + nbytes].decode("utf-8", "replace")
                raise self._ctx().error(GroupAbortedError, f"the group was aborted by rank {r} "
                                        f"({p.where()}): {reason}", aborted_by=r, peer=r)
            if magic == FRAME_MAGIC and kind == BYE:
                p.gone = "bye"

    # -- errors ----------------------------------------------------------------------------
    def _bad_header(self, r: int, it: _Recv) -> DistBackendError:
        ctx, p = self._ctx(), self.peers[r]
        magic, kind, seq, word1, numel, idx, nbytes = parse_header(bytes(it.buf[:HSIZE]))
        want = parse_header(it.expect)
        if magic != FRAME_MAGIC:
            return ctx.error(CollectiveMismatchError, f"rank {r} ({p.where()}) sent bytes that are not a "
                             "ringlet frame (the connection is out of step)", peer=r)
        if kind == ABORT:
            reason = read_reason(p.sock, bytes(it.buf[HSIZE:it.hgot]), nbytes)
            return ctx.error(GroupAbortedError, f"the group was aborted by rank {r} ({p.where()}): {reason}",
                             aborted_by=r, peer=r)
        if kind == BYE:
            p.gone = "bye"
            return peer_lost(ctx, p, None)
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
            todo = len(self.recvq[r])
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
        """After an error: streams with a partly sent or read frame are out of step; drop the queues."""
        for r in self._mid:
            self.peers[r].tx_broken = True
        self._mid.clear()
        for r, rq in self.recvq.items():
            if rq and rq[0].hgot:
                self.peers[r].gone = self.peers[r].gone or "desync"
            rq.clear()
        for q in self.sendq.values():
            q.clear()
