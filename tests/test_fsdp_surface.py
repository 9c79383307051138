"""fully_shard's newer surface (issue 10 item 3): a list of modules as one group (and the
chunked-loss head called outside forward), reshard_after_forward as an int (a smaller group
after forward), Shard(1) placements, custom all-gather / reduce-scatter objects, SUM-only
reductions (FSDP and HSDP), a separate reduce-scatter group, unused-parameter reduction, the
remaining setters and share_comm_ctx; on threads and in real processes."""

from __future__ import annotations

import _fsdp_surface_workers as S
import pytest
import torch

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("name", ["grouped", "shard1", "custom", "force_sum", "separate_rs"])
def test_training_matches_one_process(name: str) -> None:
    for r in run_threads(S.parity, 2, name):
        assert r["loss"] < 1e-5 and r["diff"] < 1e-5, r
        if name == "custom":
            # 4 steps x (3 forward + 3 backward) gathers, 3 reductions
            assert r["calls"] == (24, 12), r


def test_reshard_after_forward_to_a_smaller_group() -> None:
    for r in run_threads(S.parity, 4, "raf2"):
        assert r["loss"] < 1e-5 and r["diff"] < 1e-5, r
    for rank, r in enumerate(run_threads(S.raf_int_details, 4)):
        assert r["pf_ranks"] == ([0, 1] if rank < 2 else [2, 3]), r
        # half kept, sharded registered
        assert r["kept"] * 2 == r["gathered"] and r["registered"] == "DTensor", r
        assert (r["forward_ag"], r["backward_ag_shard"], r["backward_ag_pf"]) == (3, 0, 1), r
        # dropped after backward
        assert r["after"], r


def test_grouped_modules_share_one_state_and_one_all_gather() -> None:
    for r in run_threads(S.grouped_details, 2):
        assert r["shared"] and r["reload"], r
        # 3 groups; root, pair, last layer
        assert r["counts"] == {"all_gather": 5, "reduce_scatter": 3}, r
        assert r["keys"] == ["layers.0.bias", "layers.0.weight", "layers.1.bias", "layers.1.weight",
                             "layers.2.bias", "layers.2.weight"], r


def test_grouped_head_called_per_chunk_outside_forward() -> None:
    assert max(run_threads(S.chunked_head, 2)) < 1e-5


def test_unused_parameters_get_the_average_with_reduce_scatter_unused_params() -> None:
    with_flag = run_threads(S.unused_params, 2, True)
    assert all(r["has_grad"] for r in with_flag)
    full = torch.cat([r["grad"] for r in with_flag])
    assert full.abs().sum() > 0
    without = run_threads(S.unused_params, 2, False)
    assert without[0]["has_grad"] and not without[1]["has_grad"]                 # torch's behaviour
    assert torch.allclose(without[0]["grad"], with_flag[0]["grad"])


def test_setters_validate_and_share_comm_ctx() -> None:
    for r in run_threads(S.setter_checks, 2):
        assert r["symm"].startswith("NotImplementedError: set_symm_mem_for_comm"), r
        assert (r["buffers"].startswith("ValueError")
                and r["buffers_type"].startswith("TypeError")), r
        assert r["comm_type"].startswith("TypeError: set_custom_all_gather: expected a "
                                         "AllGather"), r
        assert r["conflict"].startswith("ValueError: set_custom_all_gather: cannot be combined"), r
        assert r["share_bad"].startswith("ValueError: share_comm_ctx"), r
        assert (r["deprecated"] == "FutureWarning" and r["pool"] == "5"
                and r["shared_pool"] == "True"), r


def test_hsdp_with_sum_only_reductions() -> None:
    assert max(run_threads(S.hsdp_force_sum, 4)) < 1e-5


@pytest.mark.timeout(150)
def test_surface_in_processes() -> None:
    for rank, r in enumerate(raise_first(run_world(4, S.proc_surface, timeout=140))):
        for name in ("grouped", "custom", "separate_rs", "raf2"):
            assert r[name]["loss"] < 1e-5 and r[name]["diff"] < 1e-5, (name, r[name])
        assert (r["raf"]["pf_ranks"] == ([0, 1] if rank < 2 else [2, 3])
                and r["raf"]["backward_ag_pf"] == 1)
