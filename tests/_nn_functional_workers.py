"""Cases for tests/test_nn_functional.py, written once for either implementation.

Each case takes ``F`` (``torch.distributed.nn.functional`` or ringlet's) and ``ops`` (the module
holding its ``ReduceOp``), runs one collective with gradients on this rank's data, and returns
the forward values, the input gradients and what happened to the inputs, as plain tensors.
The threads tier compares them with the values worked out by hand (``expected``); the process
tier runs torch's and ringlet's side by side on gloo and compares them with each other.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

Result = dict[str, Any]
K = 3       # elements per rank


def x_of(rank: int) -> torch.Tensor:
    return torch.arange(1.0, K + 1) + 10 * rank


def w_of(rank: int, k: int = 0) -> torch.Tensor:
    """Weights of a loss term: rank ``rank``'s weights for its ``k``-th output."""
    return torch.arange(1.0, K + 1) * (rank + 1) + 100 * k


def pieces(rank: int, n: int) -> list[torch.Tensor]:
    """Rank ``rank``'s list of per-rank inputs: entry ``i`` is ``x_of(i) + 100 * rank``."""
    return [(x_of(i) + 100 * rank).requires_grad_() for i in range(n)]


def split(r: int, j: int) -> int:
    """Rows rank ``r`` sends to rank ``j`` in the uneven all_to_all_single."""
    return (r + j) % 2 + 1


def _leaf(rank: int) -> torch.Tensor:
    return x_of(rank).requires_grad_()


def broadcast(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    x = _leaf(rank)
    y = F.broadcast(x, src=n - 1)
    (y * w_of(rank)).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "x": x.detach()}


def gather(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    x = _leaf(rank)
    ys = F.gather(x, dst=n - 1)
    sum((y * w_of(rank, k)).sum() for k, y in enumerate(ys)).backward()
    return {"y": torch.stack(ys).detach(), "grad": x.grad}


def scatter(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    ts = pieces(rank, n)
    y = F.scatter(ts, src=n - 1)
    (y * w_of(rank)).sum().backward()
    return {"y": y.detach(), "grad": torch.stack([t.grad for t in ts])}


def reduce(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    x = _leaf(rank)
    y = F.reduce(x, dst=n - 1, op=getattr(ops.ReduceOp, op))
    (y * w_of(rank)).sum().backward()
    # off the destination the result is unspecified (torch on gloo: the sum; ringlet: a copy)
    return {"y": y.detach() if rank == n - 1 else None, "grad": x.grad, "x": x.detach()}


def reduce_scatter(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    ins = pieces(rank, n)
    out = torch.zeros(K)
    y = F.reduce_scatter(out, ins, op=getattr(ops.ReduceOp, op))
    (y * w_of(rank)).sum().backward()
    return {"y": y.detach(), "grad": torch.stack([t.grad for t in ins]),
            "view_of_output": y.data_ptr() == out.data_ptr() and torch.equal(y.detach(), out)}


def all_gather(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    x = _leaf(rank)
    ys = F.all_gather(x)
    sum((y * w_of(rank, k)).sum() for k, y in enumerate(ys)).backward()
    return {"y": torch.stack(ys).detach(), "grad": x.grad, "tuple": type(ys) is tuple}


def all_to_all(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    ins = pieces(rank, n)
    outs = [torch.zeros(K) for _ in range(n)]
    ys = F.all_to_all(outs, ins)
    sum((y * w_of(rank, k)).sum() for k, y in enumerate(ys)).backward()
    return {"y": torch.stack(ys).detach(), "grad": torch.stack([t.grad for t in ins]),
            "same_objects": all(a is b for a, b in zip(ys, outs))}


def all_to_all_single(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    in_splits = [split(rank, j) for j in range(n)]
    out_splits = [split(i, rank) for i in range(n)]
    x = (torch.arange(2.0 * sum(in_splits)).view(-1, 2) + 100 * rank).requires_grad_()
    out = torch.zeros(sum(out_splits), 2)
    y = F.all_to_all_single(out, x, out_splits, in_splits)
    (y * (torch.arange(1.0, y.numel() + 1).view_as(y) * (rank + 1))).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "view_of_output": y.data_ptr() == out.data_ptr()}


def all_reduce(F: Any, ops: Any, rank: int, n: int, op: str = "SUM") -> Result:
    x = _leaf(rank)
    y = F.all_reduce(x, op=getattr(ops.ReduceOp, op))
    (y * w_of(rank)).sum().backward()
    return {"y": y.detach(), "grad": x.grad, "x": x.detach()}


CASES: dict[str, Callable[..., Result]] = {f.__name__: f for f in (
    broadcast, gather, scatter, reduce, reduce_scatter, all_gather, all_to_all, all_to_all_single,
    all_reduce)}
# What torch and ringlet agree on (for reduce/reduce_scatter, AVG's gradient differs: torch's
# backward ignores the op; docs/differences.md).
SIDE_BY_SIDE = [(name, "SUM") for name in CASES] + [("all_reduce", "AVG")]


def compare(ours: Result, theirs: Result, where: str) -> None:
    if ours.keys() != theirs.keys():
        raise AssertionError(f"{where}: keys {sorted(ours)} vs torch's {sorted(theirs)}")
    for key, a in ours.items():
        b = theirs[key]
        same = (torch.equal(a, b) if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                else a == b)
        if not same:
            raise AssertionError(f"{where}: {key}: ringlet {a!r}, torch {b!r}")


def side_by_side(rank: int, world_size: int, gloo_file: str) -> int:
    """Every case with ringlet's functions (on ringlet's default group) and torch's (on gloo)."""
    import torch.distributed as tdist
    import torch.distributed.nn.functional as torch_f

    import ringlet.distributed as dist
    import ringlet.distributed.nn.functional as ours_f

    tdist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank,
                             world_size=world_size)
    try:
        for name, op in SIDE_BY_SIDE:
            case = CASES[name]
            compare(case(ours_f, dist, rank, world_size, op),
                    case(torch_f, tdist, rank, world_size, op), f"rank {rank} {name}({op})")
    finally:
        tdist.destroy_process_group()
    return len(SIDE_BY_SIDE)
