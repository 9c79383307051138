"""Whether a replica's process is alive: its heartbeat, its pid on this host, its goodbye.

Each member of ``ringlet.ft`` writes, under the job's store prefix, ``uid/<slot>`` (the
incarnation now holding the slot), ``proc/<uid>`` (host key and pid) and bumps ``hb/<uid>``
from a thread; ``gone/<uid>`` says it left on purpose (``Manager.close``).  A process counts as
dead when it left, when it ran on this host and its pid is gone (known at once), when a newer
incarnation holds its slot, or when its heartbeat has not moved for ``heartbeat`` seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from ringlet.c10d.rendezvous import host_key
from ringlet.errors import DistError

__all__ = ["Liveness", "Watch"]


class Liveness:
    """Answers "is it alive?" from the store; remembers when each heartbeat last moved."""

    def __init__(self, store: Any, heartbeat: float, join_timeout: float) -> None:
        self.store, self.heartbeat, self.join_timeout = store, heartbeat, join_timeout
        self._host = host_key()
        self._beats: dict[str, tuple[int, float]] = {}
        self._procs: dict[str, tuple[str, int]] = {}

    def alive(self, slot: str, uid: str | None, started: float) -> bool:
        """Whether the process ``uid`` (None: whichever holds ``slot``) is alive.  A slot nobody
        has started yet counts as alive until ``join_timeout`` after ``started``."""
        now = time.monotonic()
        holder = self.store.get(f"uid/{slot}").decode() if self.store.check([f"uid/{slot}"]) \
            else None
        if holder is None:
            return now - started < self.join_timeout
        if uid is not None and holder != uid:
            return False
        if self.store.check([f"gone/{holder}"]) or self._exited(holder):
            return False
        value = self.store.add(f"hb/{holder}", 0)
        last, since = self._beats.get(holder, (-1, now))
        if value != last:
            self._beats[holder] = (value, now)
            return True
        return now - since < self.heartbeat

    def _exited(self, uid: str) -> bool:
        """Whether ``uid`` ran on this host and its process is gone."""
        if uid not in self._procs:
            if not self.store.check([f"proc/{uid}"]):
                return False
            host, pid = json.loads(self.store.get(f"proc/{uid}"))
            self._procs[uid] = (host, int(pid))
        host, pid = self._procs[uid]
        if host != self._host:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False


class Watch:
    """A thread that, while armed (``with watch.armed(members, on_dead)`` around a collective of
    the step), checks the other members every ``recheck`` seconds and calls ``on_dead(slots)``
    once if some stop being alive: the caller aborts the group, so a frozen or too slow replica
    cannot hold the others for the whole collective timeout.  One per Manager, on a store
    connection of its own."""

    def __init__(self, live: Liveness, recheck: float) -> None:
        self._live, self._recheck = live, recheck
        self._lock = threading.Lock()
        self._job: tuple[list[tuple[str, str]], Callable[[list[str]], None], float] | None = None
        self._wake, self._closed = threading.Event(), False
        self._thread = threading.Thread(target=self._run, name="ringlet-ft-watch", daemon=True)
        self._thread.start()

    @contextlib.contextmanager
    def armed(self, members: list[tuple[str, str]],
              on_dead: Callable[[list[str]], None]) -> Iterator[None]:
        with self._lock:
            self._job = (members, on_dead, time.monotonic())
        self._wake.set()
        try:
            yield
        finally:
            with self._lock:
                self._job = None

    def close(self) -> None:
        self._closed = True
        self._wake.set()
        self._thread.join(timeout=5.0)
        try:
            self._live.store.close()
        except Exception:  # noqa: BLE001, S110 - best effort
            pass

    def _run(self) -> None:
        while not self._closed:
            self._wake.wait()
            time.sleep(self._recheck)
            with self._lock:
                job = self._job
            if job is None:
                self._wake.clear()
                with self._lock:        # armed again between the read and the clear?
                    if self._job is not None:
                        self._wake.set()
                continue
            members, on_dead, started = job
            try:
                dead = [s for s, uid in members if not self._live.alive(s, uid, started)]
            except DistError:
                return
            with self._lock:
                if dead and self._job is job:
                    self._job = None
                    on_dead(dead)
