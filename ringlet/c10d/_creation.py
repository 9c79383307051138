"""Group creation that cannot stall: the world's agreement on each creation, and set-up waits
that watch the ranks they wait for.

[Note: group creation]
Every rank of the world calls ``new_group`` (``DeviceMesh``, ``split_group``,
``new_subgroups*``) for every group, member or not, in the same order.  Each such call is one
*creation* ``#n`` (a per-world counter): before any transport is built, every rank publishes the
rank lists (and backend) of its creation ``#n`` under ``create/<n>/<rank>`` in the world's store
and reads everyone's.  Ranks that passed different lists -- or that reached the same point by
different calls -- all raise the same ``ValueError`` naming each rank's lists, instead of
building different groups or waiting on each other.  A mesh publishes all of its groups as one
creation, so that costs one exchange per mesh.  (``use_local_synchronization=True``: members
only call, so there is no world-wide agreement; the members meet in the set-up.)

No wait of a creation (the agreement, then the transport's set-up, whose store is wrapped by
:class:`SetupStore`) trusts that the awaited ranks will come: it waits in slices, and between
slices looks at the world's ``trouble`` log and at the awaited ranks' processes:

- ``destroy_process_group`` appends ``left <rank>``: a rank that gave up (an exception, then
  its ``finally``) is named at once by every rank that waits for it;
- a rank whose transport set-up raised appends ``failed <group id> <rank> <error>``: the other
  members stop waiting for it and raise its error;
- a rank of this host whose process is gone (killed, or exited without
  ``destroy_process_group``) is seen through its pid from the rendezvous.

Each ends the wait with ``PeerFailureError`` naming the rank; only a rank that is alive and
somewhere else (it skipped the call) is named at the timeout.  The outcome never depends on
how fast the ranks are, only how soon it is known.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from datetime import timedelta
from typing import Any

from ringlet._segments import _alive as _running  # exists and is not a zombie
from ringlet.errors import DistStoreError, PeerFailureError
from ringlet.store import PrefixStore

__all__ = ["SetupStore", "agree", "note_failure", "note_left"]

TROUBLE = "trouble"        # world-store key: one line per event (see the Note)
FIRST_SLICE = 0.05         # seconds of the first wait slice; doubled up to MAX_SLICE
MAX_SLICE = 1.0


def note_left(store: Any, rank: int, why: str) -> None:
    """Record in the world's trouble log that ``rank`` left the world (best effort)."""
    _append(store, f"left {rank} {why}")


def note_failure(store: Any, gid: str, rank: int, err: BaseException) -> None:
    """Record that ``rank``'s set-up of group ``gid`` raised ``err`` (best effort)."""
    text = f"{type(err).__name__}: {err}".replace("\n", " ")[:500]
    _append(store, f"failed {gid} {rank} {text}")


def _append(store: Any, line: str) -> None:
    try:
        store.append(TROUBLE, f"{line}\n")
    except Exception:  # noqa: BLE001, S110 - the local error is what matters; peers time out
        pass


class _Watch:
    """What a creation's waits look at between slices: the trouble log and the processes of the
    awaited ranks that share this host."""

    def __init__(self, w: Any, gid: str | None, what: str) -> None:
        self.w = w
        self.gid = gid
        self.what = what

    def problem(self, suspects: list[int]) -> PeerFailureError | None:
        """Why one of ``suspects`` (global ranks) will never come, if known."""
        store = self.w.store
        if store.check([TROUBLE]):
            for line in store.get(TROUBLE).decode("utf-8", "replace").splitlines():
                found = self._read(line, suspects)
                if found is not None:
                    return found
        for r in suspects:
            pid = self._pid_of(r)
            if pid is not None and not _running(pid):
                return self._error(r, f"rank {r} (pid {pid}) exited or died before joining")
        return None

    def _read(self, line: str, suspects: list[int]) -> PeerFailureError | None:
        kind, _, rest = line.partition(" ")
        if kind == "left":
            who, _, why = rest.partition(" ")
            if who.isdigit() and int(who) in suspects:
                return self._error(int(who), f"rank {who} left the world ({why}) before joining")
        elif kind == "failed":
            gid, _, rest = rest.partition(" ")
            who, _, why = rest.partition(" ")
            if gid == self.gid and who.isdigit() and int(who) in suspects:
                return self._error(int(who), f"rank {who} failed to set up the group: {why}")
        return None

    def _error(self, peer: int, what: str) -> PeerFailureError:
        return PeerFailureError(f"[rank {self.w.rank}] {self.what}: {what}", rank=self.w.rank,
                                peer=peer, group=self.what)

    def _pid_of(self, r: int) -> int | None:
        """Rank ``r``'s pid when it runs on this host as another process (None otherwise); read
        once per world from the rendezvous, and only when a wait is slow."""
        w = self.w
        pids: dict[int, int] | None = w.__dict__.get("peer_pids")
        if pids is None:
            pids = {}
            w.__dict__["peer_pids"] = pids
            for peer in range(w.world_size):
                if w.hosts[peer] != w.hosts[w.rank]:
                    continue
                try:
                    pid = int(json.loads(w.store.get(f"rdzv/rank/{peer}"))["pid"])
                except Exception:  # noqa: BLE001, S112 - no pid known: watch the log only
                    continue
                if pid != os.getpid():           # ranks that are threads of this process
                    pids[peer] = pid
        return pids.get(r)


def watched_wait(store: Any, keys: list[str], timeout: float, watch: _Watch,
                 suspects: Any) -> None:
    """``store.wait(keys)`` in slices; between them, ``watch.problem(suspects())`` ends it."""
    deadline = time.monotonic() + timeout
    slice_s = FIRST_SLICE
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(slice_s, left), 0.001)))
            return
        except DistStoreError:
            if left <= slice_s:
                raise DistStoreError(f"{watch.what}: wait for keys {keys} timed out after "
                                     f"{timeout:.1f} s; the keys were never set",
                                     keys=keys) from None
        found = watch.problem(suspects())
        if found is not None:
            raise found
        slice_s = min(slice_s * 2, MAX_SLICE)


def agree(w: Any, scope: list[int], lists: list[list[int]], spec: str, what: str) -> None:
    """Creation ``#n`` among the ranks ``scope`` (the world, or the parent group that is split):
    check that every one of them creates the same groups.

    Raises:
        ValueError: ranks passed different rank lists (or backends), naming each rank's.
        PeerFailureError: a rank left, failed or died instead of coming.
        DistStoreError: ranks that did not make this call within the world's timeout.
    """
    if w.rank not in scope:     # a local creation called by a non-member: nothing to agree on
        return
    key = tuple(scope)
    n = w.creations.get(key, 0)
    w.creations[key] = n + 1
    if len(scope) == 1:
        return
    where = "" if len(scope) == w.world_size else f"{list(scope)}"
    mine = json.dumps({"groups": lists, "backend": spec, "call": what})
    tag = hashlib.sha1(repr(key).encode()).hexdigest()[:12]
    keys = {r: f"create/{tag}/{n}/{r}" for r in scope}
    w.store.set(keys[w.rank], mine)
    which = f"group creation #{n}{' among ranks ' + where if where else ''}"
    label = f"{what} ({which})"
    watch = _Watch(w, None, label)

    def missing() -> list[int]:
        return [r for r in scope if not w.store.check([keys[r]])]

    try:
        watched_wait(w.store, list(keys.values()), w.timeout, watch, missing)
    except DistStoreError:
        late = missing()
        raise DistStoreError(
            f"[rank {w.rank}] {label}: ranks {late} did not create a group within "
            f"{w.timeout:.1f} s; every rank of the world (of the group split) creates every "
            "group, member or not, in the same order (use_local_synchronization=True: members "
            "only)", rank=w.rank, missing=late) from None
    calls = dict(zip(scope, (json.loads(v) for v in w.store.multi_get(list(keys.values()))),
                     strict=True))
    if any((c["groups"], c["backend"]) != (lists, spec) for c in calls.values()):
        each = "; ".join(f"rank {r}: {c['call']} {c['groups']} backend {c['backend']!r}"
                         for r, c in calls.items())
        raise ValueError(f"{what}: ranks disagree on the groups of {which}: {each}; every rank "
                         "must create the same groups, in the same order")


class SetupStore(PrefixStore):
    """A group's store for its transport's set-up: ``get`` and ``wait`` watch the group's
    members ([Note: group creation]) instead of trusting that they come."""

    def __init__(self, prefix: str, w: Any, gid: str, ranks: list[int], desc: str) -> None:
        super().__init__(prefix, w.store)
        self._watch = _Watch(w, gid, f"group {desc}")
        self._others = [r for r in ranks if r != w.rank]

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        seconds = (timeout or self.timeout).total_seconds()
        watched_wait(super(), keys, seconds, self._watch, lambda: self._others)

    def get(self, key: str) -> bytes:
        self.wait([key])
        return super().get(key)
