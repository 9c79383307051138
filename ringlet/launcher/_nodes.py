"""Multi-node coordination among the launchers of one job, through node 0's store.

[Note: node rendezvous]
Node 0's launcher hosts the TCPStore (bound to ``--master-addr``); every other launcher
connects to it with the run token.  Before any worker starts:

1. each node claims ``launcher/node/<rank>`` (compare-and-set: a node rank given twice is
   named) with its host, pid, ``--nnodes``, ``--nproc-per-node``, ``--max-restarts`` and
   ringlet's version;
2. node 0 waits up to ``--rdzv-timeout`` for every node, compares the fields, and publishes
   ``launcher/go`` (the run id every node gives its workers) or ``launcher/error``, which names
   the nodes that never arrived or the field and the nodes that disagree;
3. the other nodes wait for either key.

Each generation ``g`` (restart) starts with a barrier on ``launcher/gen<g>/ready/<rank>``.  A
node whose worker fails publishes ``launcher/gen<g>/failed`` (first one wins); every node watches
it while its workers run and stops them at once.  A node whose workers all succeeded publishes
``launcher/gen<g>/done/<rank>`` and waits for the job's outcome: success when every node is done,
a restart (or the end) when one failed.  Launchers beat ``launcher/hb/<rank>`` every second; a
node whose beat stops for ``HEARTBEAT_S`` counts as failed.  Node 0 keeps the store up until
every node said ``launcher/exit/<rank>`` (bounded), so no worker loses it early.

Nothing here polls: every wait is a ``store.wait`` parked in the store's server until its keys
appear (``launcher/decided`` once node 0 published the run id or the error; a node's queue
``launcher/gen<g>/wake/<rank>``, to which each ``done`` and ``failed`` pushes, counts as present
while it holds an event), bounded by the beat period so that heartbeats keep going.
"""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ringlet.errors import DistError, DistStoreError

__all__ = ["NodeRendezvous", "RendezvousFailed", "launcher_version"]

HEARTBEAT_S = 30.0       # a node silent this long is taken for dead
BEAT_PERIOD_S = 1.0
EXIT_WAIT_S = 30.0       # node 0 waits this long for the others to leave before closing the store
_FIELDS = ("nnodes", "nproc_per_node", "max_restarts", "version")


def launcher_version() -> str:
    try:
        from importlib.metadata import version

        return version("ringlet")
    except Exception:  # noqa: BLE001 - not installed as a distribution: source tree
        return "source"


class RendezvousFailed(Exception):
    """The nodes could not agree (message says who and what); the launcher exits 1."""


@dataclass(frozen=True)
class Outcome:
    """How a generation ended for the whole job."""

    state: str                      # "succeeded", "failed" or "interrupted"
    report: dict[str, Any] | None   # the failing node's report (None when it succeeded)


class NodeRendezvous:
    """This node's side of [Note: node rendezvous]."""

    def __init__(self, store: Any, node_rank: int, nnodes: int, info: dict[str, Any],
                 timeout: float, where: str) -> None:
        self.store = store
        self.rank = node_rank
        self.nnodes = nnodes
        self.info = {**info, "host": socket.gethostname(), "pid": os.getpid()}
        self.timeout = timeout
        self.where = where
        self._next_beat = 0.0
        self._beats: dict[int, tuple[int, float]] = {}

    # -- joining ---------------------------------------------------------------------------
    def join(self, run_id: str) -> str:
        """Steps 1-3; returns the run id every node uses.  Raises :class:`RendezvousFailed`."""
        mine = json.dumps(self.info, sort_keys=True).encode()
        got = self.store.compare_set(f"launcher/node/{self.rank}", b"", mine)
        if got != mine:
            other = json.loads(got)
            self._fail(f"node rank {self.rank} was given twice: to pid {other['pid']} on "
                       f"{other['host']} and to pid {self.info['pid']} on {self.info['host']}")
        if self.rank == 0:
            return self._agree(run_id)
        deadline = time.monotonic() + self.timeout + 5.0   # node 0 answers at its own deadline
        while not self._wait(["launcher/decided"], deadline):
            if time.monotonic() >= deadline:
                raise RendezvousFailed(f"node 0 at {self.where} never started the job within "
                                       f"{self.timeout:.0f} s")
        if self.store.check(["launcher/error"]):
            raise RendezvousFailed(self.store.get("launcher/error").decode())
        return str(json.loads(self.store.get("launcher/go"))["run_id"])

    def _wait(self, keys: list[str], deadline: float) -> bool:
        """Beat, then block until ``keys`` exist, at most a beat period or until ``deadline``."""
        self.beat()
        seconds = min(BEAT_PERIOD_S, deadline - time.monotonic())
        if seconds <= 0:
            return self.store.check(keys)
        try:
            self.store.wait(keys, timedelta(seconds=seconds))
        except DistStoreError as e:
            if e.context.get("timeout") is None:   # not a timeout: the store is gone
                raise
            return False
        return True

    def _agree(self, run_id: str) -> str:
        deadline = time.monotonic() + self.timeout
        keys = [f"launcher/node/{r}" for r in range(self.nnodes)]
        while not self._wait(keys, deadline):
            if time.monotonic() >= deadline:
                infos = {r: json.loads(self.store.get(k)) for r, k in enumerate(keys)
                         if self.store.check([k])}
                missing = [r for r in range(self.nnodes) if r not in infos]
                joined = ", ".join(f"{r} ({i['host']})" for r, i in sorted(infos.items()))
                self._fail(f"nodes {missing} never reached the master at {self.where} within "
                           f"{self.timeout:.0f} s (joined: {joined}); check "
                           "--master-addr/--master-port, "
                           "the token, and that every node was started")
        infos = {r: json.loads(v) for r, v in enumerate(self.store.multi_get(keys))}
        for field in _FIELDS:
            values = {r: i[field] for r, i in infos.items()}
            if len(set(map(str, values.values()))) > 1:
                detail = ", ".join(f"node {r} ({infos[r]['host']}) has {v!r}"
                                   for r, v in sorted(values.items()))
                self._fail(f"nodes disagree on {field}: {detail}")
        hosts = [infos[r]["host"] for r in range(self.nnodes)]
        self.store.set("launcher/go", json.dumps({"run_id": run_id, "hosts": hosts}))
        self.store.set("launcher/decided", b"go")
        return run_id

    def _fail(self, msg: str) -> None:
        self.store.set("launcher/error", msg)
        self.store.set("launcher/decided", b"error")
        raise RendezvousFailed(msg)

    # -- generations -----------------------------------------------------------------------
    def beat(self) -> None:
        """Called often from the launcher's loops; beats at most once a second."""
        now = time.monotonic()
        if now >= self._next_beat:
            self.store.add(f"launcher/hb/{self.rank}", 1)
            self._next_beat = now + BEAT_PERIOD_S

    def start_generation(self, gen: int) -> None:
        """Barrier: every node is ready to start generation ``gen`` (or one gave up meanwhile:
        the caller sees its failure when it first looks)."""
        self.store.set(f"launcher/gen{gen}/ready/{self.rank}", b"1")
        self._wake_all(gen)
        deadline = time.monotonic() + self.timeout
        keys = [f"launcher/gen{gen}/ready/{r}" for r in range(self.nnodes)]
        while not self.store.check(keys):
            if self.store.check([f"launcher/gen{gen}/failed"]):
                return
            if time.monotonic() > deadline:
                missing = [r for r in range(self.nnodes) if not self.store.check([keys[r]])]
                raise RendezvousFailed(f"nodes {missing} did not start restart generation {gen} "
                                       f"within {self.timeout:.0f} s")
            self.wait_event(gen, deadline)

    def wait_event(self, gen: int, deadline: float) -> None:
        """Block until another node marks progress in ``gen`` (ready, done,
        failed) or a beat is due."""
        key = f"launcher/gen{gen}/wake/{self.rank}"
        if self._wait([key], deadline):
            while self.store.queue_len(key):
                self.store.queue_pop(key, block=False)

    def _wake_all(self, gen: int) -> None:
        for r in range(self.nnodes):
            self.store.queue_push(f"launcher/gen{gen}/wake/{r}", str(self.rank))

    def remote_failure(self, gen: int) -> dict[str, Any] | None:
        """The report of the node that failed generation ``gen`` (possibly this one), if any."""
        if self.store.check([f"launcher/gen{gen}/failed"]):
            return dict(json.loads(self.store.get(f"launcher/gen{gen}/failed")))
        return None

    def report_failure(self, gen: int, report: dict[str, Any]) -> dict[str, Any]:
        """Publish this node's failure unless another node's came first;
        returns the one that won."""
        mine = json.dumps({**report, "node": self.rank, "host": self.info["host"]}).encode()
        won = dict(json.loads(self.store.compare_set(f"launcher/gen{gen}/failed", b"", mine)))
        self._wake_all(gen)
        return won

    def wait_outcome(self, gen: int) -> Outcome:
        """After this node's workers succeeded: wait until all nodes are done or one failed."""
        self.store.set(f"launcher/gen{gen}/done/{self.rank}", b"1")
        self._wake_all(gen)
        keys = [f"launcher/gen{gen}/done/{r}" for r in range(self.nnodes)]
        while True:
            failed = self.remote_failure(gen)
            if failed is not None:
                return Outcome("interrupted" if failed.get("interrupted") else "failed", failed)
            if self.store.check(keys):
                return Outcome("succeeded", None)
            silent = self.silent_nodes([r for r in range(self.nnodes)
                                        if not self.store.check([keys[r]])])
            if silent:
                report = {"reason": f"node(s) {silent} stopped answering (no heartbeat for "
                                    f"{HEARTBEAT_S:.0f} s)"}
                return Outcome("failed", self.report_failure(gen, report))
            self.wait_event(gen, time.monotonic() + BEAT_PERIOD_S)

    def silent_nodes(self, ranks: list[int]) -> list[int]:
        """Nodes among ``ranks`` whose heartbeat has not moved for ``HEARTBEAT_S``."""
        now, silent = time.monotonic(), []
        for r in ranks:
            count = int(self.store.add(f"launcher/hb/{r}", 0))
            last = self._beats.get(r)
            if last is None or last[0] != count:
                self._beats[r] = (count, now)
            elif now - last[1] > HEARTBEAT_S:
                silent.append(r)
        return silent

    # -- leaving ---------------------------------------------------------------------------
    def leave(self) -> None:
        """Say goodbye; node 0 also waits (bounded) until every node that joined has read what it
        needs (the error, or the outcome) and left, since the store closes with node 0."""
        try:
            self.store.set(f"launcher/exit/{self.rank}", b"1")
            if self.rank != 0:
                return
            joined = [r for r in range(self.nnodes) if self.store.check([f"launcher/node/{r}"])]
            deadline = time.monotonic() + EXIT_WAIT_S
            while time.monotonic() < deadline:
                staying = [f"launcher/exit/{r}" for r in joined
                           if not self.store.check([f"launcher/exit/{r}"])]
                if not staying or self.silent_nodes([int(k.rsplit("/", 1)[1]) for k in staying]):
                    return
                self._wait(staying, deadline)
        except DistError:
            pass   # the store is gone: nothing left to coordinate
