"""What the backend keeps per torch job in this process: the store hang reports travel through
and the watchdog that answers them.

ringlet's hang report ([Note: hang reports] in ``ringlet/c10d/debug.py``) asks every rank of a
stuck group, through a store, where it is; each process answers from a watchdog thread.  A ringlet
world starts one in ``init_process_group``; under torch, the backend starts it when torch creates
the default group (the only group whose creator gets no list of global ranks) and every later
group reports through that group's store, which all ranks share.  It stops when torch destroys
the default group.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["JobState", "job"]


class JobState:
    """The default group's store, this rank, its watchdog and the live ringlet groups."""

    def __init__(self) -> None:
        self.store: Any = None
        self.watchdog: Any = None
        self.groups: list[ProcessGroup] = []

    def start(self, store: Any, rank: int) -> None:
        """The default group was created on ``store``: answer hang reports from now on."""
        from ringlet.c10d import debug

        self.stop()
        self.store = store
        self.watchdog = debug.Watchdog(store, rank, threading.get_ident(), self.groups)

    def report_store(self, fallback: Any) -> Any:
        return self.store if self.store is not None else fallback

    def add(self, pg: ProcessGroup) -> None:
        self.groups.append(pg)

    def remove(self, pg: ProcessGroup) -> None:
        if pg in self.groups:
            self.groups.remove(pg)

    def stop(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        self.watchdog, self.store = None, None
        self.groups.clear()


job = JobState()
