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
import os
import time
from collections.abc import Callable, Sequence

import torch

from ringlet.errors import (
    CollectiveTimeoutError,
    DistBackendError,
    GroupAbortedError,
    PeerFailureError,
)
from ringlet.transport.base import OpContext

MAGIC = 0x52494E474C455431  # "RINGLET1"
VERSION = 1
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
C_STEP, C_PID, C_DEPARTED, C_ENTERED, C_DONE = 0, 8, 9, 10, 11

# Spin before backing off: a flag round trip between two processes costs ~0.7 us
# (measured on a 2-core machine; docs/architecture.md#shared-memory-transport); a wake-up
# from sleep ~70 us.  Spinning is skipped when ranks
# outnumber cores, where it would steal the CPU from the rank being waited on
# (``Arena.share_cpus``: ranks of other groups on the same kernel count too).
SPIN_ITERS = 400
LIVENESS_PERIOD = 0.05    # seconds between liveness checks of waited-on peers
MAX_SLEEP = 1e-3


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
        self.spin_iters = 0
        self.share_cpus(n)
        self._typed: dict[tuple[int, int, torch.dtype], torch.Tensor] = {}
        self.wait_s = 0.0                   # time spent in the slow path of waits
        self.wait_since = 0.0               # when the wait in progress began (0: none; wait_total)
        self.late_s: dict[int, float] = {}  # of which, per rank that arrived last

    def share_cpus(self, busy_ranks: int) -> None:
        """Spin only if ``busy_ranks`` (the ranks of the job on this kernel: the arena's, or more
        when simulated hosts share one machine) fit this process's CPUs; else back off at once."""
        self.spin_iters = SPIN_ITERS if busy_ranks <= usable_cpus() else 0

    # -- header / control fields -------------------------------------------------
    def init_header(self, creator: int) -> None:
        q, lay = self.q, self.layout
        q[H_WORLD], q[H_SLOT], q[H_P2P], q[H_TOTAL] = lay.world_size, lay.slot_bytes, lay.p2p_bytes, lay.total
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
            self.u8[REASON_OFF:REASON_OFF + len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.q[H_ABORT] = 1 + self.rank

    def aborted_error(self, ctx: OpContext | None) -> DistBackendError:
        who = self.q[H_ABORT] - 1
        raw = bytes(self.u8[REASON_OFF:REASON_OFF + REASON_MAX].numpy()).rstrip(b"\0")
        what = f"the group was aborted by rank {who}: {raw.decode('utf-8', 'replace')}"
        if ctx is None:
            return GroupAbortedError(what, aborted_by=who)
        return ctx.error(GroupAbortedError, what, aborted_by=who)

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
        backoff = _Backoff(self, ctx)
        t0 = time.monotonic()
        self.wait_since = t0                # counted by wait_total() while it lasts
        try:
            while True:
                still = [k for k in pending if q[idx[k]] < value]
                if not still:
                    # Blame the wait on the ranks that arrived last (ringlet.distributed.stats()).
                    waited = time.monotonic() - t0
                    self.wait_s += waited
                    for k in pending:
                        self.late_s[ranks[k]] = self.late_s.get(ranks[k], 0.0) + waited
                    return
                pending = still
                backoff.pause([ranks[k] for k in pending])
        finally:
            self.wait_since = 0.0

    def wait_total(self) -> float:
        """Seconds spent waiting for peers so far, the wait in progress included (the straggler
        report reads it from another thread while this rank is blocked)."""
        since = self.wait_since
        return self.wait_s + (time.monotonic() - since if since else 0.0)

    def wait_any_gt(self, idx: Sequence[int], ranks: Sequence[int], values: Sequence[int],
                    ctx: OpContext) -> int:
        """Wait until some ``q[idx[k]] > values[k]``; returns that k (lowest first)."""
        q = self.q
        backoff = _Backoff(self, ctx)
        while True:
            for k in range(len(idx)):
                if q[idx[k]] > values[k]:
                    return k
            backoff.pause(list(ranks))

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
                raise ctx.error(PeerFailureError, f"rank {r} ({self.describe_peer(r)}) left the group "
                                "(destroy_process_group or exit) before joining this operation", peer=r)
            if not self.alive(r):
                raise ctx.error(PeerFailureError, f"rank {r} ({self.describe_peer(r)}) died while this "
                                "rank waited for it", peer=r)

    def _timeout_error(self, ranks: Sequence[int], ctx: OpContext) -> DistBackendError:
        q = self.q
        where = "; ".join(
            f"rank {r} last entered #{q[self.ctrl(r, C_ENTERED)]} and completed #{q[self.ctrl(r, C_DONE)]}"
            for r in ranks)
        return ctx.error(CollectiveTimeoutError, f"timed out waiting for ranks {list(ranks)} ({where}); "
                         f"this rank last completed #{q[self.ctrl(self.rank, C_DONE)]}",
                         missing=list(ranks))

    def release(self) -> None:
        """Drop the views so that the backing memory can be unmapped."""
        self._typed.clear()
        self.memory = None
        self.q.release()
        self._mv.release()
        del self.u8


class _Backoff:
    """Spin briefly, then yield, then sleep with doubling delays; check abort, peers, deadline."""

    __slots__ = ("arena", "ctx", "delay", "next_live", "spins")

    def __init__(self, arena: Arena, ctx: OpContext) -> None:
        self.arena = arena
        self.ctx = ctx
        self.spins = arena.spin_iters
        self.next_live = 0.0
        self.delay = 0.0

    def pause(self, waiting_on: list[int]) -> None:
        arena = self.arena
        if arena.q[H_ABORT]:
            raise arena.aborted_error(self.ctx)
        if self.spins:
            self.spins -= 1
            return
        now = time.monotonic()
        if now >= self.next_live:
            arena._check_peers(waiting_on, self.ctx)
            self.next_live = now + LIVENESS_PERIOD
        if now > self.ctx.deadline:
            raise arena._timeout_error(waiting_on, self.ctx)
        if self.delay < 2e-5:
            os.sched_yield()
            self.delay = self.delay * 2 or 1e-6
        else:
            time.sleep(self.delay)
            self.delay = min(self.delay * 2, MAX_SLEEP)
