"""How the ``tcp`` transport reads a connection's stream, and what it tracks per frame and stream.

- :class:`Want`: a posted receive -- the exact header wanted, where the payload goes, and what
  to run once it is there;
- :class:`Early`: a frame read into a private buffer because something behind it was wanted;
- :class:`Inbound`: where the reader is in one connection's stream;
- :func:`read_stream`: read a stream frame by frame; a :class:`Router` (the ``Inbox``, see
  [Note: tcp routing]) decides where each frame goes.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from ringlet.transport.tcp.wire import HEADER, MAX_REASON

__all__ = ["HSIZE", "Early", "Inbound", "Router", "Want", "drain", "pipe", "poke", "read_reason",
           "read_stream"]

HSIZE = HEADER.size


class Want:
    """A posted receive: the exact header wanted, where the payload goes, what to run after.

    The reader fills ``header`` (the header that came) and either reads the payload into
    ``view`` or leaves it in ``early``; ``ok`` is False when the header differed (nothing read).
    """

    __slots__ = ("done", "early", "expect", "finished", "header", "peer", "view")

    def __init__(self, peer: int, expect: bytes, view: memoryview,
                 done: Callable[[], None] | None) -> None:
        self.peer = peer
        self.expect = expect
        self.view = view
        self.done = done
        self.header: bytes | None = None
        self.early: Early | None = None
        self.finished = False

    @property
    def ok(self) -> bool:
        return self.header == self.expect

    def settle(self) -> None:
        """Copy a privately buffered payload into ``view`` (on the waiting thread)."""
        if self.early is not None and self.ok and len(self.view):
            self.view[:] = self.early.buf


class Early:
    """A frame read into a private buffer because something behind it was wanted."""

    __slots__ = ("buf", "complete", "header", "waiter")

    def __init__(self, header: bytes, nbytes: int) -> None:
        self.header = header
        self.buf = bytearray(nbytes)
        self.complete = False
        self.waiter: Want | None = None


class Inbound:
    """Where the reader is in one connection's stream.

    [busy / discard]: the reading thread sets ``busy``, then looks at ``discard``; a thread
    whose receive gives up sets ``discard`` (and ``watched``), then waits for ``busy`` to drop
    (the reader notifies it).  Either the reader sees ``discard``, or the other thread waits out
    this one ``recv_into``: nothing lands in a tensor whose receive was withdrawn.
    """

    __slots__ = (
        "busy",
        "dest",
        "discard",
        "got",
        "hbuf",
        "header",
        "held",
        "hgot",
        "hup",
        "kind",
        "nbytes",
        "owner",
        "watched",
    )

    def __init__(self) -> None:
        self.hbuf = bytearray(HSIZE)
        self.reset()
        self.busy = False        # the reader is inside recv_into(dest)
        self.watched = False     # a withdrawing thread waits for busy to drop
        self.hup = False         # the peer hung up while its stream was held

    def reset(self) -> None:
        self.hgot = 0
        self.header: bytes | None = None
        self.kind = 0
        self.nbytes = 0
        self.dest: memoryview | None = None
        self.got = 0
        self.owner: Want | Early | None = None
        self.held = False
        self.discard = False     # the owner gave up: read the rest of the payload into scratch


def read_reason(sock: socket.socket, nbytes: int) -> str:
    """An ABORT frame's reason, read for at most one second (blocking on the socket)."""
    want = min(nbytes, MAX_REASON)
    data = bytearray()
    deadline = time.monotonic() + 1.0
    while len(data) < want:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            chunk = sock.recv(want - len(data))
        except BlockingIOError:
            select.select([sock], [], [], remaining)
            continue
        except OSError:
            break
        if not chunk:
            break
        data += chunk
    return data.decode("utf-8", "replace")


class Router(Protocol):
    """Where :func:`read_stream` reports a stream's events."""

    def header(self, r: int, sock: socket.socket) -> bool:
        """A header is complete in ``Inbound.hbuf``; False: stop reading this stream."""

    def frame_done(self, r: int) -> None:
        """The payload of the frame at the head of the stream is complete."""

    def gone(self, r: int, why: str) -> None:
        """The stream ended."""


def read_stream(r: int, st: Inbound, sock: socket.socket, router: Router,
                cv: threading.Condition) -> bool:
    """Read what ``sock`` (peer ``r``) has, frame by frame, until it would block or the frame at
    the head is held; True if anything came.  Non-blocking; ``cv`` is the router's lock."""
    progressed = False
    try:
        while True:
            if st.header is None:
                n = sock.recv_into(memoryview(st.hbuf)[st.hgot:])
                if n == 0:
                    router.gone(r, "eof")
                    return True
                progressed = True
                st.hgot += n
                if st.hgot < HSIZE:
                    continue
                if not router.header(r, sock):
                    return True
                continue
            if st.held:
                return progressed
            if st.got < st.nbytes:
                n = _fill(st, sock, cv)
                if n < 0:                        # not routed after all: leave it held
                    return progressed
                if n == 0:
                    router.gone(r, "eof")
                    return True
                progressed = True
                st.got += n
                if st.got < st.nbytes:
                    continue
            router.frame_done(r)
            progressed = True
    except BlockingIOError:
        return progressed
    except OSError as e:
        router.gone(r, f"reset ({type(e).__name__}: {e})")
        return True


def _fill(st: Inbound, sock: socket.socket, cv: threading.Condition) -> int:
    """One ``recv_into`` of the payload ([busy / discard]); -1 when it has no destination."""
    st.busy = True
    try:
        if st.discard:                   # the owner left: the rest goes to scratch
            st.dest = memoryview(bytearray(st.nbytes))   # (the reader's own fields)
            st.discard = False
            st.owner = None
        dest = st.dest
        if dest is None:
            return -1
        return sock.recv_into(dest[st.got:])
    finally:
        st.busy = False
        if st.watched:
            with cv:
                cv.notify_all()


# -- wake-up pipes ------------------------------------------------------------------------------
def pipe() -> tuple[int, int]:
    """A non-blocking pipe (read end, write end) used as a wake-up."""
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except BlockingIOError:
        pass


def poke(fd: int) -> None:
    try:
        os.write(fd, b".")
    except OSError:               # full (the waiter will look anyway) or closed
        pass
