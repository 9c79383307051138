"""DDP with uneven inputs inside ``ddp.join()`` (docs/reliability.md, row D3): shadowing ranks
that ran out of data."""

from __future__ import annotations

from typing import Any

import _ddp_workers as W
import pytest

from ringlet.testing import run_threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("divide_initial", [True, False])
@pytest.mark.parametrize("ddp_kw", [
    {"bucket_cap_mb": 0.0005},
    {"bucket_cap_mb": 0.0005, "gradient_as_bucket_view": True, "static_graph": True},
    {"find_unused_parameters": True},
], ids=["buckets", "view_static", "find_unused"])
def test_join_matches_reference(divide_initial: bool, ddp_kw: dict[str, Any]) -> None:
    counts = [3, 5]
    results = run_threads(W.join_train, 2, counts, divide_initial, "mlp", ddp_kw)
    ref = W.join_reference(2, counts, divide_initial)
    for rank, params in enumerate(results):
        diff = max((a - b).abs().max().item() for a, b in zip(params, ref))
        assert diff < 1e-9, f"rank {rank}: parameters differ from the reference by {diff}"


@pytest.mark.timeout(60)
def test_join_three_ranks_with_buffers_and_rank0_out_first() -> None:
    # rank 0 joins after one batch: buffers and bucket order come from rank 1
    counts = [1, 4, 2]
    results = run_threads(W.join_train, 3, counts, True, "bn", {"bucket_cap_mb": 0.0005})
    ref = W.join_reference(3, counts, True, "bn")
    for params in results:
        assert max((a - b).abs().max().item() for a, b in zip(params, ref)) < 1e-9


@pytest.mark.timeout(60)
def test_rank_without_batches_uses_the_active_ranks_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank that joins before its first forward inside Join (no batch at all) shadows the
    active ranks' SUM of ``divide_by_initial_world_size=False``: DETAIL mode compares the
    collectives of every rank, so a different op on the joined rank would fail the run."""
    monkeypatch.setenv("RINGLET_DEBUG", "DETAIL")
    counts = [0, 3]
    results = run_threads(W.join_train, 2, counts, False, "mlp", {"bucket_cap_mb": 0.0005})
    ref = W.join_reference(2, counts, False)
    for params in results:
        assert max((a - b).abs().max().item() for a, b in zip(params, ref)) < 1e-9
