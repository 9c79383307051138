"""What the ``tcp`` transport's reader tracks per frame and per stream (see [Note: tcp routing]).

- :class:`Want`: a posted receive -- the exact header wanted, where the payload goes, and what
  to run once it is there;
- :class:`Early`: a frame read into a private buffer because something behind it was wanted;
- :class:`Inbound`: where the reader is in one connection's stream.
"""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Callable

from ringlet.transport._tcp_wire import HEADER, MAX_REASON

__all__ = ["HSIZE", "Early", "Inbound", "Want", "read_reason"]

HSIZE = HEADER.size


class Want:
    """A posted receive: the exact header wanted, where the payload goes, what to run after.

    The reader fills ``header`` (the header that came) and either reads the payload into
    ``view`` or leaves it in ``early``; ``ok`` is False when the header differed (nothing read).
    """

    __slots__ = ("done", "early", "expect", "finished", "header", "peer", "view")

    def __init__(self, peer: int, expect: bytes, view: memoryview, done: Callable[[], None] | None) -> None:
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
