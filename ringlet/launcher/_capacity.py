"""How many workers this machine can start: ``--nproc-per-node`` is checked before any fork.

``--nproc-per-node 10000`` would otherwise start forking until the kernel refuses, leaving a
half-started job.  The bound is the smallest of what each resource allows (``max_workers`` is
pure and unit-tested; ``read_limits`` reads the machine):

* file descriptors: the launcher holds ``FDS_PER_WORKER`` per worker (output pipes, log files),
  plus ``RESERVED_FDS`` for itself (store, sockets);
* processes: ``RLIMIT_NPROC`` minus the tasks this user already runs (not enforced for root),
  and the kernel's free pids;
* memory: ``MemAvailable`` / ``MIN_WORKER_BYTES`` (a Python interpreter that imports torch needs
  more than that, so this only stops the absurd).
"""

from __future__ import annotations

import dataclasses
import os
import resource

__all__ = ["Limits", "max_workers", "read_limits"]

FDS_PER_WORKER = 6
RESERVED_FDS = 64
MIN_WORKER_BYTES = 32 << 20


@dataclasses.dataclass(frozen=True)
class Limits:
    """What the machine allows (None: no limit known)."""

    open_files: int | None
    user_processes_free: int | None
    pids_free: int | None
    mem_available: int | None


def max_workers(limits: Limits) -> tuple[int, str]:
    """The most workers ``limits`` allow, and which resource sets that bound.

    Example::

        >>> max_workers(Limits(open_files=1024, user_processes_free=None, pids_free=None,
        ...                    mem_available=None))
        (160, 'open files: the limit of 1024 (ulimit -n) allows 160 workers')
    """
    bounds: list[tuple[int, str]] = []
    if limits.open_files is not None:
        n = max(0, (limits.open_files - RESERVED_FDS) // FDS_PER_WORKER)
        bounds.append((n, (f"open files: the limit of {limits.open_files} (ulimit -n) allows "
                           f"{n} workers")))
    if limits.user_processes_free is not None:
        n = max(0, limits.user_processes_free)
        bounds.append((n, f"processes: this user may start {n} more (ulimit -u)"))
    if limits.pids_free is not None:
        bounds.append((limits.pids_free, f"processes: the kernel has {limits.pids_free} free pids"))
    if limits.mem_available is not None:
        n = limits.mem_available // MIN_WORKER_BYTES
        gib = limits.mem_available / (1 << 30)
        bounds.append((n, (f"memory: {gib:.1f} GiB available allows {n} workers of at least "
                          f"{MIN_WORKER_BYTES >> 20} MiB")))
    if not bounds:
        return 1 << 30, "no limit known"
    return min(bounds)


def _tasks() -> tuple[int, int]:
    """(tasks of this user, tasks of everyone), counting threads as the kernel's limits do."""
    mine = total = 0
    uid = os.getuid()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{entry}")
            threads = len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue
        total += threads
        mine += threads if st.st_uid == uid else 0
    return mine, total


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def read_limits() -> Limits:
    """This machine's :class:`Limits`, for this process."""
    soft_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    soft_procs = resource.getrlimit(resource.RLIMIT_NPROC)[0]
    mine, total = _tasks()
    pid_max = _read_int("/proc/sys/kernel/pid_max")
    user_free = None
    if soft_procs != resource.RLIM_INFINITY and os.geteuid() != 0:
        user_free = soft_procs - mine
    return Limits(
        open_files=None if soft_files == resource.RLIM_INFINITY else soft_files,
        user_processes_free=user_free,
        pids_free=None if pid_max is None else max(0, pid_max - total),
        mem_available=_mem_available(),
    )
