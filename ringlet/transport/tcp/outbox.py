"""The ``tcp`` transport's sending side: whole frames under one send lock per connection, and the
frames that end a group (ABORT, BYE).

A running collective's pump holds a connection's lock while it has frames queued for it and
releases it between frames, so that a point-to-point message can go in between
([Note: tcp routing]); a pump that finds the lock taken is woken when it is released, not by
a timer.  ``abort`` fails the transport at once: its ABORT frames go out now, or -- while a
collective owns the connections (:meth:`Outbox.begin` .. :meth:`Outbox.end`) -- when that
collective has stopped sending, so that they never land in the middle of one of its frames.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from collections.abc import Callable

from ringlet.transport.tcp.mesh import Peer
from ringlet.transport.tcp.wire import ABORT, BYE, MAX_REASON, header

__all__ = ["Outbox"]

_CHECK_S = 0.05        # a blocked point-to-point send looks at its stop condition this often


class Outbox:
    """Send locks and control frames of one transport's connections; ``wake`` wakes its pump."""

    def __init__(self, peers: dict[int, Peer], wake: Callable[[], None]) -> None:
        self.peers = peers
        self.tx = {r: threading.Lock() for r in peers}
        self._wanted = dict.fromkeys(peers, False)   # a pump waits for this lock
        self._wake = wake
        self.lock = threading.Lock()                  # guards the three fields below
        self.aborted: str | None = None               # this rank aborted the transport: why
        self.closed = False                           # this rank destroyed it
        self._active = False                          # a collective owns the sends
        self._aborts_sent = False

    # -- the running collective ------------------------------------------------------------------
    def begin(self) -> str | None:
        """A collective starts sending; returns the abort reason instead if there is one."""
        with self.lock:
            if self.aborted is None:
                self._active = True
            return self.aborted

    def end(self) -> None:
        """The collective stopped sending; an abort that came meanwhile sends its ABORTs now."""
        with self.lock:
            self._active = False
            if self.aborted is not None:
                self._send_aborts()

    def hold(self, r: int) -> bool:
        """Take ``r``'s send lock if it is free (never waits); a holder that releases it later
        wakes the pump (``wanted`` is set before the try, read after the release)."""
        self._wanted[r] = True
        if self.tx[r].acquire(blocking=False):
            self._wanted[r] = False
            return True
        return False

    def release(self, r: int) -> None:
        self.tx[r].release()

    def free(self, r: int) -> bool:
        return not self.tx[r].locked()

    def cut(self, r: int) -> None:
        """A frame to ``r`` stopped half way: the peer would read what follows as its payload, so
        the stream is ended instead (and marked out of step here)."""
        p = self.peers[r]
        p.tx_broken = True
        try:
            p.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    # -- point to point ----------------------------------------------------------------------------
    def send_frame(self, r: int, frame: list[memoryview], deadline: float, stop: Callable[[], bool],
                   on_timeout: Callable[[], BaseException],
                   on_error: Callable[[OSError], BaseException]) -> None:
        """Send one whole frame to ``r`` under its send lock (blocking, bounded by ``deadline``;
        ``stop()`` is looked at while it waits)."""
        p = self.peers[r]
        if p.tx_broken:
            raise on_error(BrokenPipeError("the stream was cut mid-frame by an earlier error"))
        lock = self.tx[r]
        while not lock.acquire(timeout=_CHECK_S):
            if stop() or time.monotonic() > deadline:
                raise on_timeout()
        started = False
        try:
            while frame:
                if stop():
                    raise on_timeout()
                try:
                    n = p.sock.sendmsg(frame)
                except BlockingIOError:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0:
                        raise on_timeout() from None
                    poller = select.poll()
                    poller.register(p.fd, select.POLLOUT)
                    poller.poll(min(remaining, _CHECK_S) * 1000.0)
                    continue
                except OSError as e:
                    raise on_error(e) from None
                started = True
                while frame and n >= len(frame[0]):
                    n -= len(frame.pop(0))
                if frame:
                    frame[0] = frame[0][n:]
        except BaseException:
            if started and frame:
                self.cut(r)
            raise
        finally:
            lock.release()
            if self._wanted[r]:
                self._wanted[r] = False
                self._wake()

    # -- ending ------------------------------------------------------------------------------------
    def abort(self, reason: str) -> bool:
        """Record the abort (False if one was already recorded) and send the ABORT frames now,
        unless a collective owns the sends (it sends them at :meth:`end`)."""
        with self.lock:
            if self.aborted is not None:
                return False
            self.aborted = reason
            if not self._active:
                self._send_aborts()
            return True

    def _send_aborts(self) -> None:
        """Under ``lock``; best effort, never blocking for long: an ABORT frame where the stream
        is in step, else a shutdown."""
        if self._aborts_sent:
            return
        self._aborts_sent = True
        reason = (self.aborted or "aborted").encode("utf-8", "replace")[:MAX_REASON]
        frame = header(ABORT, 0, 0, 0, 0, len(reason)) + reason
        for r, p in self.peers.items():
            lock = self.tx[r]
            held = lock.acquire(timeout=0.2)    # a point-to-point frame stops within 50 ms
            try:
                if not held or p.tx_broken or p.sock.send(frame) != len(frame):
                    p.tx_broken = True
                    p.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            finally:
                if held:
                    lock.release()

    def close(self) -> None:
        """Say BYE to every peer (a waiting peer reports 'left the group'), close the sockets."""
        bye = header(BYE, 0, 0, 0, 0, 0)
        for r, p in self.peers.items():
            lock = self.tx[r]
            if lock.acquire(timeout=0.1):
                try:
                    if not p.tx_broken and self.aborted is None:
                        p.sock.send(bye)
                except OSError:
                    pass
                finally:
                    lock.release()
            p.close()
