"""agree, stats, report_stragglers, monitored_barrier (ranks as threads)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch

import ringlet.distributed as dist
from ringlet.testing import RankFailure, run_threads


def test_agree_any_and_all() -> None:
    def body(rank: int, n: int) -> tuple[bool, bool, bool]:
        return (dist.agree(rank == 1), dist.agree(rank == 1, op="all"), dist.agree(True, op="all"))
    assert run_threads(body, 3) == [(True, False, True)] * 3


def test_agree_rejects_bad_op() -> None:
    def body(rank: int, n: int) -> None:
        dist.agree(True, op="most")
    with pytest.raises(RankFailure, match="expected 'any' or 'all'"):
        run_threads(body, 2)


def test_stats_count_collectives_and_blame_the_late_rank() -> None:
    def body(rank: int, n: int) -> dict:
        for _ in range(5):
            if rank == 1:
                time.sleep(0.02)
            dist.all_reduce(torch.ones(3))
        dist.broadcast(torch.ones(2), src=0)
        s = dist.stats(dist.group.WORLD)
        lines = dist.report_stragglers()
        return {"stats": s, "lines": lines}
    out = run_threads(body, 2)
    s0 = out[0]["stats"]
    assert s0["by_op"]["all_reduce"] == 5 and s0["by_op"]["broadcast"] == 1
    assert s0["wait_s"] >= 0.05 and s0["late_s"].get(1, 0) >= 0.05
    assert any("rank 1 arrives" in line for line in out[0]["lines"])


def test_monitored_barrier_names_missing_rank() -> None:
    gave_up = threading.Event()

    def body(rank: int, n: int) -> str:
        if rank == 2:       # absent (not gone) until rank 0 has given up: no sleep decides it
            gave_up.wait(30.0)
            return ""
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=0.3))
        except dist.CollectiveTimeoutError as e:
            return str(e)
        finally:
            if rank == 0:
                gave_up.set()
        return "passed"
    msgs = run_threads(body, 3, op_timeout=5.0)
    assert "monitored_barrier" in msgs[0] and "ranks [2]" in msgs[0], msgs[0]
