"""Activation checkpointing wrappers (torch's ``checkpoint_wrapper`` module path): names and state
dicts as torch's, and training with fully_shard and DDP on rank threads equal to one process."""

from __future__ import annotations

import copy
import functools
from typing import Any

import pytest
import torch
from _workers import seeded
from torch import nn
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_cw
from torch.distributed.fsdp import wrap as torch_wrap

from ringlet.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_wrapper,
    offload_wrapper,
)
from ringlet.distributed.fsdp import fully_shard
from ringlet.distributed.fsdp import wrap as ringlet_wrap
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
    off = offload_wrapper(nn.Linear(2, 2))
    assert isinstance(off, OffloadWrapper) and list(off.state_dict()) == ["weight", "bias"]
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


class Nested(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.inner = nn.Sequential(nn.Linear(8, 4))


def _nested() -> nn.Module:
    return nn.Sequential(Nested(), nn.Sequential(Nested(), nn.Linear(8, 2)),
                         nn.MultiheadAttention(8, 2))


POLICIES = {
    "ModuleWrapPolicy": lambda w: w.ModuleWrapPolicy({Nested}),
    "size_based": lambda w: functools.partial(w.size_based_auto_wrap_policy, min_num_params=50),
    "transformer": lambda w: functools.partial(w.transformer_auto_wrap_policy,
                                               transformer_layer_cls={Nested, nn.Linear}),
    "lambda": lambda w: functools.partial(w.lambda_auto_wrap_policy,
                                          lambda_fn=lambda m: isinstance(m, nn.Sequential)),
    "always": lambda w: w.always_wrap_policy,
}


@pytest.mark.parametrize("name", list(POLICIES))
def test_auto_wrap_policies_ask_and_wrap_as_torchs(name: str) -> None:
    """Each of torch's wrap policies (at torch's module path) with apply_activation_checkpointing:
    the same questions in the same order (module, recurse, unwrapped numel) and the same
    wrapped model as torch's."""
    got = []
    for apply, wrap_mod in ((torch_cw.apply_activation_checkpointing, torch_wrap),
                            (apply_activation_checkpointing, ringlet_wrap)):
        asked: list[tuple[str, bool, int]] = []
        policy = POLICIES[name](wrap_mod)

        def spy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                policy: Any = policy, asked: list = asked) -> bool:
            asked.append((type(module).__name__, recurse, nonwrapped_numel))
            return policy(module=module, recurse=recurse, nonwrapped_numel=nonwrapped_numel)
        model = _nested()
        apply(model, auto_wrap_policy=spy)
        got.append((repr(model), asked))
    assert got[0] == got[1]


def test_custom_policy_is_callable_here() -> None:
    """torch's CustomPolicy is only for FSDP1's auto-wrap; ringlet's is also a policy callable."""
    policy = ringlet_wrap.CustomPolicy(lambda m: {"x": 1} if isinstance(m, nn.Linear) else {})
    assert policy(module=nn.ReLU(), recurse=True) and policy(nn.Linear(1, 1), False)
    assert not policy(nn.ReLU(), recurse=False)


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
