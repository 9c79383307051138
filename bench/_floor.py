"""The memory floor of a collective on one host: the time its unavoidable bytes take here.

A collective among ``n`` ranks of one host that keeps its data in shared memory must, per rank,
at least (``S`` = the per-rank message in bytes, as in ``collectives.py``):

- ``all_reduce``: fold its ``1/n`` block of every rank's tensor (``n - 1`` adds of ``S/n``) and
  copy the other ranks' reduced blocks into its tensor (a copy of ``(n-1)/n * S``);
- ``all_gather_into_tensor``: copy the other ranks' blocks into its output (``(n-1)/n * S``);
- ``reduce_scatter_tensor``: fold its block of every rank's input (``n - 1`` adds of ``S/n``);
- ``broadcast``: copy the root's tensor (``S``; the root itself copies nothing).

The floor is the time of exactly those torch operations on private float32 tensors with the
collective's own footprint -- one tensor ``X`` of ``S`` bytes cut into ``n`` blocks (plus the
``S/n`` input or output the op has besides): ``X[0].add_(X[k])`` for each other block ``k``, then
``X[k].copy_(X[0])`` -- run by every rank at the same moment (after a barrier, as the collective
runs), so that the ranks share the machine's memory bandwidth and caches as they do in the
collective.  Each rank times ``iters`` back-to-back repetitions (enough for ~0.1 s); a repeat's
time is the slowest rank's mean, and the floor is the median over repeats.  A collective that
moves these bytes between ranks also pays for moving them between cores, so at sizes that fit
in a core's cache the floor is below what any collective reaches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

TARGET_S = 0.1


def work(op: str, nbytes: int, n: int) -> Callable[[], None]:
    """One repetition of the floor's operations for ``op`` at ``nbytes`` (see the module doc)."""
    elems = max(n, nbytes // 4)
    blk = elems // n
    x = torch.ones(blk * n)
    parts = [x[k * blk:(k + 1) * blk] for k in range(n)]
    side = torch.ones(blk)           # reduce_scatter's output, all_gather's input
    whole = torch.ones(elems)        # broadcast's source

    def all_reduce() -> None:
        for k in range(1, n):
            parts[0].add_(parts[k])
        for k in range(1, n):
            parts[k].copy_(parts[0])

    def reduce_scatter() -> None:
        torch.add(parts[0], parts[1], out=side)
        for k in range(2, n):
            side.add_(parts[k])

    def all_gather() -> None:
        for k in range(1, n):
            parts[k].copy_(side)

    def broadcast() -> None:
        x.copy_(whole[:x.numel()])
    return {"all_reduce": all_reduce, "reduce_scatter_tensor": reduce_scatter,
            "all_gather_into_tensor": all_gather, "broadcast": broadcast}[op]


def floor_seconds(op: str, nbytes: int, n: int, repeats: int, barrier: Callable[[], Any],
                  slowest: Callable[[list[float]], list[float]]) -> float:
    """This rank's share of the floor measurement (every rank calls it at once).

    ``barrier()`` lines the ranks up; ``slowest(samples)`` returns the element-wise maximum over
    ranks.  Returns the floor in seconds (the same on every rank)."""
    run = work(op, nbytes, n)
    run()
    t0 = time.perf_counter()
    run()
    est = slowest([time.perf_counter() - t0])[0]
    iters = max(3, min(10_000, int(TARGET_S / max(est, 1e-7))))
    samples = []
    for _ in range(repeats):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            run()
        samples.append((time.perf_counter() - t0) / iters)
    worst = slowest(samples)
    return sorted(worst)[len(worst) // 2]
