# ruff: noqa: N999 - torch's name
"""Batched PowerSGD: the whole bucket compressed as one square matrix (torch's
``batched_powerSGD_hook``).

Same algorithm as ``powerSGD_hook`` (Vogels et al. 2019, Algorithm 1; see that module), but the
bucket's flat buffer of ``n`` elements is padded with zeros to ``s x s`` (``s = ceil(sqrt(n))``)
and compressed as a single matrix: two all-reduces of ``s x r`` per bucket whatever the number
of gradients in it.  Faster than per-gradient compression, less accurate, since the matrix no
longer follows the layers' shapes.  Error feedback (on the bucket) and warm start (of ``Q``) work
as in ``powerSGD_hook``; every rank issues [P, Q] per bucket, in bucket order.

Example::

    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=10)
    model.register_comm_hook(state, batched_powerSGD_hook)
"""

from __future__ import annotations

import math

import torch

from ringlet.c10d import all_reduce
from ringlet.parallel.comm_hooks.default_hooks import GradBucketLike, allreduce_average, hook_group
from ringlet.parallel.comm_hooks.powerSGD_hook import (
    PowerSGDState,
    _add_error_feedback,
    _orthogonalize_,
    _start,
)

__all__ = ["batched_powerSGD_hook"]


def _square_q(state: PowerSGDState, index: int, side: int, rank: int,
              like: torch.Tensor) -> torch.Tensor:
    """This bucket's ``Q`` (side x rank): warm-started, or drawn from the state's generator."""
    q = state.q_memory_dict.get(index)
    if state.warm_start and q is not None and q.shape == (side, rank) and q.dtype == like.dtype:
        return q
    # same draw on every rank
    gen = torch.Generator().manual_seed(state.rng.randrange(1_000_000_000))
    q = torch.randn(side, rank, generator=gen, dtype=torch.float32).to(like.device, like.dtype)
    if state.warm_start:
        state.q_memory_dict[index] = q
    return q


def batched_powerSGD_hook(state: PowerSGDState, bucket: GradBucketLike) -> torch.futures.Future:
    """Average the bucket with PowerSGD applied to the whole bucket as one square matrix.

    Args:
        state: the :class:`PowerSGDState` (``matrix_approximation_rank`` is the rank ``r``).
        bucket: the ``GradBucket``; its buffer receives the result.

    Returns:
        A future of ``bucket.buffer()`` holding the (approximate) average.
    """
    pg = hook_group(state.process_group, "batched_powerSGD_hook")
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_average(pg, buffer)
    index, world, n = bucket.index(), pg.size(), buffer.numel()
    side = max(1, math.ceil(math.sqrt(n)))
    rank = min(side, state.matrix_approximation_rank)
    local_input = _add_error_feedback(state, index, buffer)
    state.total_numel_before_compression += n
    state.total_numel_after_compression += 2 * side * rank
    square = buffer.new_zeros(side * side)
    square[:n] = buffer
    m = square.view(side, side)
    q = _square_q(state, index, side, rank, buffer)
    p = m @ q
    _start(all_reduce(p, group=pg, async_op=True)).wait()    # Q depends on the summed P
    _orthogonalize_(p, state.orthogonalization_epsilon)
    torch.matmul(m.t(), p, out=q)
    work_q = _start(all_reduce(q, group=pg, async_op=True))

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        q.div_(world)
        buffer.copy_((p @ q.t()).view(-1)[:n])
        if local_input is not None:
            state.error_dict[index] = local_input - buffer
        state.maybe_increase_iter(bucket)
        return buffer
    return work_q.get_future().then(finish)
