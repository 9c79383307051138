"""The ``tcp`` transport's frame pump: one collective's sends and receives, with deadlines.

An algorithm queues, per peer, the tensors it will send (``send``) and the ones it expects
(``recv``, with an optional callback run when one has arrived, which may queue more: that is how
ring steps forward chunks as soon as they land).  ``run`` then sends on every connection at once,
non-blocking, while reading each expected frame straight into its tensor after checking its
header ([Note: tcp routing]); the callbacks (the reductions) run as frames complete, so they
overlap the arrival of the next ones.  Sends are ``sendmsg`` of (header, tensor memory) under the
connection's send lock, one whole frame at a time: no copies besides the kernel's.  See
[Note: tcp frames].

Every wait is a ``poll`` bounded by the operation's deadline, on the inbox's wake-up pipe
(readable when the reader completes a frame, a send lock this operation waits for is released,
or the transport is aborted) and the connections it still sends on.  An ABORT from any peer fails
the operation at once; a peer that closes or resets a connection this operation needs is a
``PeerFailureError`` at once; a silent one (cut link, stopped process) a
``CollectiveTimeoutError`` at the deadline naming it.

[Note: tcp I/O overlap]
By default the collective's own thread does everything: ``sendmsg`` until the socket buffer is
full, ``recv_into`` of whatever has arrived, the reductions as frames complete.  The kernel
already overlaps the wire with that work (the send buffer, 4 MiB or more, drains and the receive
buffer fills while the thread reduces); what stays serial is the CPU work of the copies into and
out of the kernel and of the reductions.  With ``RINGLET_TCP_OVERLAP=1`` an operation that
receives two chunks or more is *served*: the transport's reader thread (the one that reads
point-to-point messages between collectives, see [Note: tcp routing]) reads its frames straight
into their tensors while this thread only sends and reduces, woken through the inbox's pipe as
each frame completes (``recv_into``, ``sendmsg`` and torch's kernels release the GIL).  Nothing
else changes: the same frames and receive order, so the same fold order and bits; the same
deadline on this thread's ``poll``; a peer's ABORT, hang-up or reset is seen by the reader, which
wakes this thread to raise it; a failed operation withdraws its receives under the reader's
[busy / discard] protocol.  Smaller operations stay on this thread: a hand-off costs more than it
saves.  It only pays where a spare core exists for the reader -- on a machine whose every core
already runs a rank it is slower (docs/benchmarks.md, "I/O and reduction overlap"), hence off by
default.
"""

from __future__ import annotations

import collections
import ctypes
import select
import time
from collections.abc import Callable

import torch

from ringlet.errors import (
    CollectiveMismatchError,
    CollectiveTimeoutError,
    DistBackendError,
)
from ringlet.transport.base import OpContext, describe_fingerprint
from ringlet.transport.tcp.faults import local_trouble, peer_lost, peer_trouble
from ringlet.transport.tcp.frames import Want
from ringlet.transport.tcp.inbox import Inbox
from ringlet.transport.tcp.mesh import Peer
from ringlet.transport.tcp.outbox import Outbox
from ringlet.transport.tcp.wire import DATA, FRAME_MAGIC, HEADER, parse_header

__all__ = ["Pump", "mv"]

# Receive buffers for partial sums are kept between operations up to this size: a fresh 8 MiB
# tensor costs ~2000 page faults on first touch, a measurable share of a 16 MiB all_reduce.
SCRATCH_CAP = 64 << 20
_OUT = select.POLLOUT


def mv(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous tensor's memory (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


class Pump:
    """Frame queues of one operation at a time on a transport's connections.

    ``chunk`` (bytes) is the pipelining unit of the algorithms (:meth:`cap`).
    """

    def __init__(self, me: int, peers: dict[int, Peer], inbox: Inbox, outbox: Outbox,
                 chunk: int, overlap: bool = False) -> None:
        self.me = me
        self.overlap = overlap                   # [Note: tcp I/O overlap]
        self._served = False                     # the reader thread reads for this operation
        self.peers = peers
        self.inbox = inbox
        self.outbox = outbox
        self.chunk = chunk
        self.sendq: dict[int, collections.deque[list[memoryview]]] = {
            r: collections.deque() for r in peers}
        self._open: dict[int, int] = dict.fromkeys(peers, 0)       # receives posted, not yet run
        self._wants: list[Want] = []
        self._tx: dict[int, int] = {}
        self._rx: dict[int, int] = {}
        self._rx_done: dict[int, int] = {}
        self._held: set[int] = set()             # peers whose send lock this operation holds
        self._mid: set[int] = set()              # peers whose first queued frame is partly sent
        self._stirred: list[int] = []            # other peers whose stream had input lately
        self.ctx: OpContext | None = None
        self._fp = (0, 0, 0)
        self._keep: list[object] = []            # tensors whose memory queued frames use
        self._bufs: dict[torch.dtype, torch.Tensor] = {}
        self.wait_s = 0.0                        # time spent blocked in poll (stats)
        self.wait_since = 0.0                    # when the poll in progress began (0: none)
        self.late_s: dict[int, float] = {}

    # -- what algorithms use --------------------------------------------------------------------
    def cap(self, dtype: torch.dtype) -> int:
        """Elements of ``dtype`` per pipelining chunk."""
        return max(1, self.chunk // dtype.itemsize)

    def scratch(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A reused receive buffer (one per dtype; operations on one transport never overlap)."""
        buf = self._bufs.get(dtype)
        if buf is None or buf.numel() < numel:
            if numel * dtype.itemsize > SCRATCH_CAP:
                return torch.empty(numel, dtype=dtype)
            buf = self._bufs[dtype] = torch.empty(numel, dtype=dtype)
        return buf[:numel]

    def begin(self, ctx: OpContext) -> None:
        """Start a new operation: frame indices restart at 0 for every peer."""
        err = local_trouble(ctx, self.outbox)
        if err is not None:
            raise err
        self.ctx = ctx
        self._fp = ctx.fingerprint()
        self._keep.clear()
        self._wants.clear()
        self._tx.clear()
        self._rx.clear()
        self._rx_done.clear()

    def send(self, peer: int, t: torch.Tensor) -> None:
        """Queue ``t``'s bytes as the next frame to ``peer`` (``t`` is kept alive until the end)."""
        self._keep.append(t)
        payload = mv(t)
        i = self._tx.get(peer, 0)
        self._tx[peer] = i + 1
        seq, word1, numel = self._fp
        frame = [memoryview(HEADER.pack(FRAME_MAGIC, DATA, 0, seq, word1, numel, i, len(payload)))]
        if len(payload):
            frame.append(payload)
        self.sendq[peer].append(frame)

    def recv(self, peer: int, t: torch.Tensor, done: Callable[[], None] | None = None) -> None:
        """Expect the next frame from ``peer`` into ``t``; ``done()`` runs once it is there."""
        self._keep.append(t)
        view = mv(t)
        i = self._rx.get(peer, 0)
        self._rx[peer] = i + 1
        seq, word1, numel = self._fp
        expect = HEADER.pack(FRAME_MAGIC, DATA, 0, seq, word1, numel, i, len(view))
        w = Want(peer, expect, view, done)
        self._open[peer] += 1
        self._wants.append(w)
        self.inbox.want(w)

    # -- running ---------------------------------------------------------------------------
    def run(self) -> None:
        """Move every queued frame; raises the operation's error (and leaves the queues empty).

        An ``abort`` from another thread while this runs wakes the wait; the outbox then sends
        the ABORT frames once this operation's frames are settled (:meth:`Outbox.end`).
        """
        if self.outbox.begin() is not None:
            self._fail()
            raise local_trouble(self._ctx(), self.outbox) or AssertionError("aborted: no reason")
        inbox = self.inbox
        # a frame or two has nothing to overlap with; a thread hand-off costs more than it saves
        overlap = self.overlap and sum(len(w.view) for w in self._wants) >= 2 * self.chunk
        self._served = overlap
        if overlap:
            inbox.serve(True)
        else:
            inbox.take_over()
        try:
            while True:
                progressed = False
                for r, q in self.sendq.items():   # sends first: a callback may overwrite a tensor
                    if q and self._push(r, q):     # that small direct exchanges still send from
                        progressed = True
                # the streams this operation needs, and any other that had something (a message
                # for a waiting receive, an ABORT) at the last wait
                if not overlap and inbox.read_all([r for r, k in self._open.items() if k]
                                                  + self._stirred):
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
            raise
        finally:
            self._release_all()
            if overlap:
                inbox.serve(False)
            else:
                inbox.hand_back()
            self.outbox.end()

    def _settle_received(self) -> bool:
        """Run the callbacks of the receives the reader completed; raise for a bad header."""
        progressed = False
        while True:
            w = self.inbox.next_completed()
            if w is None:
                return progressed
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
            raise self._ctx().error(DistBackendError, f"the stream to rank {r} ({p.where()}) was "
                                    "cut mid-frame by an earlier error; the group cannot be used",
                                    peer=r)
        if r not in self._held:
            if not self.outbox.hold(r):    # a point-to-point frame is going out: woken at its end
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
        self.outbox.release(r)
        return progressed

    def _last_words(self, r: int) -> None:
        """Sending to ``r`` failed: read what it sent before it closed (this thread reads while
        the operation runs; briefly, since an ABORT or BYE is already there if it was sent)."""
        if self._served:                           # the reader thread reads: wait for its verdict
            self.inbox.await_end(r, 0.2)
            self._check_peers(r)
            return
        deadline = time.monotonic() + 0.2
        fd = self.peers[r].fd
        while True:
            self.inbox.read_all([r])
            self._check_peers(r)
            events = self.inbox.poll_set().get(fd)
            remaining = deadline - time.monotonic()
            if not events or remaining <= 0:       # held or ended: nothing more to read
                return
            poller = select.poll()
            poller.register(fd, events)
            if not poller.poll(remaining * 1000.0):
                return

    def _release_all(self) -> None:
        for r in self._held:
            self.outbox.release(r)
        self._held.clear()

    def _ctx(self) -> OpContext:
        if self.ctx is None:
            raise AssertionError("Pump.run() without begin()")
        return self.ctx

    # -- waiting ---------------------------------------------------------------------------
    def wait_total(self) -> float:
        """Seconds blocked waiting for peers so far, the poll in progress included (read by the
        straggler report from another thread)."""
        since = self.wait_since
        return self.wait_s + (time.monotonic() - since if since else 0.0)

    def _needed(self) -> list[int]:
        return [r for r in self.peers if self._open[r] or self.sendq[r]]

    def _check_peers(self, only: int | None = None) -> None:
        """Fail now on an ABORT from any peer, or on a needed peer that is gone or out of step."""
        ctx = self._ctx()
        err = local_trouble(ctx, self.outbox)
        for r in list(self.inbox.aborted_by):
            err = err or peer_trouble(ctx, self.inbox, self.peers[r])
        for r in ([only] if only is not None else self._needed()):
            err = err or peer_trouble(ctx, self.inbox, self.peers[r],
                                      gone_matters=bool(self._open[r]) or only is not None)
        if err is not None:
            raise err

    def _wait(self) -> None:
        ctx = self._ctx()
        poller = select.poll()
        waited_on = self._needed()
        # reading threads poll the connections for input; with overlap that is the reader thread,
        # which wakes this one (notify_fd) as frames complete
        events = {} if self._served else self.inbox.poll_set()
        for r in waited_on:
            if self.sendq[r] and (r in self._held or self.outbox.free(r)):
                fd = self.peers[r].fd
                events[fd] = events.get(fd, 0) | _OUT
        events[self.inbox.notify_fd] = select.POLLIN
        for fd, ev in events.items():
            poller.register(fd, ev)
        t0 = time.monotonic()
        remaining = ctx.deadline - t0
        if remaining <= 0:
            raise self._timeout(waited_on)
        self.wait_since = t0
        try:
            ready = poller.poll(remaining * 1000.0)
        finally:
            self.wait_since = 0.0
        waited = time.monotonic() - t0
        self.wait_s += waited
        for r in waited_on:
            self.late_s[r] = self.late_s.get(r, 0.0) + waited
        for fd, ev in ready:
            if fd == self.inbox.notify_fd:
                self.inbox.drain()
                continue
            peer = self.inbox.polled(fd, ev)
            if peer is not None and not self._open[peer]:
                self._stirred.append(peer)
        if not ready:
            raise self._timeout(waited_on)

    # -- errors ----------------------------------------------------------------------------
    def _bad_header(self, r: int, w: Want) -> DistBackendError:
        ctx, p = self._ctx(), self.peers[r]
        got = w.header or bytes(HEADER.size)
        magic, kind, seq, word1, numel, idx, nbytes = parse_header(got)
        want = parse_header(w.expect)
        if magic != FRAME_MAGIC:
            return ctx.error(CollectiveMismatchError, f"rank {r} ({p.where()}) sent bytes that are "
                             "not a ringlet frame (the connection is out of step)", peer=r)
        mine = f"rank {self.me}: {ctx.describe()}"
        theirs = f"rank {r}: {describe_fingerprint((seq, word1, numel))}"
        if (seq, word1, numel) != want[2:5] or kind != DATA:
            return ctx.error(CollectiveMismatchError,
                             f"ranks called different collectives: {mine}; {theirs}",
                             calls=[mine, theirs], peer=r)
        return ctx.error(CollectiveMismatchError,
                         f"rank {r} sent frame {idx} of {nbytes} bytes, rank {self.me} expected "
                         f"frame {want[5]} of {want[6]} bytes ({ctx.describe()}): the ranks' "
                         "arguments differ", peer=r)

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
                         f"timed out waiting for ranks {waited_on} over tcp ({'; '.join(parts)}); "
                         "no bytes came in time: a cut link, a stopped process, or a rank that "
                         "never called this",
                         missing=waited_on, peer=first.rank if first else -1,
                         host=first.host if first else None)

    def _fail(self) -> None:
        """After an error: streams with a partly sent frame are out of step; drop the queues, and
        make sure the reader writes nothing more into this operation's tensors."""
        for r in self._mid:
            self.outbox.cut(r)
        self._mid.clear()
        self._release_all()
        self.inbox.abandon(self._wants)
        self._wants.clear()
        for r in self._open:
            self._open[r] = 0
        for q in self.sendq.values():
            q.clear()
