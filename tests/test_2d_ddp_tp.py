"""DDP over the dp axis of a 2x2 mesh, tensor-parallel DTensor parameters on the tp axis (issue 12
item 4): training matches one process; state dicts hold DTensors and round-trip; a DTensor
sharded over DDP's own group is refused clearly (it used to crash the interpreter over shm)."""

from __future__ import annotations

import _2d_workers as W
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("variant", ["tp1d", "tp2d", "group", "manual", "options"])
def test_ddp_over_dp_with_tp_dtensor_params_matches_one_process(variant: str) -> None:
    for r in run_threads(W.ddp_tp_train, 4, variant):
        assert r["types"] == ["Parameter"], r             # DDP and the optimizer see local tensors
        assert r["sd_types"] == ["DTensor"], r            # the state dict holds the 2-d layout
        assert r["diff"] < 1e-6, r
        assert max(r["round_trip"]) == 0.0, r


def test_ddp_refuses_a_dtensor_sharded_over_its_own_group() -> None:
    for msg in run_threads(W.ddp_overlap_refused, 2):
        assert "'weight'" in msg and "Shard(dim=0)" in msg and "expected every rank" in msg, msg


@pytest.mark.timeout(120)
def test_ddp_with_dtensor_params_in_processes_over_shm() -> None:
    """The two cases in real processes: 2x2 DDP+TP trains; the overlapping layout raises, no
    crash."""
    for r in raise_first(run_world(4, W.ddp_tp_train, "tp1d", timeout=100)):
        assert r["diff"] < 1e-6 and max(r["round_trip"]) == 0.0, r
    for msg in raise_first(run_world(2, W.ddp_overlap_refused, timeout=60)):
        assert "expected every rank" in msg, msg


def test_ddp_over_a_parallelize_module_model() -> None:
    assert max(run_threads(W.parallelized_train, 4, "ddp")) < 1e-6
