"""loss_parallel: cross-entropy over class-sharded logits equals F.cross_entropy on the full logits,
forward and backward, with the communication of [Note: parallel cross-entropy] (rank threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.distributed.tensor.parallel import loss_parallel
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)

CASES = {
    "mean": {},
    "sum + ignore_index": {"reduction": "sum", "ignore_index": 2},
    "none + weight": {"reduction": "none",
                      "weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 0.25])},
    "label smoothing": {"label_smoothing": 0.1},
}


def _loss(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    # 7 classes: uneven shards on 2 and 3 ranks
    logits = torch.randn(6, 7, generator=g)
    target = torch.tensor([0, 6, 2, 3, 2, 5])
    out = {}
    for name, kw in CASES.items():
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, **kw)
        want.backward(torch.ones_like(want))
        x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            with CommDebugMode() as fwd:
                got = F.cross_entropy(x, target, **kw)
            with CommDebugMode() as bwd:
                got.backward(torch.ones_like(got))
        out[name] = (repr(got), torch.allclose(got.full_tensor(), want, atol=1e-6),
                     torch.allclose(x.grad.full_tensor(), full.grad, atol=1e-6), repr(x.grad),
                     fwd.get_comm_counts(), bwd.get_comm_counts())
    # the log-probs feed something besides the loss: the gradient is exact, at one all-reduce
    full = logits.clone().requires_grad_()
    lp = F.log_softmax(full, -1)
    (F.nll_loss(lp, target) + lp.exp().pow(2).sum()).backward()
    x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
    with loss_parallel():
        dlp = F.log_softmax(x, -1)
        loss = F.nll_loss(dlp, target) + dlp.exp().pow(2).sum()
        with CommDebugMode() as bwd:
            loss.backward()
    out["shared"] = (torch.allclose(x.grad.full_tensor(), full.grad, atol=1e-5),
                     bwd.get_comm_counts())
    with loss_parallel(), pytest.raises(IndexError, match=r"expected targets in \[0, 7\)"):
        F.cross_entropy(x, torch.tensor([0, 7, 1, 1, 1, 1]))
    # outside the context (or on replicated logits) the ordinary rules apply
    rep = distribute_tensor(logits, mesh, [Replicate()])
    with loss_parallel():
        out["replicated"] = torch.allclose(F.cross_entropy(rep, target).full_tensor(),
                                           F.cross_entropy(logits, target))
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_loss_parallel_matches_cross_entropy(n: int) -> None:
    for r in run_threads(_loss, n):
        for name in CASES:
            rep, loss_ok, grad_ok, grad_rep, fwd, bwd = r[name]
            assert loss_ok and grad_ok, name
            # the logits' gradient stays sharded
            assert grad_rep == "DTensor(f32[6,7@tp] S(1))", name
            if name != "label smoothing":
                assert fwd == {"all_reduce": 3} and bwd == {}, (name, fwd, bwd)
        assert r["shared"] == (True, {"all_reduce": 1})
        assert r["replicated"]
