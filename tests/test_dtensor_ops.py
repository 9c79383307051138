"""Operators on DTensors: sharding rules checked against the same op on full tensors (rank
threads)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.distributed.tensor.experimental import implicit_replication
from ringlet.testing import run_threads

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def _ints(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-4, 5, shape, generator=g).float()   # small integers: sums are exact


def _check(out: dict, name: str, dt: DTensor, want: torch.Tensor, pls: str | None = None) -> None:
    got = dt.full_tensor()
    ok = got.shape == want.shape and torch.allclose(got, want, atol=1e-5)
    placed = "".join(map(str, dt.placements))
    out[name] = (ok and (pls is None or placed == pls)
                 or f"{placed} {got.tolist()} != {want.tolist()}")


def _pointwise_and_reductions(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    a, b, row = _ints((5, 4), 0), _ints((5, 4), 1), _ints((4,), 2)
    da, db = distribute_tensor(a, mesh, [S0]), distribute_tensor(b, mesh, [S1])
    drow = distribute_tensor(row, mesh, [R])
    out: dict = {}
    _check(out, "add S0+S1", da + db, a + b, "S(0)")
    _check(out, "broadcast row", da * drow - 1, a * row - 1, "S(0)")
    _check(out, "where", torch.where(da > 0, da, db), torch.where(a > 0, a, b))
    _check(out, "relu/gelu", F.gelu(F.relu(da)), F.gelu(F.relu(a)))
    dp = DTensor.from_local(a * (rank + 1), mesh, [P])
    tot = a * (n * (n + 1) // 2)
    rb = distribute_tensor(b, mesh, [R])
    with CommDebugMode() as comm:
        # linear: stays Partial (rb is partitioned), no communication
        lin = dp * 3 - dp / 2 + rb
    out["partial stays"] = (comm.get_total_counts() == 0
                            and repr(lin.placements[0]) == "Partial(sum)")
    _check(out, "partial linear", lin, tot * 3 - tot / 2 + b, "P(sum)")
    _check(out, "partial nonlinear", torch.exp(dp / 30), torch.exp(tot / 30), "R")
    c = da.clone()
    c.mul_(2).add_(db)            # in place: self keeps S(0), db is resharded to it
    _check(out, "inplace", c, a * 2 + b, "S(0)")
    with pytest.raises(RuntimeError, match="writes .* in place"):
        dp.clone().exp_()
    _check(out, "sum(0) uneven", da.sum(0), a.sum(0), "P(sum)")
    _check(out, "sum(1)", da.sum(1), a.sum(1), "S(0)")
    _check(out, "mean uneven", da.mean(), a.mean(), "P(sum)")
    _check(out, "mean keepdim", da.mean(0, keepdim=True), a.mean(0, keepdim=True), "P(sum)")
    _check(out, "amax", da.amax(0), a.amax(0), "P(max)")
    _check(out, "max/min", torch.stack([da.max(), da.min()]), torch.stack([a.max(), a.min()]))
    _check(out, "norm", torch.linalg.vector_norm(da), torch.linalg.vector_norm(a), "_NormP(2)")
    _check(out, "norm inf", torch.linalg.vector_norm(da, float("inf")), a.abs().max(),
           "_NormP(inf)")
    _check(out, "max(dim) of sharded dim", da.max(0).values, a.max(0).values, "R")
    two = distribute_tensor(a[:2], mesh, [S0])             # 2 rows over 3 ranks: one empty shard
    _check(out, "max with empty shard", two.max(), a[:2].max())
    out["item"] = da.sum().item() == a.sum().item() and bool(da.sum() == a.sum().item())
    out["equal"] = torch.equal(da, distribute_tensor(a, mesh, [S0])) and not torch.equal(da, da + 1)
    return out


@pytest.mark.timeout(60)
def test_pointwise_and_reductions_on_three_ranks() -> None:
    for r in run_threads(_pointwise_and_reductions, 3):
        assert all(v is True for v in r.values()), {k: v for k, v in r.items() if v is not True}


def _matmul_rules(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    a, b, bias = _ints((6, 4), 3), _ints((4, 5), 4), _ints((5,), 5)
    out: dict = {}
    for pa, pb, want in [(S1, S0, "P(sum)"), (S0, R, "S(0)"), (R, S1, "S(1)"), (R, R, "R"),
                         (P, R, "P(sum)")]:
        da = distribute_tensor(a, mesh, [pa]) if pa != P else DTensor.from_local(a / n, mesh, [P])
        db = distribute_tensor(b, mesh, [pb])
        with CommDebugMode() as comm:
            prod = torch.mm(da, db)
        out[f"comm {pa}x{pb}"] = comm.get_total_counts() == 0
        _check(out, f"mm {pa}x{pb}", prod, a @ b, want)
    _check(out, "addmm S1xS0", torch.addmm(distribute_tensor(bias, mesh, [R]),
                                           distribute_tensor(a, mesh, [S1]),
                                            distribute_tensor(b, mesh, [S0])),
           torch.addmm(bias, a, b), "P(sum)")
    _check(out, "addmm RxS1", torch.addmm(distribute_tensor(bias, mesh, [R]),
                                          distribute_tensor(a, mesh, [R]),
                                          distribute_tensor(b, mesh, [S1])),
           torch.addmm(bias, a, b), "S(1)")
    x3 = _ints((2, 3, 4), 6)
    _check(out, "matmul 3-d S0",
           distribute_tensor(x3, mesh, [S0]) @ distribute_tensor(b, mesh, [R]), x3 @ b, "S(0)")
    _check(out, "bmm",
           torch.bmm(distribute_tensor(x3, mesh, [S0]),
                     distribute_tensor(x3.transpose(1, 2), mesh, [S0])),
           torch.bmm(x3, x3.transpose(1, 2)), "S(0)")
    w = torch.nn.Linear(4, 5)
    with torch.no_grad():
        w.weight.copy_(b.t())
        w.bias.copy_(bias)
    col = F.linear(distribute_tensor(x3, mesh, [R]), distribute_tensor(b.t(), mesh, [S0]),
                   distribute_tensor(bias, mesh, [S0]))
    _check(out, "linear colwise", col, w(x3), "S(2)")
    return out


@pytest.mark.timeout(60)
def test_matmul_rules_for_tensor_parallel() -> None:
    for r in run_threads(_matmul_rules, 2):
        assert all(v is True for v in r.values()), {k: v for k, v in r.items() if v is not True}


def _matmul_2d(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    a, b = _ints((5, 6), 7), _ints((6, 3), 8)
    out: dict = {}
    for pa, pb in [((S0, S1), (R, S0)), ((S0, R), (R, S1)), ((S1, S1), (S0, S0)),
                   ((R, S0), (S1, R))]:
        prod = torch.mm(distribute_tensor(a, mesh, list(pa)), distribute_tensor(b, mesh, list(pb)))
        _check(out, f"{pa}x{pb}", prod, a @ b)
    _check(out, "2-d [S0,S1] pointwise+sum", (distribute_tensor(a, mesh, [S0, S1]) * 2).sum(),
           (a * 2).sum(), "P(sum)P(sum)")
    return out


@pytest.mark.timeout(60)
def test_matmul_on_a_2d_mesh() -> None:
    for r in run_threads(_matmul_2d, 4):
        assert all(v is True for v in r.values()), {k: v for k, v in r.items() if v is not True}


def _embedding(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    table = _ints((7, 4), 9)
    idx = torch.tensor([[0, 6, 3], [2, 2, 5]])
    out: dict = {}
    for pw, pi, want in [(S0, R, "P(sum)"), (S1, R, "S(2)"), (R, S0, "S(0)")]:
        w = distribute_tensor(table, mesh, [pw]).requires_grad_()
        e = F.embedding(distribute_tensor(idx, mesh, [pi]), w)
        _check(out, f"embedding {pw} {pi}", e, F.embedding(idx, table), want)
        e.full_tensor().pow(2).sum().backward()
        ref = table.clone().requires_grad_()
        F.embedding(idx, ref).pow(2).sum().backward()
        _check(out, f"embedding grad {pw} {pi}", w.grad, ref.grad)
    return out


@pytest.mark.timeout(60)
def test_embedding_with_sharded_tables() -> None:
    for r in run_threads(_embedding, 3):         # 7 rows over 3 ranks: 3, 3, 1
        assert all(v is True for v in r.values()), {k: v for k, v in r.items() if v is not True}


def _views_and_more(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    x = torch.arange(48.0).reshape(4, 3, 4)
    dx = distribute_tensor(x, mesh, [S0])
    out: dict = {}
    _check(out, "view merge", dx.view(12, 4), x.view(12, 4), "S(0)")
    _check(out, "flatten", dx.flatten(), x.flatten(), "S(0)")
    _check(out, "reshape split", dx.reshape(2, 2, 12), x.reshape(2, 2, 12), "S(0)")
    _check(out, "transpose", dx.transpose(0, 2), x.transpose(0, 2), "S(2)")
    _check(out, "t of 2-d", distribute_tensor(x[0], mesh, [S1]).t(), x[0].t(), "S(0)")
    _check(out, "permute", dx.permute(1, 2, 0), x.permute(1, 2, 0), "S(2)")
    _check(out, "unsqueeze/squeeze", dx.unsqueeze(1).squeeze(1), x, "S(0)")
    _check(out, "select other dim", dx[:, 1], x[:, 1], "S(0)")
    _check(out, "slice sharded dim", dx[1:3], x[1:3], "R")
    _check(out, "expand", distribute_tensor(x[:, :1], mesh, [S0]).expand(4, 5, 4),
           x[:, :1].expand(4, 5, 4), "S(0)")
    _check(out, "cat", torch.cat([dx, dx], 1), torch.cat([x, x], 1), "S(0)")
    _check(out, "split", torch.split(dx, 2, 2)[1], torch.split(x, 2, 2)[1], "S(0)")
    # a local piece with gaps in memory
    gaps = DTensor.from_local(x[rank, :2, :2], mesh, [S0])
    _check(out, "view of a strided piece", gaps.view(8), x[:2, :2, :2].reshape(8), "S(0)")
    uneven = distribute_tensor(x[:3], mesh, [S0])
    _check(out, "view of uneven merge gathers", uneven.view(9, 4), x[:3].view(9, 4), "R")
    _check(out, "softmax", torch.softmax(dx, -1), torch.softmax(x, -1), "S(0)")
    _check(out, "log_softmax along sharded dim", F.log_softmax(dx, 0), F.log_softmax(x, 0), "R")
    ln = torch.nn.LayerNorm(4)
    y = F.layer_norm(dx, (4,), distribute_tensor(ln.weight.detach(), mesh, [R]),
                     distribute_tensor(ln.bias.detach(), mesh, [R]))
    _check(out, "layer_norm", y, ln(x).detach(), "S(0)")
    _check(out, "zeros_like/ones_like", torch.zeros_like(dx) + torch.ones_like(dx),
           torch.ones_like(x), "S(0)")
    _check(out, "fill_ partial", DTensor.from_local(torch.zeros(2), mesh, [P]).fill_(3.0),
           torch.full((2,), 3.0))
    _check(out, "new_zeros other size", dx.new_zeros(2, 2), torch.zeros(2, 2), "R")
    return out


@pytest.mark.timeout(60)
def test_views_shape_ops_norms_and_factories() -> None:
    for r in run_threads(_views_and_more, 2):
        assert all(v is True for v in r.values()), {k: v for k, v in r.items() if v is not True}


def _errors(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    dx = distribute_tensor(torch.arange(8.0), mesh, [S0])
    out: dict = {}
    with pytest.raises(NotImplementedError) as info:
        torch.cumprod(dx, 0)
    out["unsupported"] = str(info.value)
    out["replicated ok"] = torch.equal(torch.cumprod(dx.redistribute(mesh, [R]), 0).to_local(),
                                       torch.cumprod(torch.arange(8.0), 0))
    with pytest.raises(RuntimeError, match="mixed with DTensors") as info2:
        dx + torch.ones(8)
    out["mixed"] = str(info2.value)
    with implicit_replication():
        y = dx + torch.ones(8)
    out["implicit"] = repr(y)
    out["scalar tensor ok"] = repr(dx * torch.tensor(2.0))
    other = init_device_mesh("cpu", (n,), mesh_dim_names=("other",))
    with pytest.raises(ValueError, match="expected every DTensor argument on one DeviceMesh"):
        dx + distribute_tensor(torch.arange(8.0), other, [S0])
    return out


@pytest.mark.timeout(60)
def test_unsupported_ops_and_mixed_tensors_raise_clear_errors() -> None:
    r = run_threads(_errors, 2)[0]
    assert r["unsupported"].startswith("aten.cumprod.default: no DTensor sharding rule for "
                                       "self=DTensor(f32[8@tp] S(0)) on DeviceMesh((tp=2), 'cpu', "
                                       "stride=(1,))")
    assert "redistribute first" in r["unsupported"] and r["replicated ok"]
    assert r["mixed"].startswith("aten.add.Tensor: expected DTensor arguments only, got a "
                                 "torch.Tensor of shape [8]")
    assert (r["implicit"] == "DTensor(f32[8@tp] S(0))"
            and r["scalar tensor ok"] == "DTensor(f32[8@tp] S(0))")
