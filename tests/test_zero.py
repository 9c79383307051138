"""ZeroRedundancyOptimizer: parity with the unsharded optimizer, sharded state, state dicts, Join.

The rank bodies live in ``_dp_workers`` and run on threads; one process test runs
them over shared memory side by side with torch's own ZeroRedundancyOptimizer on gloo.
"""

from __future__ import annotations

from typing import Any

import _dp_workers
import pytest
import torch
from _dp_workers import make_params, set_grads, zero_parity, zero_state_dict_round_trip

import ringlet.distributed as dist
from ringlet.distributed.algorithms.join import Join, Joinable, JoinHook
from ringlet.distributed.optim import ZeroRedundancyOptimizer
from ringlet.parallel.zero import partition_parameters
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world


@pytest.mark.timeout(10)
def test_partition_is_greedy_largest_first() -> None:
    # torch's ZeroRedundancyOptimizer gives rank 0 the sizes (10, 5, 2) and rank 1 (7, 7, 3) here.
    assert partition_parameters([[3, 10, 7, 7, 2, 5]], 2) == [[1, 0, 1, 1, 0, 0]]
    # loads carry over from one parameter group to the next
    assert partition_parameters([[4, 4], [1, 1, 1]], 3) == [[0, 1], [2, 2, 2]]
    assert partition_parameters([[5], []], 4) == [[0], []]
    with pytest.raises(ValueError, match="world_size >= 1"):
        partition_parameters([[1]], 0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("opt,bucket_view,split,n", [
    ("adam", False, None, 2), ("sgd", False, 3, 3), ("adamw", True, 2, 2), ("adam", True, None, 3),
])
def test_steps_match_the_unsharded_optimizer(opt: str, bucket_view: bool, split: int | None,
                                             n: int) -> None:
    shards = run_threads(zero_parity, n, opt, bucket_view, split)
    # Memory: each rank holds state for its own shard only; together they cover every parameter
    # once.
    flat = sorted(i for s in shards for i in s)
    assert flat == list(range(len(_dp_workers.PARAM_SHAPES)))
    sizes = [sum(torch.Size(_dp_workers.PARAM_SHAPES[i]).numel() for i in s) for s in shards]
    total = sum(sizes)
    assert max(sizes) <= total / n + max(torch.Size(s).numel() for s in _dp_workers.PARAM_SHAPES)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("to", [0, 1])
def test_state_dict_round_trip(to: int) -> None:
    run_threads(zero_state_dict_round_trip, 2, to)


def _add_group_and_schedule(rank: int, world_size: int) -> None:
    params, ref_params = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(params[:4], torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(ref_params[:4], lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(zero, step_size=1, gamma=0.5)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    for step in range(4):
        if step == 2:      # unfreeze the rest, as when fine-tuning
            zero.add_param_group({"params": params[4:], "lr": 0.03})
            ref.add_param_group({"params": ref_params[4:], "lr": 0.03})
        set_grads(params, step)
        set_grads(ref_params, step)
        loss = zero.step(lambda: 7.0)
        ref.step()
        sched.step()
        ref_sched.step()
        assert loss == 7.0
        for p, q in zip(params, ref_params):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert [g["lr"] for g in zero.param_groups] == [g["lr"] for g in ref.param_groups]
    zero.zero_grad()
    assert all(p.grad is None for p in params)


@pytest.mark.timeout(60)
def test_add_param_group_lr_scheduler_closure() -> None:
    run_threads(_add_group_and_schedule, 2)


def _uneven_join(rank: int, world_size: int) -> list[torch.Tensor]:
    params = make_params()
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1)
    # the same gradient every step, so a joined rank's stale one is right
    set_grads(params, 0)
    with Join([zero]):
        for _ in range(2 + rank):
            zero.step()
    ref_params = make_params()
    ref = torch.optim.SGD(ref_params, lr=0.1)
    set_grads(ref_params, 0)
    for _ in range(2 + world_size - 1):
        ref.step()
    for p, q in zip(params, ref_params):
        torch.testing.assert_close(p.detach(), q.detach())
    return [p.detach() for p in params]


@pytest.mark.timeout(60)
def test_join_shadows_the_broadcasts_of_ranks_with_more_steps() -> None:
    out = run_threads(_uneven_join, 3)
    for other in out[1:]:
        for a, b in zip(out[0], other):
            assert torch.equal(a, b)


def _misc(rank: int, world_size: int) -> dict[str, Any]:
    params = make_params()
    with pytest.raises(NotImplementedError, match="overlap_with_ddp"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, overlap_with_ddp=True, lr=0.1)
    with pytest.raises(TypeError, match="got a Tensor"):
        ZeroRedundancyOptimizer(params[0], torch.optim.SGD, lr=0.1)
    with pytest.raises(ValueError, match=r"expected to in \[0, 1\], got 2"):
        ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1).consolidate_state_dict(to=2)
    g = dist.new_group([0, 1])
    zero = ZeroRedundancyOptimizer(params, torch.optim.SGD, process_group=g, lr=0.1)
    with pytest.raises(ValueError, match="parameter groups of sizes"):
        zero.load_state_dict({"state": {}, "param_groups": [{"params": [0]}]})
    # Freezing a parameter between steps re-packs the buckets (bucket view).
    bucketed = ZeroRedundancyOptimizer(make_params(), torch.optim.SGD,
                                       parameters_as_bucket_view=True, lr=0.1)
    ps = [p for grp in bucketed.param_groups for p in grp["params"]]
    ps[0].requires_grad_(False)
    set_grads(ps, 0)
    ps[0].grad = None
    bucketed.step()
    return {"repr": repr(zero), "device": zero.join_device, "group": zero.join_process_group is g,
            "p0": ps[0].detach().clone(), "p1": ps[1].detach().clone()}


@pytest.mark.timeout(30)
def test_errors_repr_and_joinable_properties() -> None:
    out = run_threads(_misc, 2)
    assert out[0]["repr"].startswith("ZeroRedundancyOptimizer(SGD, rank 0/2,")
    assert out[0]["device"] == torch.device("cpu") and out[0]["group"]
    assert torch.equal(out[0]["p0"], make_params()[0].detach())     # frozen: unchanged
    assert torch.equal(out[0]["p1"], out[1]["p1"])


@pytest.mark.timeout(90)
def test_processes_side_by_side_with_torch_zero_on_gloo(tmp_gloo: str) -> None:
    raise_first(run_world(2, _dp_workers.zero_vs_torch_zero, tmp_gloo, timeout=60))


# -- with ringlet's DDP under Join -----------------------------------------------------------------
def _mlp() -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def _batch(rank: int, i: int) -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(100 * i + rank))


class _GradSetter(Joinable):
    """On a joined rank, give the model the gradients the active ranks average this iteration.

    DDP's join hook (like torch's) all-reduces zeros without writing the result into the joined
    rank's ``.grad``; ZeRO's join hook then steps the joined rank's shard with whatever gradients
    it has.  torch's own ZeRO+Join test supplies them with a joinable like this one; the test can
    compute them because every rank's batches are a known function of (rank, iteration).
    """

    def __init__(self, model: torch.nn.Module, iters: list[int], rank: int) -> None:
        super().__init__()
        self.model, self.iters, self.i = model, iters, iters[rank]

    def join_hook(self, **kwargs: Any) -> JoinHook:
        setter = self

        class Hook(JoinHook):
            def main_hook(self) -> None:
                ref = _mlp()
                ref.load_state_dict(setter.model.state_dict())
                for r, k in enumerate(setter.iters):
                    if setter.i < k:
                        ref(_batch(r, setter.i)).sum().backward()
                for p, q in zip(setter.model.parameters(), ref.parameters()):
                    p.grad = q.grad / len(setter.iters)
                setter.i += 1
        return Hook()

    @property
    def join_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def join_process_group(self) -> Any:
        return None


def _ddp_zero_join(rank: int, world_size: int, iters: list[int]) -> list[torch.Tensor]:
    from ringlet.parallel.ddp import DistributedDataParallel

    ddp = DistributedDataParallel(_mlp())
    zero = ZeroRedundancyOptimizer(ddp.parameters(), torch.optim.Adam, lr=0.05)
    with Join([ddp, _GradSetter(ddp.module, iters, rank), zero]):
        for i in range(iters[rank]):
            ddp(_batch(rank, i)).sum().backward()
            zero.step()
            zero.zero_grad()
    return [p.detach().clone() for p in ddp.parameters()]


@pytest.mark.timeout(60)
def test_join_with_ddp_and_zero_on_uneven_inputs() -> None:
    pytest.importorskip("ringlet.parallel.ddp")
    iters = [2, 4]
    out = run_threads(_ddp_zero_join, 2, iters)
    # Reference: each iteration, the gradient is the sum over the ranks still active, divided by
    # the initial world size (DDP's default under Join).
    model = _mlp()
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    for i in range(max(iters)):
        opt.zero_grad()
        for rank, k in enumerate(iters):
            if i < k:
                model(_batch(rank, i)).sum().backward()
        for p in model.parameters():
            p.grad /= len(iters)
        opt.step()
    for rank_params in out:
        for a, b in zip(rank_params, model.parameters()):
            torch.testing.assert_close(a, b.detach(), rtol=1e-5, atol=1e-6)
