"""DDP in real processes over shm, against torch's DDP on gloo in the same processes (the oracle),
and a check that bucket all-reduces run while backward is still going (overlap)."""

from __future__ import annotations

from typing import Any

import _ddp_workers as W
import pytest

from ringlet.testing.procs import raise_first, run_world


@pytest.fixture(scope="module")
def suite(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    rdzv = str(tmp_path_factory.mktemp("ddp") / "gloo_rdzv")
    return raise_first(run_world(2, W.proc_suite, rdzv, timeout=100, op_timeout=30))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", ["mlp_default", "mlp_view"])
def test_mlp_matches_torch_ddp(suite: list[dict[str, Any]], case: str) -> None:
    for rank, res in enumerate(suite):
        assert res[case]["loss"] < 1e-9 and res[case]["param"] < 1e-9, (rank, res[case])


@pytest.mark.timeout(120)
def test_join_matches_torch_ddp_join(suite: list[dict[str, Any]]) -> None:
    assert max(res["join"] for res in suite) < 1e-9, [res["join"] for res in suite]


@pytest.mark.timeout(120)
def test_bucket_all_reduce_overlaps_backward(suite: list[dict[str, Any]]) -> None:
    for res in suite:
        ov = res["overlap"]
        assert ov["buckets"] == [[5], [4], [3], [2], [1, 0]], ov  # 256 KiB weights: solo buckets
        # launched as soon as ready, in order
        assert ov["launched"] == [True] * 4 + [False], ov
        assert ov["bucket0_done_inside_backward"], ov              # and finished while backward ran
        assert ov["done_in_backward"] >= ov["bucket0_bytes"], ov   # as the reducer's stats say
