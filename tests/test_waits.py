"""Arena waits that sleep on the futex doorbell ([Note: arena waits]): correct results and bounded
ends with blocked waiters -- a slow, stopped, killed, departed or aborting peer, a deadline -- on
threads (inproc) and processes (shm), with futexes and with the timer back-off
(RINGLET_NO_FUTEX=1); and that a blocked waiter of shm and tcp sleeps rather than polls (its
threads' wake-ups are counted).  Wake-up latency is never asserted here (bench/collectives.py
measures speed); "woken long before the timeout" is.  Ranks as threads cannot be stopped or
killed: there a departed or aborting peer stands for them."""

from __future__ import annotations

import mmap
import os
import threading
import time

import _wait_workers as ww
import pytest

from ringlet.c10d.debug import REPORT_WAIT
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport import arena_wait
from ringlet.transport._futex import available
from ringlet.transport.arena import Arena, ArenaLayout, _Waiter
from ringlet.transport.arena_wait import (
    CONTENDED_SPIN_S,
    PROBE_EVERY,
    SLEEPERS_OFF,
    SPIN_MAX_S,
    SPIN_MIN_S,
    Spinner,
)
from ringlet.transport.base import OpContext

FUTEX = [pytest.param("0", id="futex",
                      marks=pytest.mark.skipif(not available(), reason="no futex")),
         pytest.param("1", id="timers")]
T_LONG = 10.0     # op timeout where the test expects an end long before it
DELAY = 0.3       # how late the slow peer is


def _by_rank(results):
    return {r.rank: r for r in results}


def _arena(rank: int, memory: object, n: int = 2) -> Arena:
    layout = ArenaLayout(n, 4096, 4096)
    return Arena(memory, layout, rank, alive=lambda r: True, describe_peer=str)


def _ctx(timeout: float = T_LONG) -> OpContext:
    return OpContext("all_reduce", 1, 0, 2, "test", timeout)


# -- the doorbell and the spin policy, without a group --------------------------------------------

@pytest.mark.skipif(not available(), reason="no futex")
def test_a_post_rings_only_while_someone_sleeps_and_marks_are_cleared() -> None:
    memory = bytearray(ArenaLayout(2, 4096, 4096).total)
    waiter, poster = _arena(0, memory), _arena(1, memory)
    waiter.share_cpus(1 << 20)                      # never spin: sleep at once
    bell = arena_wait.DOORBELL_OFF // 4
    u32 = memoryview(memory).cast("I")
    poster.notify()
    assert u32[bell] == 0                           # nobody sleeps: no bump, no syscall
    flag = poster.flag_i[1]
    th = threading.Thread(target=waiter.wait_ge, args=([flag], [1], 1, _ctx()))
    th.start()
    deadline = time.monotonic() + 5.0
    while memory[SLEEPERS_OFF] != 1 and time.monotonic() < deadline:
        time.sleep(0.001)
    assert memory[SLEEPERS_OFF] == 1 and memory[SLEEPERS_OFF + 1] == 0
    poster.q[flag] = 1
    poster.notify()
    th.join(5.0)
    assert not th.is_alive()
    assert u32[bell] == 1 and memory[SLEEPERS_OFF] == 0 and waiter.bell.naps >= 1
    u32.release()
    waiter.release()
    poster.release()


@pytest.mark.skipif(not available(), reason="no futex")
def test_a_missed_wake_up_costs_one_short_nap_not_the_timeout() -> None:
    """A flag stored without notify() (what a store->load reordering amounts to) is still seen:
    the sleeper's naps are short and bounded by the liveness period."""
    memory = bytearray(ArenaLayout(2, 4096, 4096).total)
    waiter, poster = _arena(0, memory), _arena(1, memory)
    waiter.share_cpus(1 << 20)
    flag = poster.flag_i[1]
    done: list[float] = []

    def wait() -> None:
        t0 = time.monotonic()
        waiter.wait_ge([flag], [1], 1, _ctx())
        done.append(time.monotonic() - t0)
    th = threading.Thread(target=wait)
    th.start()
    time.sleep(0.2)                                 # the waiter's naps have grown meanwhile
    poster.q[flag] = 1                              # no notify()
    th.join(5.0)
    assert done and done[0] < 0.2 + 1.0 < T_LONG
    assert waiter.bell.naps >= 3
    waiter.release()
    poster.release()


def test_arena_release_lets_the_mapping_close() -> None:
    """The doorbell's futex pins the arena's memory; release() must drop every pin."""
    layout = ArenaLayout(2, 4096, 4096)
    mm = mmap.mmap(-1, layout.total)
    arena = _arena(0, mm)
    arena.release()
    mm.close()                                      # BufferError if anything still pins it
    assert mm.closed


def _machine(monkeypatch, runnable: int) -> None:
    """Pretend ``runnable`` tasks are runnable on this machine (a fresh load sample)."""
    monkeypatch.setattr(arena_wait, "runnable_tasks", lambda: runnable)
    monkeypatch.setattr(arena_wait, "_load", arena_wait._Load())


def test_spin_budget_follows_the_cpus_the_load_and_recent_waits(monkeypatch) -> None:
    _machine(monkeypatch, 1)
    s = Spinner()
    assert s.budget(time.monotonic()) == SPIN_MAX_S          # quiet machine
    _machine(monkeypatch, 64 * arena_wait._load.cpus)
    assert s.budget(time.monotonic()) == CONTENDED_SPIN_S    # busy machine: shorter spins
    for _ in range(40):
        s.waited(False)                                     # spinning stopped paying
    budgets = [s.budget(time.monotonic()) for _ in range(2 * PROBE_EVERY)]
    assert budgets.count(CONTENDED_SPIN_S) == 2              # probes: every PROBE_EVERY-th wait
    assert budgets.count(SPIN_MIN_S) == 2 * PROBE_EVERY - 2
    for _ in range(40):
        s.waited(True)                                      # short waits again
    assert s.budget(time.monotonic()) == CONTENDED_SPIN_S
    s.allowed = False                                       # more ranks than CPUs: never spin
    assert s.budget(time.monotonic()) == 0.0


def _planned(arena: Arena) -> _Waiter:
    """A wait of ``arena``'s rank for rank 1, past its first SPIN_MIN_S."""
    w = _Waiter(arena, _ctx(), time.monotonic())
    w.plan([1], time.monotonic())
    return w


def test_a_wait_for_a_rank_on_the_same_cpu_yields_instead_of_spinning(monkeypatch) -> None:
    _machine(monkeypatch, 1)
    cpu = arena_wait.current_cpu()
    if cpu < 0:
        pytest.skip("sched_getcpu is not available")
    memory = bytearray(ArenaLayout(2, 4096, 4096).total)
    a0, a1 = _arena(0, memory), _arena(1, memory)
    a0.spinner.allowed = a1.spinner.allowed = True          # as on a machine with 2 CPUs
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})                          # this thread stays on `cpu`
    try:
        assert _planned(a0).yielding is False               # rank 1 never waited yet
        assert a1.shares_cpu_with([0])                      # rank 1 records this CPU...
        assert _planned(a0).yielding is True                # ... so rank 0 yields to it
        a0.spinner.allowed = False
        assert _planned(a0).yielding is False               # no spinning, no yielding either
    finally:
        os.sched_setaffinity(0, before)
        a0.release()
        a1.release()


def test_runnable_tasks_reads_the_machine() -> None:
    assert arena_wait.runnable_tasks() >= 1         # at least this reader


# -- ranks as threads ------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("no_futex", FUTEX)
def test_threads_slow_peer_and_p2p_are_woken_long_before_the_timeout(monkeypatch, no_futex) -> None:
    monkeypatch.setenv("RINGLET_NO_FUTEX", no_futex)
    res = run_threads(ww.slow_peer, 2, DELAY, op_timeout=T_LONG)
    for values, elapsed, naps, bell in res:
        assert values == [3.0] * 4
        assert elapsed < DELAY + 2.0 < T_LONG
        assert bell == (no_futex == "0")
    assert (res[0][2] > 0) == (no_futex == "0")     # rank 0 slept on the futex (or not at all)
    for ok, elapsed, _ in run_threads(ww.slow_p2p, 2, DELAY, op_timeout=T_LONG):
        assert ok and elapsed < 2 * DELAY + 2.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("no_futex", FUTEX)
@pytest.mark.parametrize("how,etype,needle", [
    ("abort", "GroupAbortedError", "rank 1 gives up"),
    ("leave", "PeerFailureError", "left the group"),
])
def test_threads_blocked_waiter_sees_abort_and_departure(monkeypatch, no_futex, how, etype,
                                                         needle) -> None:
    monkeypatch.setenv("RINGLET_NO_FUTEX", no_futex)
    got, msg, elapsed = run_threads(ww.ends_while_awaited, 2, DELAY, how, op_timeout=T_LONG)[0]
    assert got == etype and needle in msg, msg
    assert elapsed < DELAY + 2.0 < T_LONG


@pytest.mark.timeout(60)
@pytest.mark.parametrize("no_futex", FUTEX)
def test_threads_blocked_waiter_ends_at_its_deadline(monkeypatch, no_futex) -> None:
    monkeypatch.setenv("RINGLET_NO_FUTEX", no_futex)
    T = 0.5
    got, msg, elapsed = run_threads(ww.late_past_deadline, 2, T + 0.7, op_timeout=T)[0]
    assert got == "CollectiveTimeoutError" and "ranks [1]" in msg, msg
    assert 0.9 * T <= elapsed <= T + 1.0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("no_futex", FUTEX)
def test_threads_three_ranks_with_random_stalls_stay_correct(monkeypatch, no_futex) -> None:
    monkeypatch.setenv("RINGLET_NO_FUTEX", no_futex)
    for ok, _ in run_threads(ww.jittery_loop, 3, 60, 1, op_timeout=T_LONG):
        assert ok


# -- ranks as processes
# -----------------------------------------------------------------------------

@pytest.mark.timeout(90)
@pytest.mark.parametrize("no_futex", FUTEX)
def test_processes_slow_stopped_and_jittery_peers(no_futex) -> None:
    env = {"RINGLET_NO_FUTEX": no_futex}
    res = raise_first(run_world(2, ww.slow_peer, DELAY, op_timeout=T_LONG, env=env, timeout=40))
    assert res[0][0] == [3.0] * 4 and res[0][1] < DELAY + 2.0
    assert (res[0][2] > 0) == (no_futex == "0") and res[0][3] == (no_futex == "0")
    res = raise_first(run_world(2, ww.slow_p2p, DELAY, op_timeout=T_LONG, env=env, timeout=40))
    assert all(ok for ok, _, _ in res) and res[0][1] < 2 * DELAY + 2.0
    res = raise_first(run_world(2, ww.stopped_peer, DELAY, op_timeout=T_LONG, env=env, timeout=40))
    assert res[0][0] == res[1][0] == [3.0] * 4
    assert DELAY <= res[0][1] < DELAY + 3.0         # continued at once after SIGCONT
    res = raise_first(run_world(3, ww.jittery_loop, 150, 2, op_timeout=T_LONG, env=env, timeout=40))
    assert all(ok for ok, _ in res)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("no_futex", FUTEX)
def test_processes_blocked_waiter_sees_death_and_the_deadline(no_futex) -> None:
    env = {"RINGLET_NO_FUTEX": no_futex}
    r0 = _by_rank(run_world(2, ww.dies_while_awaited, DELAY, op_timeout=T_LONG, env=env,
                            timeout=40))[0]
    got, msg, elapsed = r0.value
    assert got == "PeerFailureError" and "rank 1" in msg and "died" in msg, msg
    assert elapsed < DELAY + 1.0                    # within the liveness period, not T_LONG
    T = 0.5
    r0 = _by_rank(run_world(2, ww.late_past_deadline, T + 0.7, op_timeout=T, env=env,
                            timeout=40))[0]
    got, msg, elapsed = r0.value
    assert got == "CollectiveTimeoutError" and "ranks [1]" in msg, msg
    assert 0.9 * T <= elapsed <= T + 1.0


@pytest.mark.timeout(90)
@pytest.mark.parametrize("no_futex", FUTEX)
@pytest.mark.parametrize("how,etype,needle", [
    ("abort", "GroupAbortedError", "rank 1 gives up"),
    ("leave", "PeerFailureError", "left the group"),
])
def test_processes_blocked_waiter_sees_abort_and_departure(no_futex, how, etype, needle) -> None:
    env = {"RINGLET_NO_FUTEX": no_futex}
    r0 = _by_rank(run_world(2, ww.ends_while_awaited, DELAY, how, op_timeout=T_LONG, env=env,
                            timeout=40))[0]
    got, msg, elapsed = r0.value
    assert got == etype and needle in msg, msg
    assert elapsed < DELAY + 2.0 < T_LONG


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how,n,op_timeout,etype,needle", [
    ("deadline", 2, 0.5, "CollectiveTimeoutError", "ranks [1]"),
    ("abort", 3, T_LONG, "GroupAbortedError", "rank 2 gives up"),
])
def test_processes_waiter_on_a_stopped_peer_ends_and_the_thawed_peer_fails_too(
        how, n, op_timeout, etype, needle) -> None:
    """A SIGSTOPped peer neither dies nor posts: only the deadline or an abort ends the wait,
    on time; once continued, the stopped rank must not complete the collective given up on."""
    res = _by_rank(run_world(n, ww.stopped_peer_gives_up, how, DELAY, op_timeout=op_timeout,
                             timeout=40))
    got, msg, elapsed = res[0].value
    assert got == etype and needle in msg, msg
    if how == "deadline":   # then the hang report waits REPORT_WAIT for the stopped rank's state
        assert "rank 1: no answer" in msg, msg
        assert op_timeout <= elapsed <= op_timeout + REPORT_WAIT + 1.5
    else:
        assert elapsed <= DELAY + 1.5
    thawed, msg1, _ = res[1].value
    # the abort record is seen before anything else, and carries its cause's class
    assert thawed == etype, msg1


@pytest.mark.timeout(90)
@pytest.mark.parametrize("backend,no_futex,most", [
    pytest.param("shm", "0", 120, id="shm-futex",
                 marks=pytest.mark.skipif(not available(), reason="no futex")),
    pytest.param("tcp", "0", 40, id="tcp"),
    pytest.param("shm", "1", None, id="shm-timers-control"),
])
def test_processes_a_blocked_waiter_sleeps_instead_of_polling(backend, no_futex,
                                                              most: int | None) -> None:
    """While its peer is 1.5 s late, a waiting rank's threads wake up rarely: futex naps that
    grow to the liveness period (shm), one poll() until the deadline (tcp).  A timer back-off
    would wake ~1000 times a second."""
    env = {"RINGLET_NO_FUTEX": no_futex}
    woke, waited = raise_first(run_world(2, ww.wakeups_while_awaited, 1.5, backend=backend,
                                         op_timeout=T_LONG, env=env, timeout=40))[0]
    assert 1.0 < waited < 1.5 + 2.0
    if most is None:            # the control: the timer back-off is seen polling (~1400 here)
        assert woke > 300, f"only {woke} wake-ups in {waited:.2f} s"
    else:                       # measured: ~51 (shm), ~13 (tcp)
        assert woke <= most, f"{woke} wake-ups in {waited:.2f} s"
