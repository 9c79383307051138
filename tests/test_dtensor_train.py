"""Training with DTensor parameters: torch.optim, clip_grad_norm_, nn.Parameter, state dicts,
modules."""

from __future__ import annotations

import copy
import os
import pickle

import pytest
import torch
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.dtensor import serialization_globals
from ringlet.testing import run_threads

R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _model(seed: int = 0) -> nn.Sequential:
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3))
    # threads share torch's global generator: use our own
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def _shard(model: nn.Sequential, mesh) -> None:
    """Column-wise first layer (weight and bias S(0)), row-wise second (weight S(1), bias R)."""
    for mod, wp, bp in [(model[0], S0, S0), (model[2], S1, R)]:
        mod.weight = nn.Parameter(distribute_tensor(mod.weight.data, mesh, [wp]))
        mod.bias = nn.Parameter(distribute_tensor(mod.bias.data, mesh, [bp]))


def _optim(rank: int, n: int, configs: list) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    dx = distribute_tensor(x, mesh, [R])
    out = {}
    for name, kwargs in configs:
        model, ref = _model(), _model()
        _shard(model, mesh)
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.1, **kwargs)
        ropt = getattr(torch.optim, name)(ref.parameters(), lr=0.1, **kwargs)
        norms = []
        for _ in range(3):
            model(dx).full_tensor().pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
            with CommDebugMode() as comm:
                total = nn.utils.clip_grad_norm_(model.parameters(), 0.5,
                                                 foreach=kwargs.get("foreach"))
            rtotal = nn.utils.clip_grad_norm_(ref.parameters(), 0.5, foreach=kwargs.get("foreach"))
            norms.append((repr(total), comm.get_comm_counts(),
                          torch.allclose(total.full_tensor(), rtotal)))
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
        same = all(torch.allclose(p.full_tensor(), q, atol=1e-5)
                   for p, q in zip(model.parameters(), ref.parameters()))
        state = opt.state[model[0].weight]
        out[f"{name} {kwargs}"] = (same, norms,
                                   sorted(repr(v) for k, v in state.items() if k != "step"))
    return out


CONFIGS = [("SGD", {"momentum": 0.9, "weight_decay": 0.01, "foreach": False}),
           ("SGD", {"momentum": 0.9, "weight_decay": 0.01, "foreach": True}),
           ("Adam", {"weight_decay": 0.01, "foreach": False}),
           ("Adam", {"foreach": True, "amsgrad": True}),
           ("AdamW", {"weight_decay": 0.1, "foreach": False}),
           ("AdamW", {"weight_decay": 0.1, "foreach": True}),
           # fused steps: the per-parameter step counts are 0-d plain tensors in a list
           ("SGD", {"momentum": 0.9, "fused": True}),
           ("Adam", {"fused": True}),
           ("AdamW", {"weight_decay": 0.1, "amsgrad": True, "fused": True}),
           ("Adagrad", {"fused": True})]


@pytest.mark.timeout(90)
def test_optimizers_and_clip_grad_norm_match_full_tensors() -> None:
    for r in run_threads(_optim, 2, CONFIGS, timeout=80):
        for key, (same, norms, state) in r.items():
            assert same, key
            for total, counts, close in norms:          # the global norm, reduced once
                assert (total == "DTensor(f32[] _NormP(2.0))" and counts == {"all_reduce": 1}
                        and close), key
            assert all(s == "DTensor(f32[5@0,4] S(0))" for s in state), (key, state)


def test_optimizers_default_to_foreach_kernels_for_dtensors(monkeypatch) -> None:
    """Where torch.optim and clip_grad_norm_ default to their multi-tensor kernels (GPUs; the
    CPU is made one here), they do for DTensor parameters too, not a loop per parameter."""
    import torch.optim.optimizer as optim_mod
    import torch.utils._foreach_utils as foreach_mod

    monkeypatch.setattr(optim_mod, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])
    monkeypatch.setattr(foreach_mod, "_get_foreach_kernels_supported_devices", lambda: ["cpu"])

    def body(rank: int, n: int) -> tuple[tuple[bool, bool], bool]:
        mesh = init_device_mesh("cpu", (n,))
        p = nn.Parameter(distribute_tensor(torch.ones(4, 2), mesh, [S0]))
        p.grad = distribute_tensor(torch.ones(4, 2), mesh, [S0])
        return (optim_mod._default_to_fused_or_foreach([p], differentiable=False),
                foreach_mod._has_foreach_support([p.grad], p.device))
    assert run_threads(body, 2) == [((False, True), True)] * 2


def _state_dicts(rank: int, n: int, tmp: str) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    model, full = _model(), _model()
    _shard(model, mesh)
    out = {"param": (isinstance(model[0].weight, nn.Parameter), repr(model[0].weight),
                     type(model[0].weight).__name__)}
    path = os.path.join(tmp, f"rank{rank}.pt")
    torch.save(model.state_dict(), path)
    loaded = torch.load(path, weights_only=False)
    out["loaded"] = (repr(loaded["0.weight"]), loaded["0.weight"].device_mesh is mesh,
                     all(torch.equal(loaded[k].to_local(), v.to_local())
                         for k, v in model.state_dict().items()))
    fresh = _model(seed=5)
    fresh.load_state_dict(loaded, assign=True)
    out["assign"] = (repr(fresh[2].weight), isinstance(fresh[2].weight, nn.Parameter),
                     fresh[2].weight.requires_grad,
                     torch.equal(fresh[2].weight.full_tensor(), full[2].weight))
    other = _model(seed=7)
    _shard(other, mesh)
    other.load_state_dict(full.state_dict())            # full plain tensors copied into shards
    out["copy full"] = all(torch.equal(p.full_tensor(), q)
                           for p, q in zip(other.parameters(), full.parameters()))
    clone = copy.deepcopy(model)
    out["deepcopy"] = (repr(clone[0].weight), isinstance(clone[0].weight, nn.Parameter),
                       clone[0].weight.device_mesh is mesh,
                       clone[0].weight.to_local().data_ptr()
                       != model[0].weight.to_local().data_ptr())
    if rank == 0:        # safe_globals() edits a process-wide allow-list: one rank thread at a time
        with torch.serialization.safe_globals(serialization_globals()):
            out["weights_only"] = repr(torch.load(path, weights_only=True)["2.weight"])
    model.double()                          # module dtype conversion swaps in new DTensors
    out["double"] = (repr(model[0].weight), model[0].weight.to_local().dtype,
                     isinstance(model[0].weight, nn.Parameter))
    with open(path, "wb") as f:
        pickle.dump(distribute_tensor(torch.ones(3), mesh, [S0]), f)
    return out


@pytest.mark.timeout(60)
def test_parameters_state_dict_save_load_assign_and_deepcopy(tmp_path) -> None:
    res = run_threads(_state_dicts, 2, str(tmp_path))
    for r in res:
        assert r["param"] == (True, "DTensor(f32[5@tp,4] S(0))", "DTensor")
        assert r["loaded"] == ("DTensor(f32[5@tp,4] S(0))", True, True)
        assert r["assign"] == ("DTensor(f32[3,5@tp] S(1))", True, True, True)
        assert r["copy full"]
        assert r["deepcopy"] == ("DTensor(f32[5@tp,4] S(0))", True, True, True)
        assert r["double"] == ("DTensor(f64[5@tp,4] S(0))", torch.float64, True)
    assert res[0]["weights_only"] == "DTensor(f32[3,5@tp] S(1))"
    with (open(tmp_path / "rank0.pt", "rb") as f,
          pytest.raises(ValueError, match="expected an initialized process")):
        pickle.load(f)             # no world here: the mesh cannot be reattached


def _modules(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    model, ref = _model(), _model()
    model.register_buffer("scale", torch.tensor([2.0]))

    def shard_first(name: str, mod: nn.Module, m) -> None:
        if name == "0":
            mod.weight = nn.Parameter(distribute_tensor(mod.weight.data, m, [S0]))

    def to_dtensor(mod: nn.Module, inputs: tuple, m) -> tuple:
        return (DTensor.from_local(inputs[0], m, [R]),)

    def to_local(mod: nn.Module, outputs: DTensor, m) -> torch.Tensor:
        return outputs.full_tensor()

    distribute_module(model, mesh, shard_first, to_dtensor, to_local)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(2))
    y = model(x)
    out = {"placements": [repr(p) for p in model.parameters()], "buffer": repr(model.scale),
           "forward": type(y).__name__ == "Tensor" and torch.allclose(y, ref(x), atol=1e-5)}
    with pytest.raises(RuntimeError, match="already"):
        distribute_module(model, mesh)
    plain = distribute_module(_model(), mesh)
    out["default"] = {repr(p.placements) for p in plain.parameters()}
    # replicated: any op runs locally
    logits = plain(distribute_tensor(x, mesh, [R]))
    loss = nn.functional.cross_entropy(logits,
                                       distribute_tensor(torch.tensor([0, 2, 1]), mesh, [R]))
    # a DTensor loss: grad seeded with R ones
    loss.backward()
    ref_loss = nn.functional.cross_entropy(ref(x), torch.tensor([0, 2, 1]))
    ref_loss.backward()
    out["loss"] = (repr(loss), torch.allclose(loss.full_tensor(), ref_loss),
                   torch.allclose(plain[0].weight.grad.full_tensor(),
                                  ref[0].weight.grad, atol=1e-6))
    return out


@pytest.mark.timeout(60)
def test_distribute_module() -> None:
    r = run_threads(_modules, 2)[0]
    assert r["placements"] == ["DTensor(f32[5@0,4] S(0))", "DTensor(f32[5] R)",
                               "DTensor(f32[3,5] R)", "DTensor(f32[3] R)"]
    assert r["buffer"] == "DTensor(f32[1] R)" and r["forward"]
    assert r["default"] == {"(Replicate(),)"}
    assert r["loss"] == ("DTensor(f32[] R)", True, True)
