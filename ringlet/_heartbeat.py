"""Progress beats from a worker to its launcher (``ringlet-run --heartbeat-timeout S``).

A leaf module (standard library only): the c10d layer calls :func:`beat` and the launcher reads
the counter, and neither may import the other.

[Note: heartbeat]
For each worker the launcher creates an 8-byte file (mode 0600, in its private run directory)
holding a native-endian int64 counter, and names it in ``RINGLET_HEARTBEAT_FILE``.  The worker
maps the file once, at its first beat, and every beat adds 1 to the counter in the shared mapping
-- a memory write, no system call, so ringlet calls it on every collective and point-to-point
operation (``ProcessGroup.run``).  Long phases without communication (data preparation, a
validation pass on one rank, checkpoint writing) call ``ringlet.distributed.elastic.heartbeat()``.
The launcher reads every counter a few times per timeout.  A worker is watched from its first beat
on (so slow imports and start-up never count), and one whose counter then stays still for ``S``
seconds is hung: the launcher asks it to print its Python
stacks (``SIGUSR1``, registered with ``faulthandler`` by the worker bootstrap), then kills it,
and the attempt fails (a restart follows while ``--max-restarts`` allows).  Processes the worker
forks share its mapping, so their beats count for it.  When the user's code has returned or
raised, the worker bootstrap writes ``DONE`` (-1) into the counter: an interpreter that takes
longer than ``S`` to exit (tearing down torch can take a second or more on a busy machine) is not
hung, and a worker that raised is reported with its traceback, not as hung.
"""

from __future__ import annotations

import mmap
import os

__all__ = ["DONE", "ENV", "beat", "read_counter"]

ENV = "RINGLET_HEARTBEAT_FILE"
SIZE = 8
DONE = -1   # written by the worker bootstrap once the user's code is over: no longer watched

_view: memoryview | None = None
_opened = False


def _open() -> None:
    global _view, _opened
    _opened = True
    path = os.environ.get(ENV)
    if not path:
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return   # not under a launcher that watches: beats are no-ops
    try:
        if os.fstat(fd).st_size < SIZE:
            return
        _view = memoryview(mmap.mmap(fd, SIZE)).cast("q")
    finally:
        os.close(fd)


def beat() -> None:
    """Tell the launcher this process is making progress (a few tens of nanoseconds).

    A no-op when the process was not started by ``ringlet-run --heartbeat-timeout``.
    """
    if _view is not None:
        _view[0] += 1
    elif not _opened:
        _open()
        if _view is not None:
            _view[0] += 1


def read_counter(view: memoryview) -> int:
    """The launcher's side: the current count of a worker's mapped heartbeat file."""
    return int(view[0])
