"""Tensor parallel inside DDP through ``_pre_dp_module_transform`` (issue 26): what the module
holds after forward and after backward.  Outside forward the module lists its DTensor parameters
(global shape), whose ``.grad`` after backward is the DTensor of the gradient DDP reduced, so
``named_parameters()`` and their gradients compare with a dense one-process model, and optimizers
built before or after the first forward train alike (2 rank threads, a (1, 2) dp x tp mesh)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    parallelize_module,
)
from ringlet.distributed.tensor.parallel.ddp import _pre_dp_module_transform
from ringlet.nn.parallel import DistributedDataParallel as DDP
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 16)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(16, 10)
        g = torch.Generator().manual_seed(0)        # rank threads share torch's global RNG
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _compare(dense: nn.Module, ddp: nn.Module, grads: bool) -> dict[str, tuple]:
    """name -> (type, shape, max |difference|) of each parameter (or gradient) of ``ddp``."""
    want = dict(dense.named_parameters())
    out = {}
    for name, p in ddp.named_parameters():
        ref = want[name.removeprefix("module.")]
        ours, ref = (p.grad, ref.grad) if grads else (p, ref)
        out[name] = (type(ours).__name__, tuple(ours.shape),
                     (_full(ours) - ref).abs().max().item())
    return out


def _tp_ddp(rank: int, world: int, late_optimizer: bool) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    dense = MLP()
    model = parallelize_module(copy.deepcopy(dense), mesh["tp"],
                               {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    _pre_dp_module_transform(model)
    ddp = DDP(model, process_group=mesh["dp"].get_group())
    before = sorted({type(p).__name__ for p in ddp.parameters()})
    dense_opt = torch.optim.SGD(dense.parameters(), lr=0.1)
    opt = None if late_optimizer else torch.optim.SGD(ddp.parameters(), lr=0.1)
    out: dict[str, object] = {"before": before}
    for step in range(3):
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
        dense(x).sum().backward()
        y = ddp(x)
        out[f"fwd{step}"] = (_full(y) - dense(x)).abs().max().item()
        out[f"after_fwd{step}"] = sorted({type(p).__name__ for p in ddp.parameters()})
        y.sum().backward()
        out[f"grads{step}"] = _compare(dense, ddp, grads=True)
        if opt is None:                         # built over the DTensor parameters
            opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        opt.step()
        dense_opt.step()
        out[f"params{step}"] = _compare(dense, ddp, grads=False)
        opt.zero_grad()
        dense_opt.zero_grad()
    out["attr"] = (type(model.net1.weight).__name__, tuple(model.net1.weight.shape))
    sd = ddp.state_dict()                      # DTensors, loaded back while DTensors are registered
    full = {k: v.full_tensor().clone() for k, v in sd.items()}
    for source in (full, {k: v.detach().clone() for k, v in sd.items()}):
        with torch.no_grad():
            for p in ddp.parameters():
                p.zero_()
        ddp.load_state_dict(source)
        out.setdefault("reload", []).append(_compare(dense, ddp, grads=False))
    return out


@pytest.mark.parametrize("late_optimizer", [False, True])
def test_tp_ddp_parameters_and_gradients_match_a_dense_model(late_optimizer: bool) -> None:
    for r in run_threads(_tp_ddp, 2, late_optimizer):
        assert r["before"] == ["Parameter"], r        # what DDP is built over: local pieces
        assert r["attr"] == ("DTensor", (16, 10)), r
        for step in range(3):
            assert r[f"fwd{step}"] < 1e-5, r
            assert r[f"after_fwd{step}"] == ["DTensor"], r
            for key in (f"grads{step}", f"params{step}"):
                got = r[key]
                assert sorted(got) == ["module.net1.bias", "module.net1.weight",
                                       "module.net2.bias", "module.net2.weight"], got
                assert got["module.net1.weight"][:2] == ("DTensor", (16, 10)), got
                assert max(d for _, _, d in got.values()) < 1e-5, (key, got)
        for got in r["reload"]:
            assert max(d for _, _, d in got.values()) < 1e-5, got


def _optimizer_state(rank: int, world: int) -> dict[str, float]:
    from ringlet.distributed.checkpoint.state_dict import (
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    dense = MLP()
    model = parallelize_module(copy.deepcopy(dense), mesh["tp"],
                               {"net1": ColwiseParallel(), "net2": RowwiseParallel()})
    ddp = DDP(model, device_mesh=mesh["dp"])             # applies the transform itself
    opt = torch.optim.Adam(ddp.parameters(), lr=0.1)     # over the local pieces
    dense_opt = torch.optim.Adam(dense.parameters(), lr=0.1)
    for step in range(2):
        x = torch.randn(4, 10, generator=torch.Generator().manual_seed(step))
        ddp(x).sum().backward()
        dense(x).sum().backward()
        opt.step()
        dense_opt.step()
    want = {n: dense_opt.state[p]["exp_avg"] for n, p in dense.named_parameters()}
    osd = get_optimizer_state_dict(ddp, opt)             # keyed by name, DTensor moments
    out = {n: (osd["state"][n]["exp_avg"].full_tensor() - w).abs().max().item()
           for n, w in want.items()}
    saved = {"state": {n: {k: v.full_tensor().clone() if isinstance(v, DTensor) else v.clone()
                           for k, v in st.items()} for n, st in osd["state"].items()},
             "param_groups": osd["param_groups"]}
    for st in opt.state.values():
        st["exp_avg"].zero_()
    set_optimizer_state_dict(ddp, opt, saved)            # full tensors -> local pieces
    locals_ = dict(zip(want, [p for g in opt.param_groups for p in g["params"]], strict=True))
    views = dict(model.named_parameters())               # the DTensor parameters
    for n, p in locals_.items():
        got, v = opt.state[p]["exp_avg"], views[n]
        out[f"reloaded {n}"] = -1.0 if isinstance(got, DTensor) else (DTensor.from_local(
            got, v.device_mesh, v.placements, shape=v.shape).full_tensor() - want[n]
        ).abs().max().item()
    return out


def test_tp_ddp_optimizer_state_dict_holds_dtensor_moments() -> None:
    for r in run_threads(_optimizer_state, 2):
        assert sorted(r)[:4] == ["net1.bias", "net1.weight", "net2.bias", "net2.weight"], r
        assert all(0.0 <= d < 1e-5 for d in r.values()), sorted(r.items())
