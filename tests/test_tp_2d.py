"""2-d training end to end: a Llama-like model with tensor + sequence parallelism on "tp" and DDP or
fully_shard on "dp" of a 2 x 2 mesh, against one process training on the whole batch."""

from __future__ import annotations

import _tp_workers as workers
import pytest

from ringlet.testing import run_threads

PLACEMENTS = {
    # state dicts hold the 2-d layout: DDP keeps the TP DTensors (Replicate on dp implied by the
    # tp-only mesh); fully_shard adds Shard(0) on dp (strided where TP shards the same dim)
    "ddp": ["R", "S(0)", "S(1)"],
    "fsdp": ["S(0)R", "S(0)S(1)", "_S(0, 2)S(0)"],
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_tp_sp_with_data_parallel_matches_one_process(strategy: str) -> None:
    res = run_threads(workers.llama_2d, 4, strategy, timeout=140)
    # rank = 2 * dp + tp: each dp rank's loss is over its half of the batch, their mean is the
    # reference's
    for dp0, dp1 in ((res[0], res[2]), (res[1], res[3])):
        means = [(a + b) / 2 for a, b in zip(dp0["losses"], dp1["losses"])]
        assert means == pytest.approx(dp0["ref_losses"], abs=1e-5)
    for r in res:
        assert r["param_diff"] < 1e-4, r["param_diff"]
        assert r["placements"] == PLACEMENTS[strategy], r["placements"]
