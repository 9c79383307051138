"""A shared arena of flags and slots, and the waits on it.

[Note: arena protocol]
One arena serves one group.  It holds, per rank, a control block (a step
counter and liveness/progress fields), two collective slots (double
buffering), and, per ordered pair of ranks, a point-to-point mailbox with two
buffers.  Collectives proceed in *rounds*: in round ``s`` every rank writes its
contribution into its slot ``s % 2`` with a header (``s`` and the operation's
fingerprint), publishes ``step = s``, waits until every peer's step is ``>= s``,
checks the peers' fingerprints, and reads what it needs.  A slot ``b`` is
written again only in round ``s + 2``, which no rank can enter before every
rank has published ``s + 1``, i.e. finished reading round ``s``: one flag wait
per round, no second barrier.  Stores of the data and then of the flag are seen
in that order by other cores on x86-64 (TSO), which is what this relies on.

The arena is backed either by a file in /dev/shm (``ringlet.transport.shm``,
ranks are processes) or by process memory (``ringlet.transport.inproc``, ranks
are threads); the protocol and the algorithms (``arena_algos``, ``arena_p2p``) are the same.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from collections.abc import Callable, Sequence

import torch

from ringlet.errors import (
    CollectiveTimeoutError,
    DistBackendError,
    GroupAbortedError,
    PeerFailureError,
    abort_error_class,
)
from ringlet.transport.arena_wait import (
    FIRST_NAP,
    LIVENESS_PERIOD,
    MAX_SLEEP,
    QUICK_POLLS,
    SPIN_MIN_S,
    Doorbell,
    Spinner,
    current_cpu,
    futex_available,
    sleeper_words,
)
from ringlet.transport.base import OpContext

MAGIC = 0x52494E474C455431  # "RINGLET1"
VERSION = 2               # 2: the futex doorbell and sleeping bytes in the header
HEADER_BYTES = 4096
CTRL_BYTES = 256          # per rank; flag at offset 0, other fields on another cache line
SLOT_HDR = 64             # per slot: step, seq, word1, numel, chunk
P2P_CTRL = 128            # per pair: sent counter at 0, acked counter at 64
ALIGN = 64

# int64 indices in the header
H_MAGIC, H_VERSION, H_WORLD, H_SLOT, H_P2P, H_TOTAL, H_CREATOR = range(7)
H_ABORT = 8               # 0, or 1 + rank that aborted
REASON_OFF = 1024         # utf-8 abort reason, up to REASON_MAX bytes
REASON_MAX = 2048

# int64 offsets inside a control block (in units of int64)
(C_STEP, C_PID, C_DEPARTED, C_ENTERED, C_DONE, C_CPU, C_TOKEN_AT,
 C_TOKEN) = 0, 8, 9, 10, 11, 12, 13, 14

# How waits spin, sleep on the futex doorbell and notice faults: [Note: arena waits] in
# ``arena_wait.py`` (the doorbell and the "sleeping" bytes live in this header).


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask; ``os.cpu_count()`` where unknown)."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclasses.dataclass(frozen=True, slots=True)
class ArenaLayout:
    """Byte offsets of every region; a pure function of (world_size, slot_bytes, p2p_bytes)."""

    world_size: int
    slot_bytes: int
    p2p_bytes: int

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {self.world_size}")
        for name in ("slot_bytes", "p2p_bytes"):
            v = getattr(self, name)
            if v < 1024 or v % ALIGN:
                raise ValueError(f"{name}: expected a multiple of {ALIGN} >= 1024, got {v}")

    @property
    def ctrl_off(self) -> int:
        return HEADER_BYTES

    @property
    def slot_stride(self) -> int:
        return SLOT_HDR + self.slot_bytes

    @property
    def slots_off(self) -> int:
        return self.ctrl_off + self.world_size * CTRL_BYTES

    def slot_hdr_off(self, rank: int, buf: int) -> int:
        return self.slots_off + (rank * 2 + buf) * self.slot_stride

    def slot_data_off(self, rank: int, buf: int) -> int:
        return self.slot_hdr_off(rank, buf) + SLOT_HDR

    @property
    def pair_stride(self) -> int:
        return P2P_CTRL + 2 * (SLOT_HDR + self.p2p_bytes)

    @property
    def p2p_off(self) -> int:
        return self.slots_off + self.world_size * 2 * self.slot_stride

    def pair_off(self, src: int, dst: int) -> int:
        return self.p2p_off + (src * self.world_size + dst) * self.pair_stride

    def mailbox_hdr_off(self, src: int, dst: int, buf: int) -> int:
        return self.pair_off(src, dst) + P2P_CTRL + buf * (SLOT_HDR + self.p2p_bytes)

    @property
    def total(self) -> int:
        return _align(self.p2p_off + self.world_size * self.world_size * self.pair_stride)


def default_p2p_bytes(world_size: int, slot_bytes: int) -> int:
    """Mailbox size: 256 KiB, smaller for big groups (the p2p area grows as world_size**2)."""
    size = 256 * 1024 if world_size <= 8 else 64 * 1024
    return min(size, slot_bytes)


class Arena:
    """Views over an arena's memory plus the waits of the protocol.

    ``alive(rank) -> bool`` is supplied by the backing (pidfd for processes,
    thread liveness for threads).
    """

    def __init__(self, memory: object, layout: ArenaLayout, rank: int,
                 alive: Callable[[int], bool], describe_peer: Callable[[int], str]) -> None:
        self.layout = layout
        self.rank = rank
        self.world_size = layout.world_size
        self.memory = memory
        self._mv = memoryview(memory).cast("B")  # type: ignore[arg-type]
        self.q = self._mv.cast("q")
        self.u8 = torch.frombuffer(memory, dtype=torch.uint8)  # type: ignore[arg-type]
        self.alive = alive
        self.describe_peer = describe_peer
        n = self.world_size
        self.flag_i = [(layout.ctrl_off + r * CTRL_BYTES) // 8 for r in range(n)]
        self.peers = [r for r in range(n) if r != rank]
        self._peer_flags = [self.flag_i[r] for r in self.peers]
        self.spinner = Spinner()
        self.share_cpus(n)
        # The futex doorbell ([Note: arena waits]); None: waits back off on timers instead.
        self.bell: Doorbell | None = Doorbell(memory, rank) if futex_available() else None
        self._sleeper_words = sleeper_words(n) if self.bell is not None else ()
        self.can_sleep = self.bell is not None and self.bell.can_sleep
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.wait_s = 0.0                   # time spent in the slow path of waits
        self.wait_since = 0.0               # when the wait in progress began (0: none; wait_total)
        self.late_s: dict[int, float] = {}  # of which, per rank that arrived last

    def share_cpus(self, busy_ranks: int) -> None:
        """Spin only if ``busy_ranks`` (the ranks of the job on this kernel: the arena's, or more
        when simulated hosts share one machine) fit this process's CPUs; else sleep at once."""
        self.spinner.allowed = busy_ranks <= usable_cpus()

    # -- header / control fields -------------------------------------------------
    def init_header(self, creator: int) -> None:
        q, lay = self.q, self.layout
        q[H_WORLD], q[H_SLOT], q[H_P2P], q[H_TOTAL] = (lay.world_size, lay.slot_bytes,
                                                       lay.p2p_bytes, lay.total)
        q[H_CREATOR], q[H_VERSION] = creator, VERSION
        q[H_MAGIC] = MAGIC

    def check_header(self) -> None:
        q, lay = self.q, self.layout
        got = (q[H_MAGIC], q[H_VERSION], q[H_WORLD], q[H_SLOT], q[H_P2P], q[H_TOTAL])
        want = (MAGIC, VERSION, lay.world_size, lay.slot_bytes, lay.p2p_bytes, lay.total)
        if got != want:
            raise DistBackendError(f"shared arena header mismatch: expected {want}, got {got} "
                                   "(a foreign or stale segment, or ranks with different settings)")

    def ctrl(self, rank: int, field: int) -> int:
        return self.flag_i[rank] + field

    def set_ctrl(self, field: int, value: int) -> None:
        self.q[self.flag_i[self.rank] + field] = value

    # -- typed views -----------------------------------------------------------------
    def slot(self, rank: int, buf: int, dtype: torch.dtype) -> torch.Tensor:
        """The whole data region of ``rank``'s slot ``buf`` as a 1-d tensor of ``dtype``."""
        key = (rank, buf, dtype)
        t = self._typed.get(key)
        if t is None:
            off = self.layout.slot_data_off(rank, buf)
            t = self.u8[off:off + self.layout.slot_bytes].view(dtype)
            self._typed[key] = t
        return t

    def mailbox(self, src: int, dst: int, buf: int) -> torch.Tensor:
        off = self.layout.mailbox_hdr_off(src, dst, buf) + SLOT_HDR
        return self.u8[off:off + self.layout.p2p_bytes]

    # -- abort -----------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        if self.q[H_ABORT]:
            return
        data = reason.encode("utf-8", "replace")[:REASON_MAX]
        self.u8[REASON_OFF:REASON_OFF + REASON_MAX].zero_()
        if data:
            encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.u8[REASON_OFF:REASON_OFF + len(data)].copy_(encoded)
        self.q[H_ABORT] = 1 + self.rank
        self.ring()

    def aborted_error(self, ctx: OpContext | None) -> DistBackendError:
        who = int(self.q[H_ABORT]) - 1
        if not 0 <= who < self.world_size:   # overwritten: never print what it holds as a rank
            what = (f"the group's shared memory was overwritten: its abort record names rank "
                    f"{who}, not a rank of this group of {self.world_size} (a rank or another "
                    "program wrote into the arena)")
            return GroupAbortedError(what) if ctx is None else ctx.error(GroupAbortedError, what)
        raw = bytes(self.u8[REASON_OFF:REASON_OFF + REASON_MAX].numpy()).rstrip(b"\0")
        reason = raw.decode('utf-8', 'replace')
        what = f"the group was aborted by rank {who}: {reason}"
        cls = abort_error_class(reason)     # [Note: abort carries the cause] (ringlet.errors)
        if ctx is None:
            return cls(what, aborted_by=who)
        return ctx.error(cls, what, aborted_by=who)

    # -- posts -----------------------------------------------------------------------
    def notify(self) -> None:
        """Call after storing a flag that a peer may wait for: wakes sleepers, if any (one load
        when none sleeps; [Note: arena waits])."""
        q = self.q
        for i in self._sleeper_words:
            if q[i]:
                self.ring()
                return

    def shares_cpu_with(self, ranks: Sequence[int]) -> bool:
        """Record the CPU this rank runs on; whether one of ``ranks`` last waited on it too."""
        cpu = current_cpu() + 1
        if not cpu:
            return False
        q = self.q
        q[self.flag_i[self.rank] + C_CPU] = cpu
        flag_i = self.flag_i
        return any(q[flag_i[r] + C_CPU] == cpu for r in ranks)

    def ring(self) -> None:
        """Wake every rank sleeping on the doorbell (abort, departure: rare, unconditional)."""
        if self.bell is not None:
            self.bell.ring()

    # -- waits -----------------------------------------------------------------------
    def wait_ge(self, idx: Sequence[int], ranks: Sequence[int], value: int, ctx: OpContext) -> None:
        """Wait until ``q[idx[k]] >= value`` for every k; ``ranks[k]`` is who writes ``idx[k]``.

        Ends by raising: on the deadline (naming the ranks still missing), on a
        dead or departed peer among them, or on the group's abort flag.
        """
        q = self.q
        pending = [k for k in range(len(idx)) if q[idx[k]] < value]
        if not pending:
            if q[H_ABORT]:   # peers may have arrived before the group was aborted: still refuse
                raise self.aborted_error(ctx)
            return
        t0 = time.monotonic()
        for _ in range(QUICK_POLLS):        # the peer is usually about to post: no bookkeeping yet
            still = [k for k in pending if q[idx[k]] < value]
            if not still:
                if q[H_ABORT]:
                    raise self.aborted_error(ctx)
                self._blame([ranks[k] for k in pending], time.monotonic() - t0)
                return
            pending = still
        waiter = _Waiter(self, ctx, t0)
        self.wait_since = t0                # counted by wait_total() while it lasts
        try:
            while True:
                still = [k for k in pending if q[idx[k]] < value]
                if not still:
                    if waiter.spun:
                        self.spinner.waited(waiter.spin_end != 0.0)
                    self._blame([ranks[k] for k in pending], time.monotonic() - t0)
                    return
                pending = still
                if not waiter.spin():
                    waiter.block([ranks[k] for k in pending],
                                 functools.partial(self._all_ge, idx, pending, value))
        finally:
            self.wait_since = 0.0

    def _blame(self, late: list[int], waited: float) -> None:
        """Count a wait, on the ranks that arrived last (``ringlet.distributed.stats()``)."""
        self.wait_s += waited
        for r in late:
            self.late_s[r] = self.late_s.get(r, 0.0) + waited

    def _all_ge(self, idx: Sequence[int], ks: list[int], value: int) -> bool:
        q = self.q
        return all(q[idx[k]] >= value for k in ks)

    def wait_total(self) -> float:
        """Seconds spent waiting for peers so far, the wait in progress included (the straggler
        report reads it from another thread while this rank is blocked)."""
        since = self.wait_since
        return self.wait_s + (time.monotonic() - since if since else 0.0)

    def wait_any_gt(self, idx: Sequence[int], ranks: Sequence[int], values: Sequence[int],
                    ctx: OpContext) -> int:
        """Wait until some ``q[idx[k]] > values[k]``; returns that k (lowest first)."""
        q = self.q
        waiter = _Waiter(self, ctx, time.monotonic())
        while True:
            for k in range(len(idx)):
                if q[idx[k]] > values[k]:
                    return k
            if not waiter.spin():
                waiter.block(list(ranks), lambda: any(q[i] > v for i, v in zip(idx, values)))

    def wait_all_step(self, step: int, ctx: OpContext) -> None:
        q = self.q
        for i in self._peer_flags:          # fast path: everyone is already there
            if q[i] < step:
                self.wait_ge(self._peer_flags, self.peers, step, ctx)
                return
        if q[H_ABORT]:   # a thawed or late rank must not complete a collective its peers gave up on
            raise self.aborted_error(ctx)

    def _check_peers(self, ranks: Sequence[int], ctx: OpContext) -> None:
        for r in ranks:
            if self.q[self.ctrl(r, C_DEPARTED)]:
                raise ctx.error(PeerFailureError, f"rank {r} ({self.describe_peer(r)}) "
                                "left the group (destroy_process_group or exit) before "
                                "joining this operation", peer=r)
            if not self.alive(r):
                raise ctx.error(PeerFailureError, f"rank {r} ({self.describe_peer(r)}) died "
                                "while this rank waited for it", peer=r)

    def _timeout_error(self, ranks: Sequence[int], ctx: OpContext) -> DistBackendError:
        q = self.q
        where = "; ".join(
            f"rank {r} last entered #{q[self.ctrl(r, C_ENTERED)]} and completed "
            f"#{q[self.ctrl(r, C_DONE)]}"
            for r in ranks)
        return ctx.error(CollectiveTimeoutError, f"timed out waiting for ranks {list(ranks)} "
                         f"({where}); this rank last completed #{q[self.ctrl(self.rank, C_DONE)]}",
                         missing=list(ranks))

    def release(self) -> None:
        """Drop the views (and the doorbell's pin) so that the backing memory can be unmapped."""
        if self.bell is not None:
            self.bell.release()
            self.bell = None
            self.can_sleep = False
            self._sleeper_words = ()
        self._typed.clear()
        self.memory = None
        self.q.release()
        self._mv.release()
        del self.u8


class _Waiter:
    """One wait's state: spin until its budget is spent, then sleep on the doorbell (or back off
    on timers without futexes); looks at the abort flag, the peers and the deadline meanwhile.
    See [Note: arena waits] in ``arena_wait.py``."""

    __slots__ = ("arena", "ctx", "nap", "next_live", "planned", "spin_end", "spun", "t0",
                 "yielding")

    def __init__(self, arena: Arena, ctx: OpContext, now: float) -> None:
        self.arena = arena
        self.ctx = ctx
        self.t0 = now
        # Most waits end within SPIN_MIN_S: that much spinning is decided without looking at
        # anything; the rest of the budget only once it has passed (plan()).
        self.spun = arena.spinner.allowed
        self.spin_end = now + SPIN_MIN_S if self.spun else 0.0
        self.planned = self.yielding = False
        self.next_live = now + LIVENESS_PERIOD
        self.nap = FIRST_NAP if arena.can_sleep else 0.0

    def spin(self) -> bool:
        """True while this wait should go on spinning (raises if the group was aborted)."""
        if self.arena.q[H_ABORT]:
            raise self.arena.aborted_error(self.ctx)
        if self.spin_end:
            if time.monotonic() < self.spin_end:
                if self.yielding:
                    os.sched_yield()
                return True
            self.spin_end = 0.0
        return False

    def plan(self, waiting_on: list[int], now: float) -> bool:
        """Extend the spin to the spinner's budget; True if there is any left."""
        self.planned = True
        arena = self.arena
        left = arena.spinner.budget(now) - SPIN_MIN_S
        if left <= 0.0:
            return False
        # The awaited rank last waited on this CPU: spin by handing the CPU over to it.
        self.yielding = arena.shares_cpu_with(waiting_on)
        self.spin_end = now + left
        return True

    def block(self, waiting_on: list[int], ready: Callable[[], bool]) -> None:
        """Spin on if the budget allows; else check the peers (every LIVENESS_PERIOD) and the
        deadline, then sleep a while."""
        arena, ctx = self.arena, self.ctx
        now = time.monotonic()
        if not self.planned and self.plan(waiting_on, now):
            return
        if now >= self.next_live:
            arena._check_peers(waiting_on, ctx)
            self.next_live = now + LIVENESS_PERIOD
        if now > ctx.deadline:
            raise arena._timeout_error(waiting_on, ctx)
        bell = arena.bell
        if bell is not None and arena.can_sleep:
            # Woken by a post, or at the nap's end to bound a missed wake-up and to look at
            # the peers and the deadline (the nap never outlasts either by more than 1 ms).
            bell.sleep(ready, min(self.nap, max(ctx.deadline - now, 0.0) + 1e-3))
            self.nap = min(self.nap * 2, LIVENESS_PERIOD)
        elif self.nap < 2e-5:
            os.sched_yield()
            self.nap = self.nap * 2 or 1e-6
        else:
            time.sleep(self.nap)
            self.nap = min(self.nap * 2, MAX_SLEEP)
