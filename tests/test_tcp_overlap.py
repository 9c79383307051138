"""The tcp transport with ``RINGLET_TCP_OVERLAP=1`` ([Note: tcp I/O overlap]): the reader thread
receives a large collective's frames while the calling thread sends and reduces.  The same
properties as the default pump: exact and bit-identical results, an abort from another thread, a
killed or stopped peer, and no thread left after destroy (one connection shared with
point-to-point messages: tests/test_tcp.py, run both ways).  Chunks of 4 KiB make every tensor
here take the served path."""

from __future__ import annotations

import _tcp_overlap_workers as ow
import _tcp_workers
import _workers
import pytest

from ringlet.testing.procs import raise_first, run_world

T = 2.0
ENV = {"RINGLET_TCP_OVERLAP": "1", "RINGLET_TCP_CHUNK_BYTES": "4096"}


def _env(**more: str) -> dict[str, str]:
    return {**ENV, **more}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_large_collectives_are_served_and_exact(n: int) -> None:
    for r, got in enumerate(raise_first(run_world(n, ow.served_and_correct, backend="tcp",
                                                  env=_env(), timeout=50))):
        assert got["all_reduce"] and got["all_gather"] and got["broadcast"], (r, got)
        root = r == n - 1                      # the broadcast's root receives nothing
        assert got["served_big"] == (2 if root else 3) and got["served_small"] == 0, (r, got)


@pytest.mark.timeout(120)
def test_random_floats_bit_identical_to_the_default_pump() -> None:
    sizes = (20_000, 150_001)
    plain = raise_first(run_world(3, _tcp_workers.differential, sizes, backend="tcp", timeout=100,
                                  env={"RINGLET_TCP_CHUNK_BYTES": "4096"}))
    served = raise_first(run_world(3, _tcp_workers.differential, sizes, backend="tcp",
                                   timeout=100, env=_env()))
    for r in range(3):
        diff = [k for k in plain[r] if plain[r][k] != served[r].get(k)]
        assert not diff and len(plain[r]) == len(served[r]), diff[:10]


@pytest.mark.timeout(60)
def test_abort_from_another_thread_ends_a_served_collective() -> None:
    res = raise_first(run_world(2, ow.abort_during_big_collective, backend="tcp", env=_env(),
                                op_timeout=10.0, timeout=30))
    etype, msg, elapsed = res[0]
    assert etype == "GroupAbortedError" and "stopped by the test" in msg and elapsed < 2.0, res[0]
    etype, msg, elapsed = res[1]
    assert etype == "GroupAbortedError" and "aborted by rank 0" in msg and elapsed < 2.0, res[1]


@pytest.mark.timeout(60)
def test_killed_peer_reaches_every_survivor_within_a_second() -> None:
    env = _env(RINGLET_FAULT="rank=1;at=collective:seq=5;do=sigkill")
    res = {r.rank: r for r in run_world(3, _workers.timed_until_error, 50, 50_000, backend="tcp",
                                        op_timeout=10.0, env=env, timeout=40)}
    for r in (0, 2):
        etype, msg, elapsed = res[r].value
        assert etype in ("PeerFailureError", "GroupAbortedError"), (r, etype, msg)
        assert "rank 1" in msg and "all_reduce #5" in msg and "died" in msg, msg
        assert elapsed < 1.0, f"rank {r} took {elapsed:.2f} s to notice"


@pytest.mark.timeout(60)
def test_stopped_peer_times_out_at_the_deadline_naming_it() -> None:
    env = _env(RINGLET_FAULT="rank=1;at=collective:seq=3;do=sigstop")
    res = {r.rank: r for r in run_world(2, _workers.timed_until_error, 10, 50_000, backend="tcp",
                                        op_timeout=T, env=env, timeout=T + 5)}
    etype, msg, elapsed = res[0].value
    assert etype == "CollectiveTimeoutError" and "ranks [1]" in msg and "pid" in msg, msg
    assert 0.9 * T <= elapsed <= T + 3.0, elapsed
    assert res[1].exc_type == "hung"


@pytest.mark.timeout(60)
def test_no_thread_is_left_after_destroy() -> None:
    for ok, alive in raise_first(run_world(2, ow.threads_after_destroy, backend="tcp", env=_env(),
                                           timeout=50)):
        assert ok and alive == [], alive
