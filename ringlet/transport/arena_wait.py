"""How a rank waits on the arena's flags: spin while it pays, then sleep on a futex doorbell.

[Note: arena waits]
Every wait of the arena protocol (``Arena.wait_ge``, ``wait_any_gt``, ``wait_all_step``) that
does not find its flags set at once runs in two phases; the group's abort flag is looked at in
both, the peers' liveness and the deadline whenever it is about to sleep.

1. **Spin** -- re-read the flags QUICK_POLLS times (~2 us; most waits end there, and cost
   nothing more), then in a loop for at most :meth:`Spinner.budget` seconds.  A flag
   round trip between two processes that both run costs ~1 us here, a futex wake-up of a rank
   whose core went to another task 20-100 us: spinning wins while the awaited rank runs.  So:
   - no spinning at all when the job's ranks on this kernel outnumber the CPUs
     (``Arena.share_cpus``);
   - up to SPIN_MAX_S (200 us) on a quiet machine, up to CONTENDED_SPIN_S (40 us) while it has
     more runnable tasks than CPUs (the running count of ``/proc/loadavg``, sampled at most every
     LOAD_PERIOD by waits that got past their first check; ~2 us a sample);
   - SPIN_MIN_S (5 us) when few recent waits ended while spinning (the awaited rank is usually
     far behind); every PROBE_EVERY-th wait spins fully, to notice when waits get short again;
   - when the awaited rank last waited on this very CPU (each rank records its CPU at the start
     of a wait, ``C_CPU``), it cannot run while this one spins: the spin then yields the CPU
     (``sched_yield``) on every turn.  Measured with two ranks and two busy processes on 2 cores
     (bench/collectives.py --load 2): ranks placed on one CPU took 60-105 us per 8-byte
     all_reduce sleeping on the futex, ~24 us handing the CPU over by yielding; ranks on two
     CPUs ~20 us with a 40 us spin, ~65 us without one (docs/benchmarks.md, "Under load").
     Tried and dropped: sleeping at once instead of yielding once yields had lost the CPU to
     a third task on it.  Pinned there it changed little (106-132 vs 109-127 us a call), and
     unpinned it kept the ranks on one CPU far longer (sleeping ranks look idle to the load
     balancer): 27-72 us per 8-byte all_reduce against 24-34 (bench/waits.py, alternating).
2. **Sleep on the doorbell** -- a 32-bit word in the arena's header (``DOORBELL_OFF``) next to a
   byte per rank saying "this rank sleeps" (``SLEEPERS_OFF``).  A waiter reads the doorbell,
   marks itself sleeping, re-checks its condition, and calls ``FUTEX_WAIT(doorbell, value read,
   timeout)``; then unmarks itself.  A poster stores its flag and then, only if some rank is
   marked sleeping, bumps the doorbell and calls ``FUTEX_WAKE`` (:meth:`Arena.notify`): while
   nobody sleeps, a post costs one extra load.  A bump between the waiter's read and its
   ``FUTEX_WAIT`` makes the call return at once, so that wake-up is not lost.

Missed wake-ups, and why they are bounded.  Python has no memory fence.  On x86-64 a load may
complete before an earlier store of the same core is visible (the store buffer): the poster may
read "nobody sleeps" before its flag is visible, while the waiter, having just marked itself,
still reads the old flag -- each misses the other.  Doorbell bumps are not atomic either (two
posters may write the same value; harmless, as ``FUTEX_WAKE`` wakes every sleeper).  So a sleep
never trusts the wake-up alone: its timeout starts at FIRST_NAP (50 us) and doubles up to
LIVENESS_PERIOD (50 ms).  A missed wake-up costs at most the current timeout, and needs a post
to land in the few nanoseconds in which the waiter's mark is still in its store buffer.

Deadlines and faults.  A sleeper wakes at least every LIVENESS_PERIOD, looks at the abort flag,
the liveness of the peers it waits for and the deadline; abort and departure ring the doorbell,
so sleepers see them at once.  Where futexes are unavailable (not Linux, an unknown architecture,
or ``RINGLET_NO_FUTEX=1``) phase 2 is the older back-off: ``sched_yield``, then sleeps doubling
up to 1 ms.  ``inproc`` (ranks as threads) runs the same code on process memory.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable

from ringlet.transport import _futex

__all__ = ["Doorbell", "Spinner", "contended", "current_cpu"]

DOORBELL_OFF = 128        # header byte offset of the doorbell (its own cache line)
SLEEPERS_OFF = 3072       # header byte offset of the per-rank "sleeping" bytes
MAX_SLEEPERS = 1024       # ranks beyond this never sleep on the doorbell (they back off instead)

LIVENESS_PERIOD = 0.05    # seconds between liveness checks of waited-on peers; longest futex nap
FIRST_NAP = 50e-6         # first futex timeout: the bound on a missed wake-up's cost
MAX_SLEEP = 1e-3          # longest sleep of the back-off without futexes

# Spin budgets ([Note: arena waits]; chosen by measuring bench/collectives.py on 2 cores).
QUICK_POLLS = 16          # re-reads (~2 us) before a wait starts any bookkeeping
SPIN_MAX_S = 200e-6       # quiet machine: covers a peer that copies a 1 MiB chunk meanwhile
CONTENDED_SPIN_S = 40e-6  # busy machine: 10 and 20 us caught fewer co-running peers
SPIN_MIN_S = 5e-6         # when spinning rarely pays: catches a peer just about to post
MIN_HITS = 0.25           # below this share of waits ended while spinning: SPIN_MIN_S
HITS_WEIGHT = 1 / 16      # running average over ~16 waits
PROBE_EVERY = 8           # ... but every 8th wait still spins fully
LOAD_PERIOD = 0.05        # seconds between samples of the machine's runnable tasks


class _Load:
    """Whether more tasks are runnable on this machine than it has CPUs (sampled, cached)."""

    def __init__(self) -> None:
        self.cpus = os.cpu_count() or 1
        self.next = 0.0
        self.busy = False

    def contended(self, now: float) -> bool:
        if now >= self.next:
            self.next = now + LOAD_PERIOD
            self.busy = runnable_tasks() > self.cpus
        return self.busy


def runnable_tasks() -> int:
    """The running count of ``/proc/loadavg`` (runnable tasks now, this reader included); 0 if
    unknown.  Costs ~2 us (an open, a read and a close; no descriptor is kept)."""
    try:
        fd = os.open("/proc/loadavg", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return 0
    try:
        fields = os.read(fd, 128).split()
        return int(fields[3].split(b"/")[0])
    except (OSError, IndexError, ValueError):
        return 0
    finally:
        os.close(fd)


_load = _Load()


def _load_getcpu() -> Callable[[], int]:
    try:
        fn = ctypes.CDLL(None).sched_getcpu       # glibc, musl: ~0.07 us through ctypes
    except (OSError, AttributeError):
        return lambda: -1
    fn.restype = ctypes.c_int
    return fn


_getcpu = _load_getcpu()


def current_cpu() -> int:
    """The CPU this thread runs on now (-1 if unknown)."""
    return int(_getcpu())


def contended(now: float | None = None) -> bool:
    """Whether this machine has more runnable tasks than CPUs (sampled every ``LOAD_PERIOD``)."""
    return _load.contended(time.monotonic() if now is None else now)


class Spinner:
    """How long a wait of one arena may spin (see [Note: arena waits]).

    ``allowed`` is False when the job's ranks outnumber the CPUs: no spinning at all.  Otherwise
    a wait spins up to SPIN_MAX_S on a quiet machine and CONTENDED_SPIN_S on a busy one, as long
    as spinning pays: ``hits``, a running average of "ended while spinning" over the recent waits
    that outlasted their QUICK_POLLS, stays above MIN_HITS.  Below it (the peer is usually far
    behind: waits last longer than any
    spin) a wait spins only SPIN_MIN_S, which still catches a peer just about to post -- and
    those catches raise ``hits`` again when waits get short.
    """

    __slots__ = ("allowed", "hits", "probe")

    def __init__(self) -> None:
        self.allowed = True
        self.hits = 1.0
        self.probe = 0

    def budget(self, now: float) -> float:
        if not self.allowed:
            return 0.0
        if self.hits < MIN_HITS:
            self.probe += 1
            if self.probe % PROBE_EVERY:
                return SPIN_MIN_S
        return CONTENDED_SPIN_S if contended(now) else SPIN_MAX_S

    def waited(self, spun: bool) -> None:
        """A wait ended, while spinning (``spun``) or after it slept."""
        self.hits += ((1.0 if spun else 0.0) - self.hits) * HITS_WEIGHT


class Doorbell:
    """The futex doorbell of an arena and this rank's "sleeping" byte (see [Note: arena waits]).

    ``memory`` is the arena's whole writable buffer.  Holding a ``Futex`` pins that buffer (an
    ``mmap`` cannot be closed meanwhile): :meth:`release` drops it.
    """

    def __init__(self, memory: object, rank: int) -> None:
        self._futex: _futex.Futex | None = _futex.Futex(memory, DOORBELL_OFF)
        mv = memoryview(memory).cast("B")  # type: ignore[arg-type]
        self._u8 = mv
        self._u32 = mv.cast("I")
        self._bell_i = DOORBELL_OFF // 4
        # Ranks past MAX_SLEEPERS have no byte: they never sleep here (``can_sleep``).
        self._mark_i = SLEEPERS_OFF + rank
        self.can_sleep = rank < MAX_SLEEPERS
        self._lock = threading.Lock()       # threads of this rank that sleep share its byte
        self._sleeping = 0
        self.naps = 0                       # futex sleeps so far (tests, diagnostics)

    def ring(self) -> None:
        """Bump the doorbell and wake every sleeper."""
        i = self._bell_i
        self._u32[i] = (self._u32[i] + 1) & 0xFFFFFFFF
        if self._futex is not None:
            self._futex.wake()

    def sleep(self, ready: Callable[[], bool], timeout: float) -> None:
        """Sleep until the doorbell rings or ``timeout`` seconds pass, unless ``ready()`` is
        already true once this rank is marked sleeping."""
        futex = self._futex
        if futex is None or not self.can_sleep:
            return
        seen = self._u32[self._bell_i]
        with self._lock:
            self._sleeping += 1
            self._u8[self._mark_i] = 1
        try:
            if not ready():
                self.naps += 1
                futex.wait(seen, timeout)
        finally:
            with self._lock:
                self._sleeping -= 1
                if not self._sleeping:
                    self._u8[self._mark_i] = 0

    def release(self) -> None:
        self._futex = None
        self._u32.release()
        self._u8.release()


def sleeper_words(world_size: int) -> tuple[int, ...]:
    """int64 indices of the header words holding the "sleeping" bytes of ``world_size`` ranks."""
    n = min(world_size, MAX_SLEEPERS)
    return tuple(range(SLEEPERS_OFF // 8, (SLEEPERS_OFF + n + 7) // 8))


def futex_available() -> bool:
    return _futex.available()
