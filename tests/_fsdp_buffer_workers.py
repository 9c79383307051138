"""Rank bodies of the tests of fully_shard's communication buffers in shared memory (module level:
process-tier tests pickle them by name)."""

from __future__ import annotations

import collections
import os
import signal
import threading
from typing import Any

import _fsdp_workers as fw
import torch
from _workers import outcome

import ringlet.distributed as dist
from ringlet.parallel.fsdp._collectives import BufferPool
from ringlet.transport import arena_inplace

# Input 8 and output 4 as fw.batch makes them; the two large layers' flat buffers (147 KB and
# 524 KB gathered) lie above the in-place threshold, the last one (0.5 KB) below it.
DIMS = (8, 4096, 32, 4)

_SPY_LOCK = threading.Lock()
# rank -> op -> [calls that ran in place, calls that fell back to the ordinary path]
_CALLS: dict[int, dict[str, list[int]]] = collections.defaultdict(
    lambda: collections.defaultdict(lambda: [0, 0]))


def _spy() -> None:
    """Count, per rank, the in-place collectives that ran in place and those that fell back."""
    cls = arena_inplace.InplaceCollectives
    with _SPY_LOCK:
        if getattr(cls._in_place, "spied", False):
            return
        real = cls._in_place

        def counted(self: Any, op: str, *args: Any, **kwargs: Any) -> bool:
            done = real(self, op, *args, **kwargs)
            _CALLS[self.rank][op][0 if done else 1] += 1
            return done
        counted.spied = True   # type: ignore[attr-defined]
        cls._in_place = counted   # type: ignore[method-assign]


def _calls(rank: int) -> dict[str, list[int]]:
    return {op: list(v) for op, v in _CALLS[rank].items()}


class PlainPool(BufferPool):
    """A pool that hands out ordinary tensors (a rank whose buffers are not in shared memory)."""

    def take(self, numel: int, dtype: torch.dtype, device: torch.device,
             group: Any = None) -> torch.Tensor:
        return super().take(numel, dtype, device)


def _pools(model: torch.nn.Module) -> list[BufferPool]:
    states = model._get_fsdp_state().ctx.states   # type: ignore[operator]
    return list({id(s.group.pool): s.group.pool for s in states if s.group is not None}.values())


def train(rank: int, n: int, plain_ranks: tuple[int, ...] = (), steps: int = 4) -> dict[str, Any]:
    """Train the MLP of ``DIMS`` with fully_shard beside the single-process reference.

    Ranks in ``plain_ranks`` pool ordinary tensors (a mixed call on every collective).  Returns
    the parameter difference, the in-place counts, whether every buffer in the pool lives in
    shared memory, and whether the pooled buffers were the same after every step from the
    second on (reused, not reallocated)."""
    _spy()
    torch.set_num_threads(1)
    seen: list[set[int]] = []
    holder: list[torch.nn.Module] = []

    def shard(model: torch.nn.Module) -> torch.nn.Module:
        fw.shard_model(model)
        holder.append(model)
        if rank in plain_ranks:
            model._get_fsdp_state().shared_pool = PlainPool()   # type: ignore[operator]
        real = model.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            seen.append({id(b) for p in _pools(model) for ts in p._free.values() for b in ts})
            return real(*args, **kwargs)
        model.forward = forward   # type: ignore[method-assign]
        return model
    _, _, diff = fw.train_pair(rank, n, "mlp", steps=steps, rows=2, shard=shard,
                               model_kw={"dims": DIMS})
    free = [b for p in _pools(holder[0]) for ts in p._free.values() for b in ts]
    return {"diff": diff, "calls": _calls(rank),
            "shared": bool(free) and all(dist.is_comm_buffer(b) for b in free),
            "reused": bool(seen[1]) and seen[1:] == [seen[1]] * len(seen[1:])}


def _kill_in_reduce_scatter(rank: int, how: str) -> None:
    """Make ``rank`` fail inside its next in-place reduce-scatter, after the first round."""
    cls = arena_inplace.InplaceCollectives
    real = cls.reduce_scatter

    def failing(self: Any, *args: Any, **kwargs: Any) -> bool:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise KeyboardInterrupt("interrupted inside an in-place reduce_scatter")
    cls.reduce_scatter = failing if dist.get_rank() == rank else real  # type: ignore[method-assign]


def peer_dies_in_backward(rank: int, n: int, how: str) -> dict[str, Any]:
    """One good step, then rank 1 dies (or is interrupted) inside its first in-place
    reduce-scatter of the next backward: the others raise within seconds, never returning
    gradients built from stale bytes."""
    torch.set_num_threads(1)
    model = fw.shard_model(fw.make_model("mlp", dims=DIMS))
    opt = fw.make_opt(model.parameters())
    x, y = fw.batch("mlp", 0, 2 * n)
    mine = slice(2 * rank, 2 * rank + 2)
    fw.loss_fn("mlp", model, x[mine], y[mine]).backward()
    opt.step()
    opt.zero_grad()
    _kill_in_reduce_scatter(1, how)

    def step() -> None:
        fw.loss_fn("mlp", model, x[mine], y[mine]).backward()
        opt.step()
    return outcome(step)
