"""``Manager``: the object around a training step that lets replicas drop out and rejoin.

Use (docs/fault_tolerance.md)::

    manager = ft.Manager(model, optimizer)
    for batch in batches:
        manager.start_quorum()                    # agree who is alive; heal if behind
        loss = model(batch).loss(); loss.backward()
        manager.allreduce_gradients(model)        # average over the live replicas
        if manager.should_commit():               # every live replica, or none
            optimizer.step()
        optimizer.zero_grad()

Each replica is one process (DDP-like) or ``replica_size`` processes that shard the model among
themselves (``fully_shard`` or TP on :func:`init_replica_group`'s world).  Gradients travel over
a group of the live replicas at each position, rebuilt after every change of membership; a
failed reduction is retried over the survivors within the same step ([Note: quorum rounds]).
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from ringlet import _env
from ringlet.c10d.collectives import all_reduce
from ringlet.c10d.p2p import recv, send
from ringlet.c10d.standalone import standalone_group
from ringlet.errors import CollectiveMismatchError, DistError
from ringlet.ft import _state
from ringlet.ft._quorum import Decision, Member, Quorum, QuorumError, vote
from ringlet.store import PrefixStore

__all__ = ["Manager", "StepReport"]

log = logging.getLogger("ringlet.ft")
_MAX_RETRIES = 3     # a reduction that fails this often with the same members is not a fault
_Flat = tuple[list[torch.Tensor], torch.Tensor]   # gradients of one dtype, their flat sum


@dataclass
class StepReport:
    """What happened to the fault-tolerance machinery so far (``Manager.report``)."""

    committed: int = 0                  # steps this replica committed
    failed_reductions: int = 0          # reductions that failed and were retried over survivors
    lost_micro_batches: int = 0         # replica micro-batches left out of committed steps
    heals_received: int = 0
    heals_sent: int = 0
    reconfigurations: int = 0           # groups rebuilt
    events: list[str] = field(default_factory=list)   # one line per failure, rejoin or heal


def _env_int(name: str, default: int | None = None) -> int:
    raw = os.environ.get(name)
    if raw is None:
        if default is None:
            raise ValueError(f"ringlet.ft: environment variable {name} expected (launch with "
                             "ringlet-run, or pass the argument explicitly)")
        return default
    return int(raw)


def job_store(timeout: float = 300.0) -> Any:
    """The launcher's store (``MASTER_ADDR``/``MASTER_PORT``), prefixed for this run's replicas.
    Every operation gives up after ``timeout`` seconds (a replica cut off from the store fails
    with a store error then, it cannot commit a step the others did not)."""
    from ringlet.store import TCPStore
    host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
    store = TCPStore(host, _env_int("MASTER_PORT"), None, is_master=False,
                     timeout=timedelta(seconds=timeout), wait_for_workers=False)
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    # Replica restarts keep one key space; a whole-job restart starts a fresh one.
    gen = "r" if _env.replica_restarts_only() else os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return PrefixStore(f"ringlet-ft/{run}/{gen}", store)


def init_replica_group(backend: str = "auto", *, store: Any = None, timeout: float = 300.0) -> None:
    """Make this replica's processes the default world (``init_process_group``): its rank is the
    position in the replica (``RANK % RINGLET_REPLICA_SIZE``).  Build the replica's mesh,
    ``fully_shard`` or TP on this world; the :class:`Manager` carries the replica dimension."""
    from ringlet.c10d.world import init_process_group
    size = _env.replica_size()
    rank = _env_int("RANK")
    inc = _env.replica_restart()
    base = store if store is not None else job_store()
    init_process_group(backend, store=PrefixStore(f"replica{rank // size}/inc{inc}", base),
                       rank=rank % size, world_size=size, timeout=timeout)


class Manager:
    """Replica-level fault tolerance around a training step (see the module docstring).

    Args:
        model: this replica's model (plain, ``fully_shard``-ed or TP on the replica's world).
        optimizer: its optimizer; healed with the model.
        stateful: more objects with ``state_dict``/``load_state_dict`` a healing replica copies
            (a learning-rate scheduler, a data position).
        min_replicas: the fewest replicas a step may be committed by (more are waited for up to
            ``join_timeout``, then the step fails with :class:`QuorumError`).
        timeout: seconds any collective of the replica groups may take.
        heartbeat: seconds of silence after which a replica counts as dead.
        join_timeout: seconds a round waits for a live replica that does not arrive.
        backend: ringlet's transport for the groups across replicas.
        store, replica_id, num_replicas, replica_size, position, incarnation: what the launcher
            gives by default (``RANK``, ``WORLD_SIZE``, ``RINGLET_REPLICA_SIZE``,
            ``RINGLET_REPLICA_RESTART`` and its store).
    """

    def __init__(self, model: nn.Module, optimizer: Any = None, *,
                 stateful: Sequence[Any] = (), min_replicas: int = 1, timeout: float = 60.0,
                 heartbeat: float = 2.0, join_timeout: float = 60.0, backend: str = "auto",
                 store: Any = None, replica_id: int | None = None,
                 num_replicas: int | None = None, replica_size: int | None = None,
                 position: int | None = None, incarnation: int | None = None) -> None:
        size = replica_size if replica_size is not None else _env.replica_size()
        rank = _env_int("RANK") if replica_id is None or position is None else 0
        self.replica_id = replica_id if replica_id is not None else rank // size
        self.position = position if position is not None else rank % size
        self.num_replicas = (num_replicas if num_replicas is not None
                             else _env_int("WORLD_SIZE") // size)
        self.replica_size = size
        inc = incarnation if incarnation is not None else _env.replica_restart()
        _check_args(self, min_replicas, timeout, heartbeat, join_timeout)
        self.model, self.optimizer, self.stateful = model, optimizer, list(stateful)
        self.timeout, self.backend = timeout, backend
        self._store = store if store is not None else job_store(timeout)
        self.uid = f"{self.replica_id}.{self.position}.{inc}.{secrets.token_hex(3)}"
        self._layout = _state.layout(model, optimizer, size)
        self._fp = _state.fingerprint(self._layout)
        self._store.set(f"layout/{self.uid}", _state.json_bytes(self._layout))
        self._quorum = Quorum(self._store, self.replica_id, self.position, self.uid,
                              num_replicas=self.num_replicas, replica_size=size,
                              heartbeat=heartbeat, join_timeout=join_timeout,
                              min_replicas=min_replicas)
        self._decision: Decision | None = None
        self._group: Any = None
        self._epoch = -1                 # the decision epoch self._group was built for
        self._broken = False             # the group failed: ask the next round for a new one
        self._step = 0
        self._fresh = True
        self._pending = False
        self.report = StepReport()
        if self._quorum.latest() >= 0:      # the job runs already: ask to be admitted
            self._quorum.announce(self._me())

    # -- queries ----------------------------------------------------------------------------
    @property
    def current_step(self) -> int:
        """Steps committed by this replica (after healing: by the replica it copied)."""
        return self._step

    def num_participants(self) -> int:
        """Replicas taking part in the current step."""
        return len(self._decision.replicas) if self._decision is not None else 0

    def participants(self) -> list[int]:
        """The replica ids taking part in the current step."""
        return list(self._decision.replicas) if self._decision is not None else []

    def __repr__(self) -> str:
        return (f"Manager(replica {self.replica_id}/{self.num_replicas}, position "
                f"{self.position}/{self.replica_size}, step {self._step}, participants "
                f"{self.participants()})")

    # -- the step ---------------------------------------------------------------------------
    def start_quorum(self) -> None:
        """Agree with the live replicas on this step's members; rebuild the groups if they
        changed; receive the state from a live replica if this one is new or behind."""
        self._pending = False
        if not self._settle("step"):
            raise AssertionError("a step round always admits or refuses, got neither")

    def allreduce_gradients(self, params: nn.Module | Iterable[torch.Tensor]) -> bool:
        """Average the gradients of ``params`` over the live replicas; on a failure, retry over
        the survivors.  Returns whether this replica takes part in the step."""
        if self._decision is None:
            raise RuntimeError("allreduce_gradients: call start_quorum() first in each step")
        plist = list(params.parameters() if isinstance(params, nn.Module) else params)
        for p in plist:         # unused this step: zeros, so every replica reduces the same set
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_state._local(p.grad) for p in plist if p.grad is not None]
        same_members = 0
        while True:
            # The sums land in flat buffers; the gradients are overwritten only once the step is
            # committed, so a failed attempt leaves this replica's own gradients to retry with.
            flats, err = self._reduce(grads)
            self._broken = self._broken or err is not None
            if isinstance(err, CollectiveMismatchError):    # a bug in the program, not a fault
                raise err
            if vote(self._store, self._quorum, self._decision.round, self._decision,
                    err is None, self.timeout):
                self._write_back(flats)
                self._pending = True
                return True
            members = self.participants()
            self._note(f"step {self._step}: reduction over replicas {self.participants()} "
                       f"failed ({_short(err) if err else 'a peer failed'}); retrying over "
                       "the live ones")
            self.report.failed_reductions += 1
            if not self._settle("retry"):
                self._note(f"step {self._step}: left out of the retry (too slow); this replica "
                           "heals at the next step")
                self._pending = False
                return False
            same_members = same_members + 1 if self.participants() == members else 0
            if same_members >= _MAX_RETRIES:
                raise QuorumError(f"replica {self.replica_id}: step {self._step}: the gradient "
                                  f"reduction over replicas {members} failed {same_members + 1} "
                                  "times with nobody lost; last error: "
                                  f"{_short(err) if err else 'on another replica'}")

    def should_commit(self) -> bool:
        """Whether to apply this step (every live replica gets the same answer)."""
        if not self._pending:
            return False
        self._pending = False
        self._step += 1
        self._fresh = False
        self.report.committed += 1
        missing = self.num_replicas - self.num_participants()
        if missing:
            self.report.lost_micro_batches += missing
            log.info("step %d committed by %d of %d replicas: the micro-batches of the others "
                     "are not in this update", self._step, self.num_participants(),
                     self.num_replicas)
        return True

    def close(self) -> None:
        """Admit and heal the replicas that asked to rejoin (so they end with the same state),
        then stop the heartbeat and release the groups."""
        if self._decision is not None and self._quorum.pending_joiners(self._decision):
            self.start_quorum()
        self._quorum.close()
        if self._group is not None:
            self._group.destroy()
            self._group = None

    # -- internals ----------------------------------------------------------------------------
    def _me(self) -> Member:
        return Member(self.replica_id, self.position, self.uid, self._step, self._fresh, self._fp,
                      self._broken)

    def _previous(self, q: int) -> Decision | None:
        """Round ``q - 1``'s decision (None before round 0), waited for if still open."""
        if q == 0:
            return None
        if self._decision is not None and self._decision.round == q - 1:
            return self._decision
        return self._quorum.wait_decided(q - 1, time.monotonic())

    def _settle(self, kind: str) -> bool:
        """Rounds until every member has applied one decision (groups rebuilt, replicas healed);
        False when this member was left out of a retry round."""
        while True:
            decision = self._round(kind)
            if decision is None:
                return False
            prev = self._previous(decision.round)
            changed = bool(decision.heal) or prev is None or prev.epoch != decision.epoch
            err: BaseException | None = None
            try:
                self._apply(decision)
            except DistError as e:     # a member died while the groups were rebuilt or healed
                err = e
                self._broken = True
            if not changed and err is None:
                return True
            if vote(self._store, self._quorum, decision.round, decision, err is None,
                    self.timeout, name="setup"):
                return True
            self._note(f"round {decision.round}: setting up replicas {decision.replicas} failed "
                       f"({_short(err) if err else 'on another replica'}); trying again")

    def _round(self, kind: str) -> Decision | None:
        """Rounds until this member is admitted (step) or left out (retry: returns None)."""
        q = self._decision.round + 1 if self._decision is not None else self._quorum.latest() + 1
        while True:
            decision = self._quorum.decide(q, kind, self._me(), self._previous(q))
            if decision.error:
                raise QuorumError(f"replica {self.replica_id}: {decision.error}")
            if self._quorum.slot in decision.refused:
                raise QuorumError(f"replica {self.replica_id} position {self.position}: refused "
                                  f"by the live replicas: {self._difference(decision)}")
            mine = decision.members.get(self._quorum.slot)
            if mine is not None and mine.uid == self.uid:
                return decision
            if kind == "retry":
                return None
            self._quorum.announce(self._me())
            self._decision = None
            q += 1

    def _difference(self, decision: Decision) -> str:
        ref = next(iter(m for m in decision.members.values() if m.pos == self.position), None)
        if ref is None:
            return decision.refused[self._quorum.slot]
        theirs = _state.json_load(self._store.get(f"layout/{ref.uid}"))
        return _state.describe_difference(self._layout, theirs)

    def _apply(self, decision: Decision) -> None:
        before = self._decision
        self._decision = decision
        if before is not None and decision.lost:
            self._note(f"step {self._step}: replica(s) {decision.lost} lost; continuing with "
                       f"{decision.replicas}")
        if decision.epoch != self._epoch:
            self._rebuild(decision)
        self._heal(decision)

    def _rebuild(self, decision: Decision) -> None:
        if self._group is not None:
            self._group.destroy()
            self._group = None
        n = len(decision.replicas)
        if n > 1:
            t0 = time.monotonic()
            # A member that dies while the group forms is waited for this long, then the round
            # is set up again without it (its heartbeat has stopped by then).
            setup_s = min(self.timeout, max(10.0, 5 * self._quorum.heartbeat))
            self._group = standalone_group(
                PrefixStore(f"g{decision.epoch}/{self.position}", self._store),
                decision.replicas.index(self.replica_id), n, backend=self.backend,
                timeout=setup_s, name=f"ft replicas {decision.replicas} pos {self.position}")
            self._group.timeout = self.timeout
            log.debug("replica group %s built in %.1f ms", decision.replicas,
                      (time.monotonic() - t0) * 1e3)
        self._epoch = decision.epoch
        self._broken = False
        self.report.reconfigurations += 1

    def _heal(self, decision: Decision) -> None:
        if not decision.heal:
            return
        with self._quorum.watch(decision, self._abort_for):
            self._transfer(decision)

    def _transfer(self, decision: Decision) -> None:
        for healer, source in sorted(decision.heal.items()):
            if self.replica_id not in (healer, source):
                continue
            peer = decision.replicas.index(healer if self.replica_id == source else source)
            if self.replica_id == source:
                _fault_hook("heal-source", self.replica_id)
                data = _state.pack(_state.state_of(self.model, self.optimizer, self._step,
                                                   self.stateful))
                send(torch.tensor([data.numel()], dtype=torch.int64), group=self._group,
                     group_dst=peer)
                send(data, group=self._group, group_dst=peer)
                self.report.heals_sent += 1
            else:
                n = torch.zeros(1, dtype=torch.int64)
                recv(n, group=self._group, group_src=peer)
                data = torch.empty(int(n.item()), dtype=torch.uint8)
                recv(data, group=self._group, group_src=peer)
                self._step = _state.load_state(self.model, self.optimizer, self.stateful,
                                               _state.unpack(data))
                self._fresh = False
                self.report.heals_received += 1
                if self._step == 0:       # the job's start: every replica takes replica 0's
                    log.info("replica %d: took replica %d's initial state", self.replica_id,
                             source)
                else:
                    self._note(f"healed from replica {source} at step {self._step}")

    def _abort_for(self, dead: list[str]) -> None:
        """Called by the watch thread: a member stopped beating while a collective runs."""
        group = self._group
        if group is not None:
            group.abort(f"replica(s) {sorted(dead)} stopped answering (no heartbeat for "
                        f"{self._quorum.heartbeat:.1f} s)")

    def _reduce(self, grads: list[torch.Tensor]) -> tuple[list[_Flat], BaseException | None]:
        """Sum ``grads`` over the replica group into one flat buffer per dtype (the gradients
        themselves untouched); the error of a failed attempt instead of raising it."""
        if self._group is None or self._decision is None:
            return [], None
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        flats = [(same, torch.cat([g.reshape(-1) for g in same])) for same in by_dtype.values()]
        with self._quorum.watch(self._decision, self._abort_for):
            try:
                for _, flat in flats:
                    all_reduce(flat, group=self._group)
            except DistError as e:
                return [], e
        return flats, None

    def _write_back(self, flats: list[_Flat]) -> None:
        """The committed averages into the gradients."""
        n = self.num_participants()
        for same, flat in flats:
            flat.div_(n)
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def _note(self, line: str) -> None:
        self.report.events.append(line)
        log.warning("replica %d: %s", self.replica_id, line)


def _fault_hook(point: str, rid: int) -> None:
    """Test-only fault injection: ``RINGLET_FT_FAULT=<point>:<replica>`` SIGKILLs that replica's
    first incarnation at ``point`` (docs/reliability.md)."""
    if _env.ft_fault_spec() == f"{point}:{rid}" and _env.replica_restart() == 0:
        os.kill(os.getpid(), signal.SIGKILL)


def _short(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"


def _check_args(m: Manager, min_replicas: int, timeout: float, heartbeat: float,
                join_timeout: float) -> None:
    if not 0 <= m.replica_id < m.num_replicas:
        raise ValueError(f"Manager: replica_id: expected 0 <= replica_id < num_replicas="
                         f"{m.num_replicas}, got {m.replica_id}")
    if not 0 <= m.position < m.replica_size:
        raise ValueError(f"Manager: position: expected 0 <= position < replica_size="
                         f"{m.replica_size}, got {m.position}")
    if not 1 <= min_replicas <= m.num_replicas:
        raise ValueError(f"Manager: min_replicas: expected 1..{m.num_replicas}, got "
                         f"{min_replicas}")
    for name, v in (("timeout", timeout), ("heartbeat", heartbeat),
                    ("join_timeout", join_timeout)):
        if not v > 0:
            raise ValueError(f"Manager: {name}: expected seconds > 0, got {v!r}")
