"""Snapshots of what a test may leak: child processes, threads, /dev/shm segments, listening
sockets."""

from __future__ import annotations

import os
import threading
import time
from typing import Any

SHM_PREFIX = "ringlet-"


def _forkserver_pid() -> int | None:
    try:
        from multiprocessing import forkserver

        return forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]
    except Exception:
        return None


def children() -> set[int]:
    me = str(os.getpid())
    out = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[1] == me and fields[0] != "Z":
            out.add(int(entry))
    for keep in (_forkserver_pid(), _tracker_pid()):
        out.discard(keep if keep is not None else -1)
    return out


def _tracker_pid() -> int | None:
    try:
        from multiprocessing import resource_tracker

        return resource_tracker._resource_tracker._pid  # type: ignore[attr-defined]
    except Exception:
        return None


def threads() -> set[str]:
    return {f"{t.name}#{t.ident}" for t in threading.enumerate() if t.is_alive()}


def shm_segments() -> set[str]:
    try:
        return {n for n in os.listdir("/dev/shm") if n.startswith(SHM_PREFIX)}
    except OSError:
        return set()


def listeners() -> set[str]:
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            parts = line.split()
            if parts[3] == "0A" and parts[9] in inodes:
                found.add(parts[1])
    return found


def snapshot() -> dict[str, set[Any]]:
    return {"children": children(), "threads": threads(), "shm": shm_segments(),
            "listeners": listeners()}


def wait_clean(before: dict[str, set[Any]], grace: float) -> dict[str, list[Any]]:
    """Poll up to ``grace`` seconds for what appeared since ``before`` to go away; return what
    stays."""
    deadline = time.monotonic() + grace
    while True:
        now = snapshot()
        leaked = {k: sorted(now[k] - before[k]) for k in now if now[k] - before[k]}
        if not leaked or time.monotonic() > deadline:
            return leaked
        time.sleep(0.05)
