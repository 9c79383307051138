"""Rank bodies for the data-parallel tools' tests, run on threads (run_threads) and in processes
(run_world).

Each body is ``fn(rank, world_size, *args)`` and raises on a mismatch, so one body
serves both tiers.  Module-level so that forkserver children can import it.
"""

from __future__ import annotations

from typing import Any

import torch

import ringlet.distributed as dist
from ringlet.distributed.optim import ZeroRedundancyOptimizer
from ringlet.nn import SyncBatchNorm

# -- SyncBatchNorm ---------------------------------------------------------------------------------
SHAPES = {"0d": (3,), "1d": (3, 5), "2d": (3, 4, 5), "3d": (2, 3, 4, 2)}   # (C, *spatial)
REFS = {"0d": torch.nn.BatchNorm1d, "1d": torch.nn.BatchNorm1d, "2d": torch.nn.BatchNorm2d,
        "3d": torch.nn.BatchNorm3d}


def _data(total: int, shape: tuple[int, ...], step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(total, *shape, generator=g) * 3 + 1
    w = torch.randn(total, *shape, generator=g)
    return x, w


def sbn_parity(rank: int, world_size: int, kind: str, sizes: list[int],
               kwargs: dict[str, Any]) -> None:
    """Rank ``rank`` normalizes rows ``sizes[:rank]`` of the batch; everything must match
    BatchNorm's."""
    shape = SHAPES[kind]
    c = shape[0]
    ref = REFS[kind](c, **kwargs)
    sbn = SyncBatchNorm(c, **kwargs)
    if ref.affine:
        with torch.no_grad():
            ref.weight.copy_(torch.linspace(0.5, 1.5, c))
            ref.bias.copy_(torch.linspace(-1, 1, c))
        sbn.load_state_dict(ref.state_dict())
    lo, hi = sum(sizes[:rank]), sum(sizes[:rank + 1])
    pg = dist.group.WORLD
    for step in range(3):
        x_full, w_full = _data(sum(sizes), shape, step)
        x_full.requires_grad_(True)
        ref_out = ref(x_full)
        (ref_out * w_full).sum().backward()
        x = x_full.detach()[lo:hi].clone().requires_grad_(True)
        pg.reset_counts()
        out = sbn(x)
        (out * w_full[lo:hi]).sum().backward()
        # stats forward, gradient sums backward
        if pg.counts() != {"all_gather": 1, "all_reduce": 1}:
            raise AssertionError("expected one all_gather and one all_reduce per step, got "
                                 f"{pg.counts()}")
        torch.testing.assert_close(out, ref_out.detach()[lo:hi])
        torch.testing.assert_close(x.grad, x_full.grad[lo:hi], rtol=1e-4, atol=1e-5)
        if sbn.affine:
            for mine, theirs in ((sbn.weight, ref.weight), (sbn.bias, ref.bias)):
                g = mine.grad.clone()
                dist.all_reduce(g)
                torch.testing.assert_close(g, theirs.grad, rtol=1e-4, atol=1e-4)
                mine.grad = None
                theirs.grad = None
    for name, buf in ref.named_buffers():
        torch.testing.assert_close(dict(sbn.named_buffers())[name], buf)
    # Eval: running statistics, no communication.
    sbn.eval()
    ref.eval()
    pg.reset_counts()
    x_full, _ = _data(sum(sizes), shape, 9)
    out = sbn(x_full[lo:hi])
    if ref.track_running_stats:      # without running stats, eval normalizes each rank's own batch
        torch.testing.assert_close(out, ref(x_full)[lo:hi])
    assert pg.counts() == {}


# -- ZeroRedundancyOptimizer -----------------------------------------------------------------------
PARAM_SHAPES = [(5, 4), (4,), (3, 3), (7,), (2, 2, 2), (1,), (6, 2)]
OPTIMIZERS: dict[str, tuple[type[torch.optim.Optimizer], dict[str, Any]]] = {
    "adam": (torch.optim.Adam, {"lr": 0.01, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
    "adamw": (torch.optim.AdamW, {"lr": 0.01, "amsgrad": True}),
}


def make_params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in PARAM_SHAPES]


def groups_of(params: list[torch.nn.Parameter], split: int | None) -> list[dict[str, Any]]:
    """One group, or two with the second at a different learning rate."""
    if split is None:
        return [{"params": params}]
    return [{"params": params[:split]}, {"params": params[split:], "lr": 0.002}]


def set_grads(params: list[torch.nn.Parameter], step: int) -> None:
    """The global (already averaged) gradient of ``step``: the same on every rank, as after DDP."""
    g = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)


def zero_parity(rank: int, world_size: int, opt: str, bucket_view: bool, split: int | None,
                steps: int = 3) -> list[int]:
    """K steps of ZeRO equal K steps of the unsharded optimizer; returns the global indices with
    state."""
    cls, kwargs = OPTIMIZERS[opt]
    params, ref_params = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(groups_of(params, split), cls,
                                   parameters_as_bucket_view=bucket_view, **kwargs)
    ref = cls(groups_of(ref_params, split), **kwargs)
    for step in range(steps):
        set_grads(params, step)
        set_grads(ref_params, step)
        zero.step()
        ref.step()
        for i, (p, q) in enumerate(zip(params, ref_params)):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0,
                                       msg=f"step {step} param {i}")
    owned = {id(p) for g in zero.optim.param_groups for p in g["params"]}
    with_state = [i for i, p in enumerate(params) if p in zero.optim.state]
    if not all(id(params[i]) in owned for i in with_state):
        raise AssertionError("a rank holds optimizer state for a parameter outside its shard")
    return with_state


def _same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    if sorted(a["state"]) != sorted(b["state"]):
        raise AssertionError(f"state keys differ: {sorted(a['state'])} vs {sorted(b['state'])}")
    for k in a["state"]:
        for name, v in a["state"][k].items():
            torch.testing.assert_close(v, b["state"][k][name], rtol=0, atol=0,
                                       msg=f"state[{k}][{name}]")
    if a["param_groups"] != b["param_groups"]:
        raise AssertionError(f"param_groups differ:\n{a['param_groups']}\n{b['param_groups']}")


def zero_state_dict_round_trip(rank: int, world_size: int, to: int) -> None:
    """consolidate -> state_dict equals the unsharded optimizer's; loading it continues
    identically."""
    params, ref_params = make_params(), make_params()
    zero = ZeroRedundancyOptimizer(groups_of(params, 3), torch.optim.Adam, lr=0.01)
    ref = torch.optim.Adam(groups_of(ref_params, 3), lr=0.01)
    for step in range(2):
        set_grads(params, step)
        set_grads(ref_params, step)
        zero.step()
        ref.step()
    zero.consolidate_state_dict(to=to)
    box: list[Any] = [None]
    if zero.rank == to:
        box[0] = zero.state_dict()
        _same_state(box[0], ref.state_dict())
    else:
        try:
            zero.state_dict()
        except RuntimeError as e:
            if "consolidate_state_dict" not in str(e):
                raise
        else:
            raise AssertionError("state_dict() on a rank that did not consolidate must raise")
    dist.broadcast_object_list(box, group_src=to)
    # A fresh optimizer on the current values continues like the reference.
    fresh = [torch.nn.Parameter(p.detach().clone()) for p in params]
    zero2 = ZeroRedundancyOptimizer(groups_of(fresh, 3), torch.optim.Adam, lr=0.5)
    zero2.load_state_dict(box[0])
    if zero2.param_groups[1]["lr"] != 0.002:
        raise AssertionError(f"hyperparameters not loaded: {zero2.param_groups[1]['lr']}")
    for step in range(2, 4):
        set_grads(fresh, step)
        set_grads(ref_params, step)
        zero2.step()
        ref.step()
    for p, q in zip(fresh, ref_params):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)


def zero_vs_torch_zero(rank: int, world_size: int, gloo_file: str) -> None:
    """Side by side with torch's own ZeroRedundancyOptimizer on gloo: same partition, params and
    state."""
    import torch.distributed as tdist
    from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO

    tdist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank,
                             world_size=world_size)
    try:
        params, theirs_params = make_params(), make_params()
        ours = ZeroRedundancyOptimizer(groups_of(params, 4), torch.optim.Adam, lr=0.01)
        theirs = TorchZeRO(groups_of(theirs_params, 4), torch.optim.Adam, lr=0.01)
        mine = sorted(id(p) for g in ours.optim.param_groups for p in g["params"])
        index = {id(p): i for i, p in enumerate(params)}
        index_theirs = {id(p): i for i, p in enumerate(theirs_params)}
        got = sorted(index[i] for i in mine)
        want = sorted(index_theirs[id(p)] for g in theirs.optim.param_groups for p in g["params"])
        if got != want:
            raise AssertionError(f"rank {rank}: shard {got}, torch's {want}")
        for step in range(3):
            set_grads(params, step)
            set_grads(theirs_params, step)
            ours.step()
            theirs.step()
        for p, q in zip(params, theirs_params):
            torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
        ours.consolidate_state_dict(0)
        theirs.consolidate_state_dict(0)
        if rank == 0:
            _same_state(ours.state_dict(), theirs.state_dict())
    finally:
        tdist.destroy_process_group()
