"""The memory floor of a collective on one host: the time its unavoidable bytes take here.

A collective among ``n`` ranks of one host that keeps its data in shared memory must, per rank,
at least (``S`` = the per-rank message in bytes, as in ``collectives.py``):

- ``all_reduce``: fold its ``1/n`` block of every rank's tensor (``n - 1`` adds of ``S/n``) and
  copy the other ranks' reduced blocks into its tensor (a copy of ``(n-1)/n * S``);
- ``all_gather_into_tensor``: copy the other ranks' blocks into its output (``(n-1)/n * S``);
- ``reduce_scatter_tensor``: fold its block of every rank's input (``n - 1`` adds of ``S/n``);
- ``broadcast``: copy the root's tensor (``S``; the root itself copies nothing).

The floor is the time of exactly those torch operations (``a.add_(b)``, ``d.copy_(c)``) on
private float32 tensors of those sizes, run by every rank at the same moment (after a barrier,
as the collective runs): the ranks share the machine's memory bandwidth as they do in the
collective.  Each rank times ``iters`` back-to-back repetitions (enough for ~0.1 s); a repeat's
time is the slowest rank's mean, and the floor is the median over repeats.  No collective that
moves these bytes can beat it; a collective at ``100%`` of its floor moves nothing else.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

TARGET_S = 0.1


def work(op: str, nbytes: int, n: int) -> Callable[[], None]:
    """One repetition of the floor's operations for ``op`` at ``nbytes`` (see the module doc)."""
    elems = max(1, nbytes // 4)
    blk = max(1, elems // n)
    a, b = torch.ones(blk), torch.ones(blk)
    rest = max(1, elems - blk) if op != "broadcast" else elems
    c, d = torch.ones(rest), torch.empty(rest)
    adds = n - 1 if op in ("all_reduce", "reduce_scatter_tensor") else 0
    copies = op in ("all_reduce", "all_gather_into_tensor", "broadcast")

    def run() -> None:
        for _ in range(adds):
            a.add_(b)
        if copies:
            d.copy_(c)
    return run


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
