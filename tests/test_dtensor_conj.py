"""Lazy conjugate and negative views on DTensors ([Note: lazy conjugate and negative] in
``ringlet/dtensor/_api.py``): values, gradients and a rotary-embedding attention under tensor
parallelism, each against plain tensors in one process (rank threads)."""

from __future__ import annotations

import _conj_workers as W
import pytest
import torch

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.dtensor import _plan
from ringlet.testing import run_threads

LAYOUTS = {"R": [Replicate()], "S0": [Shard(0)], "S1": [Shard(1)]}
TOL = 1e-6


def _complex(seed: int, shape: tuple[int, ...] = (4, 6)) -> torch.Tensor:
    return torch.randn(shape, dtype=torch.complex64, generator=torch.Generator().manual_seed(seed))


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    return got.shape == want.shape and bool((got - want).abs().max() < TOL)


def _from_local_views(rank: int, n: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (n,))
    a, b = _complex(0), _complex(1)
    out: dict[str, bool] = {}
    for name, pls in LAYOUTS.items():
        da, db = distribute_tensor(a, mesh, pls), distribute_tensor(b, mesh, pls)
        conj = DTensor.from_local(da.to_local().conj(), mesh, pls)
        out[f"{name} conj*"] = _close((conj * db).full_tensor(), a.conj() * b)
        out[f"{name} conj+"] = _close((conj + 1).full_tensor(), a.conj() + 1)
        out[f"{name} conj local"] = not conj.to_local().is_conj()
        neg = DTensor.from_local(da.to_local().real._neg_view(), mesh, pls)
        out[f"{name} neg+"] = _close((neg + db.real).full_tensor(), -a.real + b.real)
        # the gradient back through from_local and the conjugate view
        t = da.to_local().detach().requires_grad_()
        torch.view_as_real(DTensor.from_local(t.conj(), mesh, pls) * db).sum().backward()
        ref = a.clone().requires_grad_()
        torch.view_as_real(ref.conj() * b).sum().backward()
        local_want = distribute_tensor(ref.grad, mesh, pls).to_local()
        out[f"{name} grad"] = t.grad is not None and _close(t.grad, local_want)
    return out


def test_from_local_of_conj_and_neg_views_computes_the_true_values() -> None:
    for res in run_threads(_from_local_views, 2):
        assert all(v is True for v in res.values()), res


def _conj_method(rank: int, n: int) -> dict[str, bool]:
    mesh = init_device_mesh("cpu", (n,))
    a, b = _complex(2), _complex(3)
    out: dict[str, bool] = {}
    for name, pls in LAYOUTS.items():
        da, db = distribute_tensor(a, mesh, pls), distribute_tensor(b, mesh, pls)
        c = da.conj()
        out[f"{name} placements"] = list(c.placements) == pls
        out[f"{name} conj"] = _close(c.full_tensor(), a.conj())
        out[f"{name} conj*"] = _close((c * db).full_tensor(), a.conj() * b)
        out[f"{name} mH"] = _close(da.mH.full_tensor(), a.mH)
        out[f"{name} resolve"] = _close(c.resolve_conj().full_tensor(), a.conj())
        out[f"{name} conj_physical"] = _close(torch.conj_physical(da).full_tensor(), a.conj())
        out[f"{name} imag of conj"] = _close(c.imag.full_tensor(), -a.imag) if name == "R" else True
    # a sum-Partial stays Partial through conj and the negative view: no communication
    part = DTensor.from_local(a * (rank + 1), mesh, [Partial()])
    with CommDebugMode() as comm:
        pc, pn = part.conj(), torch._neg_view(part)
    out["partial no comm"] = comm.get_total_counts() == 0
    out["partial stays"] = pc.placements == (Partial(),) and pn.placements == (Partial(),)
    out["partial conj"] = _close(pc.full_tensor(), a.conj() * 3)
    out["partial neg"] = _close(pn.full_tensor(), -a * 3)
    # the product's gradient multiplies by the conjugate of the other factor
    x = distribute_tensor(a, mesh, [Shard(0)]).requires_grad_()
    (x * distribute_tensor(b, mesh, [Shard(0)])).abs().sum().backward()
    ref = a.clone().requires_grad_()
    (ref * b).abs().sum().backward()
    out["product grad"] = _close(x.grad.full_tensor(), ref.grad)
    return out


def test_conj_of_sharded_replicated_and_partial_dtensors() -> None:
    for res in run_threads(_conj_method, 2):
        assert all(v is True for v in res.values()), res


def _unruled_flagging_op(rank: int, n: int) -> list[bool]:
    mesh = init_device_mesh("cpu", (n,))
    a, b = _complex(4), _complex(5)
    da, db = distribute_tensor(a, mesh, [Replicate()]), distribute_tensor(b, mesh, [Replicate()])
    # twice: the uncached path, then the cached decision
    return [_close((torch._conj(da) * db).full_tensor(), a.conj() * b) for _ in range(2)]


def test_an_op_without_a_rule_that_returns_a_flagged_tensor_is_resolved(monkeypatch) -> None:
    """The replicate fallback of an op that flags its output (here ``_conj`` with its rule
    removed) resolves the flag, on the uncached and on the cached path."""
    monkeypatch.delitem(_plan.RULES, torch.ops.aten._conj.default, raising=False)
    for res in run_threads(_unruled_flagging_op, 2):
        assert res == [True, True], res


@pytest.mark.timeout(60)
def test_rotary_attention_under_tensor_parallel_matches_one_process() -> None:
    for r in run_threads(W.rotary_tp, 2, False):
        assert max(r["out"]) < 1e-5, r
        for grads in r["grads"]:        # every parameter, every step
            assert len(grads) == 6 and max(grads.values()) < 1e-5, grads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dp", [1, 2], ids=["mesh(1,2)", "mesh(2,1)"])
def test_rotary_attention_under_fully_shard_and_tp_matches_one_process(dp: int) -> None:
    for r in run_threads(W.rotary_2d, 2, dp):
        assert max(r["out"]) < 1e-5, r
        for grads in r["grads"]:
            assert len(grads) == 6 and max(grads.values()) < 1e-5, grads


def test_rotary_attention_under_inference_mode_matches_one_process() -> None:
    for diffs in run_threads(W.rotary_without_grad, 2):
        assert max(diffs) < 1e-5, diffs
