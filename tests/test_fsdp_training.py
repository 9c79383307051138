"""fully_shard inside real training loops: checkpointing, clipping, recovery, HSDP accumulation."""

from __future__ import annotations

import copy

import pytest
import torch
from _fsdp_workers import (
    _INIT_LOCK,
    Transformer,
    batch,
    full_params,
    loss_fn,
    make_model,
    make_opt,
    shard_model,
)
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


class Checkpointed(Transformer):
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            # recomputed (and re-gathered) in backward
            x = checkpoint(blk, x, use_reentrant=False)
        return self.head(self.ln(x))


def _checkpoint_and_clip(rank: int, world: int) -> tuple[float, float, float]:
    def clip_step(model: nn.Module, opt: torch.optim.Optimizer) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    with _INIT_LOCK:
        torch.manual_seed(0)
        model = Checkpointed()
    ref = copy.deepcopy(model)
    shard_model(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(3):
        x, y = batch("transformer", step, 4)
        loss_fn("transformer", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
        loss_fn("transformer", ref, x, y).backward()
        norm, ref_norm = clip_step(model, opt), clip_step(ref, ref_opt)
    got, want = full_params(model), full_params(ref)
    return norm, ref_norm, max((got[k] - want[k]).abs().max().item() for k in want)


def test_activation_checkpointing_and_gradient_clipping() -> None:
    for norm, ref_norm, diff in run_threads(_checkpoint_and_clip, 2):
        assert norm == pytest.approx(ref_norm, rel=1e-5) and diff < 1e-5


class Flaky(Transformer):
    fail = False

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        x = self.blocks[0](x)
        if self.fail:
            raise RuntimeError("injected")
        return self.head(self.ln(self.blocks[1](x)))


def _recover(rank: int, world: int) -> tuple[str, str, float]:
    with _INIT_LOCK:
        torch.manual_seed(0)
        model = Flaky()
    ref = copy.deepcopy(model)
    shard_model(model)
    x, y = batch("transformer", 0, 2)
    model.fail = True
    with pytest.raises(RuntimeError, match="injected"):
        loss_fn("transformer", model, x, y)
    model.fail = False
    with pytest.raises(AssertionError, match="reset_iter_state") as stuck:
        loss_fn("transformer", model, x, y)
    model.reset_iter_state()
    with pytest.raises(RuntimeError, match="expected the root module"):
        model.blocks[0].reset_iter_state()
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    for step in range(2):
        x, y = batch("transformer", step, 4)
        loss_fn("transformer", model, x[2 * rank:2 * rank + 2], y[2 * rank:2 * rank + 2]).backward()
        loss_fn("transformer", ref, x, y).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    got, want = full_params(model), full_params(ref)
    return (str(stuck.value).split(":")[0], type(model).__name__,
            max((got[k] - want[k]).abs().max().item() for k in want))


def test_reset_iter_state_recovers_after_a_forward_raised() -> None:
    for where, name, diff in run_threads(_recover, 2):
        assert where == "fully_shard(FSDPFlaky)"            # the root was left in FORWARD
        assert name == "FSDPFlaky" and diff < 1e-5


def _hsdp_partial(rank: int, world: int) -> tuple[list[int], float]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    always = shard_model(make_model("transformer"), mesh=mesh)
    partial = shard_model(make_model("transformer"), mesh=mesh)
    rep = mesh.get_group("replicate")
    counts = []
    for micro in range(2):
        x, y = batch("transformer", micro, 8)
        mine = slice(2 * rank, 2 * rank + 2)
        loss_fn("transformer", always, x[mine], y[mine]).backward()
        partial.set_requires_all_reduce(micro == 1)
        rep.reset_counts()
        loss_fn("transformer", partial, x[mine], y[mine]).backward()
        counts.append(rep.counts().get("all_reduce", 0))
    a = {n: p.grad.full_tensor() for n, p in always.named_parameters()}
    b = {n: p.grad.full_tensor() for n, p in partial.named_parameters()}
    return counts, max((a[k] - b[k]).abs().max().item() for k in a)


def test_hsdp_accumulation_without_all_reduce_matches_always_all_reducing() -> None:
    for counts, diff in run_threads(_hsdp_partial, 4):
        assert counts == [0, 3] and diff < 1e-6
