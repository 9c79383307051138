"""copy.deepcopy of fully_shard modules: an independent copy of the sharded state, never a crash.

(Before: deepcopy after one forward/backward read the freed unsharded storage and killed the
interpreter with a segmentation fault, even on one rank.)
"""

from __future__ import annotations

import copy

import pytest
import torch
from _fsdp_workers import batch, full_params, loss_fn, make_model, make_opt, shard_model
from torch import nn

from ringlet.distributed.fsdp import FSDPModule
from ringlet.distributed.tensor import DTensor
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _step(model: nn.Module, opt: torch.optim.Optimizer, kind: str, step: int, rank: int,
          world: int) -> float:
    x, y = batch(kind, step, 2 * world)
    loss = loss_fn(kind, model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2])
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss.item()


def _sharded_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.to_local().clone() for n, p in model.named_parameters() if p.grad is not None}


def _copy_after_training(rank: int, world: int, kind: str, raf: bool | None) -> dict[str, object]:
    model = shard_model(make_model(kind), reshard_after_forward=raf)
    opt = make_opt(model.parameters())
    _step(model, opt, kind, 0, rank, world)
    x, y = batch(kind, 1, 2 * world)
    loss_fn(kind, model, x[:2], y[:2]).backward()          # leave gradients in place
    twin = copy.deepcopy(model)
    out: dict[str, object] = {"type": type(twin) is type(model),
                              "fsdp": isinstance(twin, FSDPModule)}
    mine, theirs = _sharded_grads(model), _sharded_grads(twin)
    out["grads"] = (sorted(mine) == sorted(theirs)
                    and all(torch.equal(mine[k], theirs[k]) for k in mine))
    pa, pb = dict(model.named_parameters()), dict(twin.named_parameters())
    out["params"] = all(isinstance(pb[k], DTensor)
                        and torch.equal(pa[k].to_local(), pb[k].to_local())
                        and pa[k].to_local().data_ptr() != pb[k].to_local().data_ptr() for k in pa)
    # Both continue identically from the same state, with their own optimizers ...
    # (SGD with momentum: its state starts empty for both, so the pair stays comparable.)
    opt_a, opt_b = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, twin))
    for step in range(2, 4):
        _step(model, opt_a, kind, step, rank, world)
        _step(twin, opt_b, kind, step, rank, world)
    a, b = full_params(model), full_params(twin)
    out["same_training"] = max((a[k] - b[k]).abs().max().item() for k in a)
    # ... and independently: changing the copy leaves the original alone.
    before = full_params(model)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
    after = full_params(model)
    out["independent"] = all(torch.equal(before[k], after[k]) for k in before)
    return out


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize(("kind", "raf"), [("mlp", None), ("transformer", False)])
def test_deepcopy_after_forward_backward_copies_the_sharded_state(world: int, kind: str,
                                                                  raf: bool | None) -> None:
    for r in run_threads(_copy_after_training, world, kind, raf):
        assert r["type"] and r["fsdp"] and r["grads"] and r["params"] and r["independent"], r
        assert r["same_training"] < 1e-6, r


def _copy_during_no_sync(rank: int, world: int) -> float:
    """Gradients accumulated unsharded (sync off) survive the copy and are reduced by it."""
    model = shard_model(make_model("mlp"))
    model.set_requires_gradient_sync(False)
    x, y = batch("mlp", 0, 2 * world)
    loss_fn("mlp", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
    twin = copy.deepcopy(model)
    for m in (model, twin):
        m.set_requires_gradient_sync(True)
        x, y = batch("mlp", 1, 2 * world)
        loss_fn("mlp", m, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
    a, b = _sharded_grads(model), _sharded_grads(twin)
    return max((a[k] - b[k]).abs().max().item() for k in a)


def test_deepcopy_keeps_gradients_accumulated_without_sync() -> None:
    assert max(run_threads(_copy_during_no_sync, 2)) < 1e-6


def _copy_inside_forward(rank: int, world: int) -> str:
    model = shard_model(make_model("mlp"))
    seen: list[str] = []

    def hook(module: nn.Module, args: object, output: object) -> None:
        try:
            copy.deepcopy(model)
        except RuntimeError as e:
            seen.append(str(e))
    model.layers[0].register_forward_hook(hook)
    x, _ = batch("mlp", 0, 2)
    model(x).sum().backward()
    copy.deepcopy(model)                     # idle again: fine
    return seen[0] if seen else ""


def test_deepcopy_inside_forward_is_refused_clearly() -> None:
    msg = run_threads(_copy_inside_forward, 1)[0]
    assert "expected" in msg and "idle" in msg and "forward" in msg, msg


def _copy_unsharded(rank: int, world: int) -> tuple[bool, float]:
    """An eval forward with reshard_after_forward=False leaves the groups unsharded: still
    copyable."""
    model = shard_model(make_model("mlp"), reshard_after_forward=False)
    x, _ = batch("mlp", 0, 2)
    with torch.no_grad():
        want = model(x)
    unsharded = type(model.layers[0].weight) is nn.Parameter
    twin = copy.deepcopy(model)
    with torch.no_grad():
        got = twin(x)
    return unsharded, (got - want).abs().max().item()


def test_deepcopy_of_an_unsharded_module() -> None:
    for unsharded, diff in run_threads(_copy_unsharded, 2):
        assert unsharded and diff == 0.0
