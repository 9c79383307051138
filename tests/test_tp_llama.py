"""Tensor parallelism on a Llama-like transformer: 2 ranks against 1, and against torch's TP.

Plans are torchtitan's (``_tp_workers.llama_plan``): q/k/v and gate/up column-wise, o and
down row-wise, a row-wise embedding and a column-wise head; with sequence parallelism the
norms are ``SequenceParallel``, activations between blocks are sharded on the sequence
dim and the loss is ``loss_parallel``.  The collective counts are Megatron's, nothing more.
"""

from __future__ import annotations

import _tp_workers as workers
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

LAYERS = 2            # _tp_models.Llama's default


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp+sp"])
def test_ten_adamw_steps_match_one_rank(sp: bool) -> None:
    for r in run_threads(workers.llama_parity, 2, sp, timeout=110):
        assert r["losses"] == pytest.approx(r["ref_losses"], abs=1e-5)
        assert r["grad_diff"] < 1e-5 and r["param_diff"] < 1e-4, (r["grad_diff"], r["param_diff"])
        fwd, loss, bwd = r["comms"]
        assert len(r.get("norms", [])) == (10 if sp else 0)
        # clip_grad_norm_: one all-reduce
        for norm, ref_norm, comm in r.get("norms", []):
            assert norm == pytest.approx(ref_norm, rel=1e-5) and comm == {"all_reduce": 1}
        if sp:
            # an all-gather into and a reduce-scatter out of every parallel region (2 per block,
            # plus the embedding's reduce-scatter and the head's all-gather); the norms' weight
            # gradients are the only all-reduces of backward; the loss costs 3 small all-reduces.
            regions = 2 * LAYERS + 1
            assert fwd == {"reduce_scatter": regions, "all_gather": regions}
            assert loss == {"all_reduce": 3}
            assert bwd == {"reduce_scatter": regions, "all_gather": regions, "all_reduce": regions}
        else:
            # one all-reduce per row-parallel layer forward (embedding, o, down), one per
            # column-parallel input backward (attention input, feed-forward input, head input)
            # + the replicated logits
            assert fwd == {"all_reduce": 2 * LAYERS + 1, "all_gather": 1}
            assert loss == {}
            assert bwd == {"all_reduce": 2 * LAYERS + 1}


@pytest.mark.timeout(150)
def test_processes_match_torch_tensor_parallel_step_for_step(tmp_gloo: str) -> None:
    """The 'done when' check: the same plan under ringlet (shm) and torch (gloo) gives the same
    losses."""
    import os

    os.makedirs(tmp_gloo, exist_ok=True)
    for r in raise_first(run_world(2, workers.llama_vs_torch, tmp_gloo, timeout=140)):
        assert r["ours"] == pytest.approx(r["torch"], abs=1e-5)
        assert r["ours"] == pytest.approx(r["ref"], abs=1e-5)
        assert r["param_diff"] < 1e-4
