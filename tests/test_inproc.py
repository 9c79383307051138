"""The ``inproc`` backend serves ranks that are threads of one process, and says so to processes."""

from __future__ import annotations

import _workers
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import run_world


@pytest.mark.timeout(60)
def test_inproc_refuses_ranks_that_are_processes() -> None:
    res = run_world(2, _workers.allreduce_loop, 1, backend="inproc", op_timeout=3.0, timeout=40)
    by_rank = {r.rank: r for r in res}
    assert by_rank[1].exc_type == "ValueError", by_rank[1]
    assert "expected every rank to be a thread of one process" in by_rank[1].message
    assert "use 'shm'" in by_rank[1].message


@pytest.mark.timeout(30)
def test_inproc_serves_threads() -> None:
    import torch

    import ringlet.distributed as dist

    def body(rank: int, n: int) -> float:
        t = torch.tensor([1.0 + rank])
        dist.all_reduce(t)
        return t.item()
    assert run_threads(body, 2) == [3.0, 3.0]
