"""loss_parallel beyond a 1-d mesh and 2-d logits (issue 26): dp x tp meshes with the batch
sharded (TP on the last or the first mesh axis), nll_loss2d inputs ``[N, C, L]``, and torch's
refusals (ValueError for a batch-only-sharded input, for Partial on a mesh axis and for a plain
target the layout shards; NotImplementedError for a mean over a sharded batch).  Losses and
gradients are compared with F.cross_entropy on the full logits in one process (rank threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.distributed.tensor.parallel import loss_parallel
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(90)

R = Replicate()


def _data(shape: tuple[int, ...], classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(sum(shape))
    logits = torch.randn(shape, generator=g)
    target = torch.randint(0, classes, (shape[0], *shape[2:]), generator=g)
    target.view(-1)[1] = -100                                   # one ignored position
    return logits, target


def _check(mesh, x_pls, t_pls, shape, kw, plain_target=False) -> tuple[float, float, str, dict]:
    """(|loss - want|, |grad - want|, repr of the loss, backward comm counts)."""
    logits, target = _data(shape, shape[1])
    full = logits.clone().requires_grad_()
    want = F.cross_entropy(full, target, **kw)
    want.backward(torch.ones_like(want))
    x = distribute_tensor(logits, mesh, x_pls).requires_grad_()
    t = target if plain_target else distribute_tensor(target, mesh, t_pls)
    with loss_parallel():
        got = F.cross_entropy(x, t, **kw)
        with CommDebugMode() as bwd:
            got.full_tensor().backward(torch.ones_like(want))
    return ((got.full_tensor() - want).abs().max().item(),
            (x.grad.full_tensor() - full.grad).abs().max().item(), repr(got),
            bwd.get_comm_counts().by_name())


def _two_d(rank: int, world: int) -> dict[str, object]:
    dp_tp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_dp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("tp", "dp"))
    w = {"weight": torch.tensor([1.0, 2.0, 0.5, 1.0, 3.0, 1.0, 0.25])}
    out: dict[str, object] = {
        "dp_tp sum": _check(dp_tp, [Shard(0), Shard(1)], [Shard(0), R], (6, 7),
                            {"reduction": "sum"}),
        "dp_tp none+weight": _check(dp_tp, [Shard(0), Shard(1)], [Shard(0), R], (6, 7),
                                    {"reduction": "none", **w}),
        "tp_dp sum": _check(tp_dp, [Shard(1), Shard(0)], [R, Shard(0)], (6, 7),
                            {"reduction": "sum"}),
        "dp_tp 2d none": _check(dp_tp, [Shard(0), Shard(1)], [Shard(0), R], (4, 5, 3),
                                {"reduction": "none"}),
        "seq 2d sum": _check(dp_tp, [Shard(2), Shard(1)], [Shard(1), R], (2, 5, 4),
                             {"reduction": "sum"}),
        "replicated dp mean": _check(dp_tp, [R, Shard(1)], None, (6, 7), {},
                                     plain_target=True),
    }
    logits, target = _data((6, 7), 7)
    x = distribute_tensor(logits, dp_tp, [Shard(0), Shard(1)])
    errors = []
    with loss_parallel():
        for bad, kw in ((target, {"reduction": "sum"}),
                        (distribute_tensor(target, dp_tp, [Shard(0), R]), {})):
            try:
                F.cross_entropy(x, bad, **kw)
            except (ValueError, NotImplementedError) as e:
                errors.append((type(e).__name__, str(e)))
        try:
            F.cross_entropy(DTensor.from_local(logits, dp_tp, [Partial(), Shard(1)]), target)
        except ValueError as e:
            errors.append(("ValueError", str(e)))
    out["errors"] = errors
    return out


def test_loss_parallel_on_dp_x_tp_meshes_matches_cross_entropy() -> None:
    for r in run_threads(_two_d, 4):
        for name in ("dp_tp sum", "dp_tp none+weight", "tp_dp sum", "dp_tp 2d none",
                     "seq 2d sum", "replicated dp mean"):
            loss_diff, grad_diff, rep, bwd = r[name]
            assert loss_diff < 1e-5 and grad_diff < 1e-5, (name, r[name])
        assert r["dp_tp sum"][2] == "DTensor(f32[] P(sum)R)", r["dp_tp sum"]
        assert r["tp_dp sum"][2] == "DTensor(f32[] RP(sum))", r["tp_dp sum"]
        assert r["dp_tp none+weight"][2] == "DTensor(f32[6@dp] S(0)R)"
        assert r["dp_tp 2d none"][2] == "DTensor(f32[4@dp,3] S(0)R)"
        assert r["dp_tp sum"][3].get("all_reduce", 0) <= 1, r["dp_tp sum"]   # loss.full_tensor
        (plain_t, plain_msg), (mean_t, mean_msg), (partial_t, partial_msg) = r["errors"]
        assert plain_t == "ValueError" and "must be a DTensor" in plain_msg, plain_msg
        assert mean_t == "NotImplementedError" and "reduction='mean'" in mean_msg, mean_msg
        assert partial_t == "ValueError" and "expected Shard or Replicate" in partial_msg
        for msg in (plain_msg, mean_msg, partial_msg):
            assert msg.startswith("loss_parallel: "), msg


def _one_d(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    out: dict[str, object] = {}
    for name, kw in {"mean": {}, "sum": {"reduction": "sum"}, "none": {"reduction": "none"},
                     "weight": {"weight": torch.tensor([1.0, 2.0, 0.5, 3.0, 1.0])}}.items():
        logits, target = _data((3, 5, 4), 5)                       # nll_loss2d
        full = logits.clone().requires_grad_()
        want = F.cross_entropy(full, target, **kw)
        want.backward(torch.ones_like(want))
        x = distribute_tensor(logits, mesh, [Shard(1)]).requires_grad_()
        with loss_parallel():
            with CommDebugMode() as fwd:
                got = F.cross_entropy(x, target, **kw)
            got.backward(torch.ones_like(got))
        out[name] = ((got.full_tensor() - want).abs().max().item(),
                     (x.grad.full_tensor() - full.grad).abs().max().item(), repr(x.grad),
                     fwd.get_comm_counts().by_name())
    logits, target = _data((4, 5), 5)
    with loss_parallel(), pytest.raises(ValueError, match=r"loss_parallel: log_softmax: expected "
                                                          r"the class dim 1 .* sharded along "
                                                          r"exactly one mesh axis"):
        F.cross_entropy(distribute_tensor(logits, mesh, [Shard(0)]), target)
    return out


def test_loss_parallel_nll_loss2d_and_batch_sharded_refusal() -> None:
    for r in run_threads(_one_d, 2):
        for name in ("mean", "sum", "none", "weight"):
            loss_diff, grad_diff, grad_rep, fwd = r[name]
            assert loss_diff < 1e-5 and grad_diff < 1e-5, (name, r[name])
            assert grad_rep == "DTensor(f32[3,5@tp,4] S(1))", (name, grad_rep)
            assert fwd == {"all_reduce": 3}, (name, fwd)     # never gathers the logits
