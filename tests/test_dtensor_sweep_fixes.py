"""What the op-database sweep (scripts/dtensor_opdb.py) found wrong, each checked on its own
against plain tensors (rank threads): in-place views, kernels that make conjugate views on
their own, 0-d inputs of dim-taking rules, non-strided results."""

from __future__ import annotations

import pytest
import torch

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ringlet.testing import run_threads

LAYOUTS = {"R": [Replicate()], "S0": [Shard(0)], "S1": [Shard(1)]}


def _t(seed: int, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(shape, dtype=dtype, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool((got - want).abs().max() < 1e-5)


def _in_place_views(rank: int, n: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (n,))
    a = _t(0, 4, 6)
    out: dict[str, object] = {}
    for name, pls in LAYOUTS.items():
        for op, fn in {"unsqueeze_": lambda t: t.unsqueeze_(1),
                       "transpose_": lambda t: t.transpose_(0, 1),
                       "t_": lambda t: t.t_(),
                       "squeeze_": lambda t: t.unsqueeze_(0).squeeze_(0)}.items():
            d = distribute_tensor(a, mesh, pls)
            local = d._local_tensor
            r = fn(d)
            want = fn(a.clone())
            ok = (r is d and d.shape == want.shape and d.stride() == want.stride()
                  and _close(d.full_tensor(), want) and _close((d * 2).full_tensor(), want * 2)
                  and d._local_tensor is local)       # the local piece changed in place
            out[f"{name} {op}"] = ok or (d.shape, d.placements, want.shape)
    d = distribute_tensor(a, mesh, [Shard(0)])
    with pytest.raises(NotImplementedError, match="as_strided_"):
        d.as_strided_((6, 4), (1, 6))
    return out


def test_in_place_views_change_the_dtensor_and_its_local_piece() -> None:
    for res in run_threads(_in_place_views, 2):
        assert all(v is True for v in res.values()), {k: v for k, v in res.items() if v is not True}


def _sweep_findings(rank: int, n: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (n,))
    out: dict[str, bool] = {}
    # matmul of a vector: its decomposition squeezes in place (forward and backward)
    v, m = _t(1, 6), _t(2, 6, 4)
    dv = distribute_tensor(v, mesh, [Replicate()]).requires_grad_()
    dm = distribute_tensor(m, mesh, [Shard(1)]).requires_grad_()
    (dv @ dm).sum().backward()
    pv, pm = v.clone().requires_grad_(), m.clone().requires_grad_()
    (pv @ pm).sum().backward()
    out["vector @ matrix grads"] = (_close(dv.grad.full_tensor(), pv.grad)
                                    and _close(dm.grad.full_tensor(), pm.grad))
    # a kernel without a rule that conjugates internally (pinv uses A^H)
    c = _t(3, 5, 5, dtype=torch.complex64)
    dc = distribute_tensor(c, mesh, [Replicate()])
    out["complex pinv"] = _close(torch.linalg.pinv(dc).full_tensor(), torch.linalg.pinv(c))
    out["complex lstsq"] = _close(torch.linalg.lstsq(dc, dc).solution.full_tensor(),
                                  torch.linalg.lstsq(c, c).solution)
    # 0-d input of a rule that normalizes a dim
    s, idx = torch.tensor(2.5), torch.tensor([0])
    ds = distribute_tensor(s, mesh, [Replicate()])
    di = distribute_tensor(idx, mesh, [Replicate()])
    out["0-d index_select"] = _close(torch.index_select(ds, 0, di).full_tensor(),
                                     torch.index_select(s, 0, idx))
    try:
        distribute_tensor(_t(4, 3, 3), mesh, [Replicate()]).to_sparse()
        out["to_sparse refused"] = False
    except NotImplementedError as e:
        out["to_sparse refused"] = "aten._to_sparse" in str(e) and "strided" in str(e)
    out["is DTensor"] = isinstance(dv.grad, DTensor)
    return out


def test_what_the_op_sweep_found() -> None:
    for res in run_threads(_sweep_findings, 2):
        assert all(res.values()), res
