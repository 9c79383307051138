"""fully_shard over the data-parallel axes of a mesh whose other axis holds tensor-parallel
DTensor parameters (issue 12 item 5): 2-d (and HSDP 3-d) sharded DTensors, all-gathers on dp
only, parity with one process (AdamW + clip_grad_norm_), state dicts that round-trip."""

from __future__ import annotations

import _2d_workers as W
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(90)

EXPECTED = {
    "fsdp": {"fc1.weight": "_S(0, 2)S(0)", "fc1.bias": "_S(0, 2)S(0)", "fc2.weight": "S(0)S(1)",
             "fc2.bias": "S(0)R"},
    "hsdp": {"fc1.weight": "R_S(0, 2)S(0)", "fc1.bias": "R_S(0, 2)S(0)", "fc2.weight": "RS(0)S(1)",
             "fc2.bias": "RS(0)R"},
}


@pytest.mark.parametrize("variant", ["fsdp", "tp2d", "uneven", "hsdp"])
def test_fully_shard_over_tp_params_matches_one_process(variant: str) -> None:
    for r in run_threads(W.fsdp_tp_train, 4, variant):
        assert r["placements"] == EXPECTED["hsdp" if variant == "hsdp" else "fsdp"], r
        assert r["meshes"] == [("rep", "shard", "tp") if variant == "hsdp" else ("dp", "tp")], r
        # 2 groups: forward all-gathers both, backward re-gathers fc1 (the root keeps its own);
        # the one all-reduce per axis is clip_grad_norm_'s total norm.
        assert r["dp_counts"] == {"all_gather": 3, "reduce_scatter": 2, "all_reduce": 1}, r
        # TP's own (row-parallel output) + the norm
        assert r["tp_counts"] == {"all_reduce": 2}, r
        assert r["sd_types"] == ["DTensor"], r
        assert r["diff"] < 1e-6, r
        assert max(r["round_trip"]) == 0.0, r


def test_layouts_that_do_not_combine_are_refused_clearly() -> None:
    for same_axis, unnamed in run_threads(W.fsdp_tp_refusals, 4):
        assert ("expected" in same_axis
                and "Replicate along fully_shard's mesh axis 'tp'" in same_axis), same_axis
        assert "named axes" in unnamed, unnamed


@pytest.mark.timeout(120)
def test_fully_shard_over_tp_params_in_processes() -> None:
    for r in raise_first(run_world(4, W.fsdp_tp_train, "fsdp", timeout=100)):
        assert r["diff"] < 1e-6 and max(r["round_trip"]) == 0.0, r


def test_fully_shard_over_a_parallelize_module_model() -> None:
    assert max(run_threads(W.parallelized_train, 4, "fsdp")) < 1e-6
