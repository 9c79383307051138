"""Ending every process a generation started, however it detached itself.

Signals to a worker's process group reach the processes it started in that group, but not one
that called ``setsid()``/``setpgid()`` (a daemonised helper, a server a library forked), and a
process whose parent exited is re-parented away from the worker.  So the launcher:

1. becomes a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux): an orphaned descendant of
   a worker is re-parented to the launcher instead of to init, where the launcher can still see it;
2. at teardown, before signalling, records every descendant of every worker (pid and start time, so
   that a recycled pid is never hit), and signals those along with the workers' groups;
3. after the workers are reaped, kills and reaps whatever is left: the recorded descendants still
   alive, and every child of the launcher that is neither a worker nor a process the launcher had
   before the generation started -- i.e. the orphans it inherited -- with all their descendants.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from collections.abc import Iterable

__all__ = ["Reaper", "become_subreaper"]

PR_SET_CHILD_SUBREAPER = 36   # <linux/prctl.h>
_FINISH_S = 2.0               # bound on killing and reaping the leftovers


def become_subreaper() -> bool:
    """Make this process the subreaper of its descendants (Linux); False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(ppid, state, start time) of ``pid`` from /proc, or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), fields[0].decode(), int(fields[19])


def process_table() -> dict[int, tuple[int, str, int]]:
    """pid -> (ppid, state, start time) of every process visible in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            info = _stat(int(entry))
            if info is not None:
                table[int(entry)] = info
    return table


def descendants(roots: Iterable[int], table: dict[int, tuple[int, str, int]]) -> set[int]:
    """Every process below ``roots`` in ``table`` (the roots excluded)."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _state, _start) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


class Reaper:
    """The leftovers of one generation (see the module docstring)."""

    def __init__(self) -> None:
        me = os.getpid()
        # Children the launcher had before this generation (in tests: a
        # forkserver, ...): never ours.
        self._foreign = {p for p, (pp, _s, _t) in process_table().items() if pp == me}
        self._known: dict[int, int] = {}   # descendant pid -> start time, recorded at teardown

    def spare(self, pids: Iterable[int]) -> None:
        """Never count ``pids`` as leftovers (workers of other replicas still running)."""
        self._foreign |= set(pids)

    def record(self, workers: Iterable[int]) -> None:
        """Remember the workers' descendants (call before signalling the workers)."""
        table = process_table()
        for pid in descendants(workers, table) | self._orphans(table, workers):
            self._known[pid] = table[pid][2]

    def targets(self, workers: Iterable[int]) -> set[int]:
        """Recorded descendants still alive, plus inherited orphans and everything below them."""
        table = process_table()
        live = {p for p, start in self._known.items() if p in table and table[p][2] == start}
        roots = live | self._orphans(table, workers)
        return {p for p in roots | descendants(roots, table) if table.get(p, (0, "Z", 0))[1] != "Z"}

    def signal(self, sig: int, workers: Iterable[int]) -> None:
        for pid in self.targets(workers):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def finish(self, workers: Iterable[int]) -> list[int]:
        """SIGKILL every target until none is left (bounded); reap those that are our children.
        Returns the pids it had to kill."""
        workers = list(workers)
        killed: set[int] = set()
        deadline = time.monotonic() + _FINISH_S
        while True:
            left = self.targets(workers)
            self._reap(workers)
            if not left or time.monotonic() > deadline:
                return sorted(killed)
            for pid in left:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
            killed |= left
            time.sleep(0.01)

    def _orphans(self, table: dict[int, tuple[int, str, int]], workers: Iterable[int]) -> set[int]:
        me, skip = os.getpid(), self._foreign | set(workers)
        return {p for p, (pp, _s, _t) in table.items() if pp == me and p not in skip}

    def _reap(self, workers: list[int]) -> None:
        me, skip = os.getpid(), self._foreign | set(workers)   # workers are reaped by their Popen
        for pid, (ppid, state, _start) in process_table().items():
            if ppid == me and state == "Z" and pid not in skip:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, os.WNOHANG)
