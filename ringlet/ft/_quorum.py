"""The store protocol by which replicas agree, round after round, on who is alive.

[Note: quorum rounds]
Every member -- one process, the replica ``rid``'s rank at position ``pos`` -- walks the same
sequence of numbered rounds.  A round is either a *step* round (the start of a training step,
where restarted replicas are admitted) or a *retry* round (inside a step whose gradient
reduction failed; only the previous members take part).  In round ``q`` each member writes its
record under ``q<q>/m/<rid>.<pos>`` (its incarnation ``uid``, committed step count, layout
fingerprint) and then waits for ``q<q>/decision``.  Any waiting member may write the decision,
with ``compare_set`` so that exactly one is ever written, once:

- every expected slot (the previous decision's members; in step rounds also the joiners that
  announced themselves under ``join``) has its record, or
- the missing ones are dead: their process, on this host, is gone; or their heartbeat counter
  ``hb/<uid>`` (bumped by a thread every ``heartbeat/10`` s) has not moved for ``heartbeat``
  seconds; or they left (``gone/<uid>``, written by ``close``); or
- ``join_timeout`` has passed (a replica too slow to arrive is treated as lost).

Only complete replicas (every position present, same layout as the previous members) are
members; the decision's ``epoch`` names the round whose store prefix their groups are built on (a
new one whenever the members change, after a failed step, or when a member's group broke), so a
member that missed rounds still knows whether its group is the current one.  A record written
after the decision is not a member: such a latecomer appends itself to
``join`` and tries the next round, where it is expected.  The same decision therefore reaches
every member, so all members rebuild the same groups and heal the same replicas.

A step is committed by all members or by none: after the reduction each member writes its
vote under ``q<q>/vote/<slot>`` and the first member that sees a ``0`` vote, a dead voter, or
every ``1`` writes ``q<q>/vote-result`` (again with ``compare_set``).  A round whose decision
changes the groups or heals a replica is voted on the same way (``setup``) before the step goes
on, so that a member that dies while the groups form sends every member to the next round.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ringlet.c10d.rendezvous import host_key
from ringlet.errors import DistError, DistStoreError
from ringlet.ft._liveness import Liveness, Watch

__all__ = ["Decision", "JobFinished", "Member", "Quorum", "QuorumError"]



def _await(store: Any, key: str, seconds: float) -> bool:
    """Whether ``key`` exists within ``seconds`` (the store wakes the wait when it is set)."""
    try:
        store.wait([key], timedelta(seconds=seconds))
    except DistStoreError:
        return store.check([key])
    return True


class QuorumError(DistError):
    """The replicas could not agree: too few alive, or this one was refused."""


class JobFinished(QuorumError):
    """A rejoining replica arrived after every live replica had finished and left."""


@dataclass(frozen=True)
class Member:
    """One process's record in a round."""

    rid: int
    pos: int
    uid: str
    step: int
    fresh: bool
    fingerprint: str
    rebuild: bool = False     # this member's group broke: the decision must start a new one

    @property
    def slot(self) -> str:
        return f"{self.rid}.{self.pos}"


@dataclass
class Decision:
    """The outcome of one round: which replicas take part, and who heals from whom."""

    round: int
    kind: str
    members: dict[str, Member]
    replicas: list[int]
    max_step: int
    heal: dict[int, int] = field(default_factory=dict)    # healing replica -> source replica
    refused: dict[str, str] = field(default_factory=dict)  # slot -> why (layout differs)
    lost: list[int] = field(default_factory=list)         # replicas of the last round not here
    error: str = ""
    epoch: int = 0            # the round whose store prefix the members' groups are built on

    def to_json(self) -> bytes:
        members = {s: [m.rid, m.pos, m.uid, m.step, m.fresh, m.fingerprint, m.rebuild]
                   for s, m in self.members.items()}
        return json.dumps({"round": self.round, "kind": self.kind, "members": members,
                           "replicas": self.replicas, "max_step": self.max_step,
                           "heal": {str(k): v for k, v in self.heal.items()},
                           "refused": self.refused, "lost": self.lost,
                           "error": self.error, "epoch": self.epoch}).encode()

    @staticmethod
    def from_json(raw: bytes) -> Decision:
        d = json.loads(raw)
        return Decision(d["round"], d["kind"], {s: Member(*v) for s, v in d["members"].items()},
                        d["replicas"], d["max_step"], {int(k): v for k, v in d["heal"].items()},
                        d["refused"], d["lost"], d["error"], d["epoch"])


class Quorum:
    """One member's side of the protocol ([Note: quorum rounds]) on ``store`` (prefixed per job).

    Args:
        num_replicas: the most replicas the job has (the launcher's ``WORLD_SIZE /
            replica_size``).
        replica_size: processes per replica.
        heartbeat: seconds without a heartbeat after which a missing member counts as dead.
        join_timeout: seconds a round waits for a live member that does not arrive.
        min_replicas: the fewest complete replicas a round may decide on.
    """

    def __init__(self, store: Any, rid: int, pos: int, uid: str, *, num_replicas: int,
                 replica_size: int, heartbeat: float, join_timeout: float,
                 min_replicas: int) -> None:
        self.store, self.rid, self.pos, self.uid = store, rid, pos, uid
        self.num_replicas, self.replica_size = num_replicas, replica_size
        self.heartbeat, self.join_timeout, self.min_replicas = heartbeat, join_timeout, min_replicas
        self.slot = f"{rid}.{pos}"
        self.recheck = min(0.25, heartbeat / 4)   # seconds between looks at missing members
        self.slots = [f"{r}.{p}" for r in range(num_replicas) for p in range(replica_size)]
        self.live = Liveness(store, heartbeat, join_timeout)
        self._watch: Watch | None = None
        self._stop = threading.Event()
        self._beat_store = store.clone()
        self._beater = threading.Thread(target=self._beat, name=f"ringlet-ft-hb-{self.slot}",
                                        daemon=True)
        self._beat_store.add(f"hb/{uid}", 1)
        self._beat_store.set(f"proc/{uid}", json.dumps([host_key(), os.getpid()]))
        self._beat_store.set(f"uid/{self.slot}", uid)
        self._beater.start()

    # -- liveness ---------------------------------------------------------------------------
    def _beat(self) -> None:
        period = max(self.heartbeat / 10.0, 0.01)
        while not self._stop.wait(period):
            try:
                self._beat_store.add(f"hb/{self.uid}", 1)
            except Exception:  # noqa: BLE001 - the store is gone; the rounds will say so
                return

    def alive(self, slot: str, uid: str | None, started: float) -> bool:
        """See :meth:`Liveness.alive`."""
        return self.live.alive(slot, uid, started)

    def watch(self, decision: Decision,
              on_dead: Callable[[list[str]], None]) -> contextlib.AbstractContextManager[None]:
        """While the block runs, ``on_dead(slots)`` is called (once, from another thread) if
        members of ``decision`` stop being alive ([Note: quorum rounds])."""
        if self._watch is None:
            self._watch = Watch(Liveness(self.store.clone(), self.heartbeat, self.join_timeout),
                                self.recheck)
        others = [(s, m.uid) for s, m in decision.members.items() if s != self.slot]
        return self._watch.armed(others, on_dead)

    def close(self) -> None:
        """Stop beating and tell the others this member left on purpose."""
        self._stop.set()
        self._beater.join(timeout=1.0)
        if self._watch is not None:
            self._watch.close()
        try:
            self.store.set(f"gone/{self.uid}", b"1")
        except Exception:  # noqa: BLE001, S110 - the store's host may be gone at the end
            pass
        try:
            self._beat_store.close()
        except Exception:  # noqa: BLE001, S110 - best effort at teardown
            pass

    # -- rounds -----------------------------------------------------------------------------
    def latest(self) -> int:
        """The highest round decided so far (-1 before the first)."""
        return self.store.add("latest", 0) - 1

    def decide(self, q: int, kind: str, me: Member, prev: Decision | None) -> Decision:
        """Take part in round ``q``; returns its decision (which may leave this member out)."""
        self.store.set(f"q{q}/m/{self.slot}", json.dumps(
            [me.rid, me.pos, me.uid, me.step, me.fresh, me.fingerprint, me.rebuild]))
        started = time.monotonic()
        key = f"q{q}/decision"
        # A joiner never decides a round the members run (it may be their retry round).
        proposer = prev is None or (self.slot in prev.members
                                    and prev.members[self.slot].uid == self.uid)
        while True:
            if self.store.check([key]):
                return Decision.from_json(self.store.get(key))
            if not proposer:
                self._check_members_alive(q, prev, started)
            else:
                proposal = self._propose(q, kind, prev, started)
                if proposal is not None:
                    decision = Decision.from_json(
                        self.store.compare_set(key, b"", proposal.to_json()))
                    self._mark_latest(q)
                    return decision
            _await(self.store, key, self.recheck)

    def _check_members_alive(self, q: int, prev: Decision | None, started: float) -> None:
        if prev is None or any(self.alive(s, m.uid, started) for s, m in prev.members.items()):
            return
        if all(self.store.check([f"gone/{m.uid}"]) for m in prev.members.values()):
            raise JobFinished(f"round {q}: replica {self.rid} position {self.pos}: the live "
                              "replicas finished the job (their last round began at step "
                              f"{prev.max_step}) and left before this one could rejoin; "
                              "nothing left to do")
        raise QuorumError(f"round {q}: replica {self.rid} position {self.pos} cannot be admitted: "
                          f"every member of round {q - 1} ({sorted(prev.members)}) is gone, so "
                          "no live replica holds the state to heal from; restart the job from "
                          "its last checkpoint")

    def _mark_latest(self, q: int) -> None:
        """Raise ``latest`` to ``q`` (+1, as stored); never lowers it, never overshoots."""
        have = self.store.add("latest", 0)
        while have < q + 1:
            got = self.store.compare_set("latest", str(have), str(q + 1))
            have = int(got)

    def wait_decided(self, q: int, started: float) -> Decision:
        """Round ``q``'s decision, waiting for it (a joiner that read ``latest`` while round
        ``q`` was still open); raises when every member of the round before is gone."""
        key = f"q{q}/decision"
        while not self.store.check([key]):
            prev_key = f"q{q - 1}/decision"
            if q > 0 and self.store.check([prev_key]):
                self._check_members_alive(q, Decision.from_json(self.store.get(prev_key)),
                                          started)
            _await(self.store, key, self.recheck)
        return Decision.from_json(self.store.get(key))

    def announce(self, member: Member) -> None:
        """Ask the next step round to wait for this member (it was left out of one)."""
        self.store.append("join", f"{member.slot} {member.uid}\n")

    def _joiners(self) -> dict[str, str]:
        if not self.store.check(["join"]):
            return {}
        out = {}
        for line in self.store.get("join").decode().splitlines():
            slot, uid = line.split()
            out[slot] = uid
        return out

    def pending_joiners(self, current: Decision) -> list[str]:
        """Slots of live processes that asked to join and are not members of ``current``."""
        now = time.monotonic()
        out = []
        for slot, uid in self._joiners().items():
            m = current.members.get(slot)
            if (m is None or m.uid != uid) and self.alive(slot, uid, now):
                out.append(slot)
        return sorted(out)

    def _records(self, q: int) -> dict[str, Member]:
        keys = [f"q{q}/m/{s}" for s in self.slots]
        present = [(s, k) for s, k in zip(self.slots, keys, strict=True) if self.store.check([k])]
        if not present:
            return {}
        raws = self.store.multi_get([k for _, k in present])
        return {s: Member(*json.loads(r)) for (s, _), r in zip(present, raws, strict=True)}

    def _expected(self, kind: str, prev: Decision | None) -> dict[str, str | None]:
        """Slot -> the incarnation expected there (None: whoever holds it)."""
        if prev is None:
            return dict.fromkeys(self.slots)
        expected: dict[str, str | None] = {s: m.uid for s, m in prev.members.items()}
        if kind == "step":
            for slot, uid in self._joiners().items():
                old = prev.members.get(slot)
                if old is None or old.uid != uid:
                    expected[slot] = uid
        return expected

    def _propose(self, q: int, kind: str, prev: Decision | None,
                 started: float) -> Decision | None:
        records = self._records(q)
        if kind == "retry" and prev is not None:   # only the last round's members retry
            records = {s: m for s, m in records.items()
                       if s in prev.members and prev.members[s].uid == m.uid}
        expected = self._expected(kind, prev)
        missing = [s for s in expected if s not in records]
        timed_out = time.monotonic() - started > self.join_timeout
        waiting = [s for s in missing if self.alive(s, expected[s], started)]
        if waiting and not timed_out:
            return None
        decision = self._complete(q, kind, records, prev)
        if len(decision.replicas) < self.min_replicas:
            if not timed_out:
                return None
            refused = "; ".join(decision.refused.values()) or "none"
            decision.error = (f"round {q}: {len(decision.replicas)} complete replica(s) "
                              f"{decision.replicas}, fewer than min_replicas={self.min_replicas} "
                              f"after {self.join_timeout:.0f} s; missing {sorted(missing)}; "
                              f"refused: {refused}")
        return decision

    def _complete(self, q: int, kind: str, records: dict[str, Member],
                  prev: Decision | None) -> Decision:
        reference = {p: _reference_fingerprint(
            {s: m for s, m in records.items() if m.pos == p},
            {s: m for s, m in prev.members.items() if m.pos == p} if prev else {})
            for p in range(self.replica_size)}
        refused = {s: (f"replica {m.rid} position {m.pos} has layout {m.fingerprint[:12]}, "
                       f"the others at this position {reference[m.pos][:12]}")
                   for s, m in records.items() if m.fingerprint != reference[m.pos]}
        ok = {s: m for s, m in records.items() if s not in refused}
        replicas = sorted(r for r in range(self.num_replicas)
                          if all(f"{r}.{p}" in ok for p in range(self.replica_size)))
        members = {s: m for s, m in ok.items() if m.rid in replicas}
        max_step = max((m.step for m in members.values()), default=0)
        lost = sorted({m.rid for m in prev.members.values()} - set(replicas)) if prev else []
        decision = Decision(q, kind, members, replicas, max_step, refused=refused, lost=lost)
        decision.heal = _heal_plan(members, replicas, max_step)
        # A new group (on a new store prefix) when the members change, after a failed step
        # (retry: the old group may be aborted) or when a member's group broke; else the same.
        same = prev is not None and sorted((s, m.uid) for s, m in prev.members.items()) == \
            sorted((s, m.uid) for s, m in members.items())
        renew = kind == "retry" or not same or any(m.rebuild for m in members.values())
        decision.epoch = q if renew or prev is None else prev.epoch
        return decision


def _reference_fingerprint(records: dict[str, Member], prev: dict[str, Member]) -> str:
    """The layout of one position: the previous members', or (first round) the most common."""
    if prev:
        return next(iter(prev.values())).fingerprint
    counts: dict[str, int] = {}
    for m in records.values():
        counts[m.fingerprint] = counts.get(m.fingerprint, 0) + 1
    return max(sorted(counts), key=lambda f: counts[f]) if counts else ""


def _heal_plan(members: dict[str, Member], replicas: list[int], max_step: int) -> dict[int, int]:
    """Which replica heals from which: replicas behind (or fresh) copy one at ``max_step``."""
    def state(r: int) -> tuple[int, bool]:
        ms = [m for m in members.values() if m.rid == r]
        return min(m.step for m in ms), any(m.fresh for m in ms)

    current = [r for r in replicas if state(r) == (max_step, False)]
    if not current:                # everyone fresh (the job's start): the lowest replica leads
        current = replicas[:1]
    behind = [r for r in replicas if r not in current]
    return {r: current[i % len(current)] for i, r in enumerate(behind)}


def vote(store: Any, quorum: Quorum, q: int, decision: Decision, ok: bool,
         timeout: float, name: str = "vote") -> bool:
    """Commit round ``q``'s step (or, ``name="setup"``, its set-up) on every member or on none
    ([Note: quorum rounds])."""
    store.set(f"q{q}/{name}/{quorum.slot}", b"1" if ok else b"0")
    key, started = f"q{q}/{name}-result", time.monotonic()
    slots = sorted(decision.members)
    while not store.check([key]):
        verdict = None
        have = [s for s in slots if store.check([f"q{q}/{name}/{s}"])]
        votes = store.multi_get([f"q{q}/{name}/{s}" for s in have]) if have else []
        if any(v == b"0" for v in votes):
            verdict = b"0"
        elif len(have) == len(slots):
            verdict = b"1"
        elif time.monotonic() - started > timeout or not all(
                quorum.alive(s, decision.members[s].uid, started) for s in slots
                if s not in have):
            verdict = b"0"
        if verdict is not None:
            store.compare_set(key, b"", verdict)
            break
        _await(store, key, quorum.recheck)
    return store.get(key) == b"1"
