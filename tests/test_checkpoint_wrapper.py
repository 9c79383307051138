"""Activation checkpointing wrappers (torch's ``checkpoint_wrapper`` module path): names and state
dicts as torch's, and training with fully_shard and DDP on rank threads equal to one process."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _workers import seeded
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw

from ringlet.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from ringlet.distributed.fsdp import fully_shard
from ringlet.nn.parallel import DistributedDataParallel
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        self.calls += 1
        return x + torch.tanh(self.fc(x)) * scale


def _model() -> nn.Sequential:
    return nn.Sequential(Block(), Block(), nn.Linear(8, 2))


def test_names_and_state_dicts_are_torchs() -> None:
    def nested() -> nn.Module:
        return nn.Sequential(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), nn.Linear(2, 2))

    ours, theirs = nested(), nested()
    pick = lambda m: isinstance(m, (nn.Sequential, nn.Linear))
    apply_activation_checkpointing(ours, check_fn=pick)
    torch_cw.apply_activation_checkpointing(theirs, check_fn=pick)
    assert repr(ours) == repr(theirs)
    assert list(ours.state_dict()) == list(theirs.state_dict()) == ["0.0.weight", "0.0.bias",
                                                                    "1.weight", "1.bias"]
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert [n for n, _ in ours[1].named_parameters()] == ["weight", "bias"]
    plain = nested()
    ours.load_state_dict(plain.state_dict())               # unwrapped -> wrapped and back
    plain.load_state_dict(theirs.state_dict())
    ours.load_state_dict(theirs.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), theirs.parameters()))
    w = checkpoint_wrapper(nn.Linear(2, 3))
    assert (w.in_features, w.weight.shape) == (2, torch.Size([3, 2]))     # attribute lookups
    assert isinstance(ours[0][0], CheckpointWrapper) and ours[0][1].__class__ is nn.ReLU
    with pytest.raises(TypeError, match="expected an nn.Module, got int"):
        checkpoint_wrapper(3)


@pytest.mark.parametrize("impl", list(CheckpointImpl), ids=lambda i: i.name)
def test_recomputes_in_backward_with_keyword_arguments(impl: CheckpointImpl) -> None:
    block = seeded(0, Block)
    ref = copy.deepcopy(block)
    wrapped = checkpoint_wrapper(block, checkpoint_impl=impl)
    x = torch.randn(3, 8, requires_grad=True)
    wrapped(x, scale=2.0).sum().backward()
    ref(x.detach(), scale=2.0).sum().backward()
    assert block.calls == 2 and ref.calls == 1              # forward again in backward
    torch.testing.assert_close(block.fc.weight.grad, ref.fc.weight.grad)


def test_auto_wrap_policy_sees_the_unwrapped_numel() -> None:
    seen: list[tuple[str, int]] = []

    def policy(module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        seen.append((type(module).__name__, nonwrapped_numel))
        return isinstance(module, Block)
    model = _model()
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=offload_wrapper,
                                   auto_wrap_policy=policy)
    assert [type(m).__name__ for m in model] == ["OffloadWrapper", "OffloadWrapper", "Linear"]
    assert seen == [("Linear", 72), ("Block", 72), ("Linear", 72), ("Block", 72), ("Linear", 18)]
    assert isinstance(model[0], OffloadWrapper)


def _train(rank: int, world: int, how: str) -> list[float]:
    ref = seeded(0, _model)
    model = copy.deepcopy(ref)
    wrap: Any = {"reentrant": lambda m: checkpoint_wrapper(
                     m, checkpoint_impl=CheckpointImpl.REENTRANT),
                 "offload": offload_wrapper}.get(how.split("+")[1], checkpoint_wrapper)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrap,
                                   check_fn=lambda m: isinstance(m, Block))
    if how.startswith("fsdp"):
        for block in model[:2]:
            fully_shard(block)
        fully_shard(model)
    else:
        model = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        full = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(step))
        # reentrant checkpointing needs an input that requires grad (else the block's
        # parameters get no gradient: torch's rule)
        full.requires_grad_(how.endswith("reentrant"))
        for m, o, x in ((model, opt, full.chunk(world)[rank]), (ref, ref_opt, full)):
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    got = model.state_dict()
    assert list(got) == [("module." if how.startswith("ddp") else "") + k
                         for k in ref.state_dict()]
    return [float((_full(v) - w).abs().max()) for v, w in zip(got.values(),
                                                              ref.state_dict().values())]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


@pytest.mark.parametrize("how", ["fsdp+checkpoint", "fsdp+reentrant", "fsdp+offload",
                                 "ddp+checkpoint"])
def test_training_with_fully_shard_and_ddp_matches_one_process(how: str) -> None:
    for diffs in run_threads(_train, 2, how):
        assert max(diffs) < 1e-6, (how, diffs)
