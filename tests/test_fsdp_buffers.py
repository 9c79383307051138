"""fully_shard's all-gather outputs and reduce-scatter inputs in shared memory (comm_buffer):
the collectives run in place, the buffers are reused across steps, training matches the
single-process reference with some ranks passing ordinary tensors, world sizes 2 and 3, on
threads (inproc) and processes (shm); a peer dying inside an in-place reduce-scatter fails the
others fast."""

from __future__ import annotations

import _fsdp_buffer_workers as fbw
import pytest
from _workers import survivors_failed_fast

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world


def _check(results: list[dict], plain_ranks: tuple[int, ...] = ()) -> None:
    for rank, got in enumerate(results):
        assert got["diff"] < 1e-5, got
        assert got["reused"], got
        calls = got["calls"]
        if plain_ranks:       # a mixed call: every rank falls back to the ordinary path
            assert all(done == 0 for done, _ in calls.values()), got
            assert got["shared"] == (rank not in plain_ranks), got
        else:
            assert got["shared"], got
            assert calls["all_gather"][0] > 0 and calls["reduce_scatter"][0] > 0, got
            assert all(back == 0 for _, back in calls.values()), got


@pytest.mark.parametrize("n", [2, 3])
def test_fully_shard_buffers_in_place_and_reused_on_threads(n: int) -> None:
    fbw._CALLS.clear()
    _check(run_threads(fbw.train, n, timeout=120))


def test_fully_shard_with_a_rank_on_ordinary_buffers_on_threads() -> None:
    fbw._CALLS.clear()
    _check(run_threads(fbw.train, 3, (1,), timeout=120), (1,))


@pytest.mark.timeout(120)
def test_fully_shard_buffers_on_processes() -> None:
    _check(raise_first(run_world(3, fbw.train, timeout=100)))
    _check(raise_first(run_world(2, fbw.train, (0,), timeout=100)), (0,))


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_peer_dying_in_a_reduce_scatter_fails_the_others_fast(how: str) -> None:
    res = run_world(3, fbw.peer_dies_in_backward, how, op_timeout=10.0, timeout=60)
    survivors_failed_fast(res, (0, 2), dead=1, within=5.0)
    if how == "kill":
        assert res[1].exitcode != 0
    else:
        assert res[1].value["error"].startswith("KeyboardInterrupt"), res[1].value
