# ruff: noqa: N999 - torch's module name
"""PowerSGD gradient compression as a DDP communication hook.

Vogels, Karimireddy, Jaggi, "PowerSGD: Practical Low-Rank Gradient Compression for
Distributed Optimization", NeurIPS 2019 (arXiv:1905.13232), Algorithm 1.

Each gradient of a bucket is viewed as a matrix ``M`` (``n = shape[0]`` rows,
``m = numel / n`` columns).  With ``Q`` an ``m x r`` matrix that is the same on
every rank: ``P = M Q``; all-reduce ``P`` (sum); orthonormalize its columns;
``Q = Mᵀ P``; all-reduce ``Q`` and divide by the group size; ``M ≈ P Qᵀ``.  The
result is the projection of the group's average gradient onto the span of
``P``, so it is exact when that average has rank ≤ r.  Gradients whose
compressed form would not be ``min_compression_rate`` times smaller (vectors,
small matrices) are averaged uncompressed in one all-reduce.  With error
feedback each rank adds the previous iteration's local residual
(its input minus the approximation) to its gradient before compressing; with
warm start ``Q`` is reused across iterations (one step of power iteration per
training step).  The first ``start_powerSGD_iter`` iterations use a plain
averaged all-reduce.

[Note: PowerSGD collective order]  The ``Q`` all-reduce depends on the ``P``
result.  Issuing it from a future callback (on the group's communication
thread) would let it interleave with the next bucket's collectives in a
different order on each rank; so the hook waits for ``P`` on the calling
thread and issues ``Q`` before returning.  Every rank therefore issues
[uncompressed, P, Q] per bucket, in bucket order.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import all_reduce
from ringlet.c10d.work import Work
from ringlet.parallel.comm_hooks.default_hooks import GradBucketLike, allreduce_average, hook_group

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = ["BucketPlan", "PowerSGDState", "plan_bucket", "powerSGD_hook"]

logger = logging.getLogger(__name__)


class PowerSGDState:
    """Configuration and per-bucket memory of :func:`powerSGD_hook` (one per DDP model).

    Args:
        process_group: group to average over; None for the default group.
        matrix_approximation_rank: ``r``, the rank of the approximation (1–4 is typical).
        start_powerSGD_iter: iterations of plain all-reduce before compressing (>= 2
            when error feedback or warm start is on, as DDP rebuilds buckets after iteration 1).
        min_compression_rate: compress a gradient only if ``n*m > rate * (n+m)*r``.
        use_error_feedback: carry each rank's local residual into the next iteration.
        warm_start: reuse ``Q`` from the previous iteration instead of a fresh random one.
        orthogonalization_epsilon: 0 orthonormalizes with a QR factorization; > 0 uses
            Gram-Schmidt dividing by ``norm + epsilon`` (torch's option against zero columns).
        random_seed: seed of the generator that draws ``Q``; every rank must use the same.
        compression_stats_logging_frequency: log compression stats every this many iterations.
        batch_tensors_with_same_shape: accepted for torch compatibility; ringlet computes
            matrix by matrix either way (same result).

    Raises:
        ValueError: a rank below 1, or ``start_powerSGD_iter <= 1`` with
            error feedback or warm start.

    Example::

        state = PowerSGDState(process_group=None,
        matrix_approximation_rank=1, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook)
    """

    def __init__(self, process_group: GroupArg, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 1_000, min_compression_rate: float = 2,
                 use_error_feedback: bool = True,
                 warm_start: bool = True, orthogonalization_epsilon: float = 0,
                 random_seed: int = 0,
                 compression_stats_logging_frequency: int = 10_000,
                 batch_tensors_with_same_shape: bool = False) -> None:
        if matrix_approximation_rank < 1:
            raise ValueError("PowerSGDState: expected matrix_approximation_rank >= 1, got "
                             f"{matrix_approximation_rank}")
        if (use_error_feedback or warm_start) and start_powerSGD_iter <= 1:
            raise ValueError("PowerSGDState: expected start_powerSGD_iter > 1 when "
                             "use_error_feedback or warm_start is on (DDP rebuilds its buckets "
                             f"after the first iteration), got {start_powerSGD_iter}")
        if orthogonalization_epsilon < 0:
            raise ValueError("PowerSGDState: expected orthogonalization_epsilon >= 0, got "
                             f"{orthogonalization_epsilon}")
        self.process_group = process_group
        self.matrix_approximation_rank = matrix_approximation_rank
        self.start_powerSGD_iter = start_powerSGD_iter
        self.min_compression_rate = min_compression_rate
        self.use_error_feedback = use_error_feedback
        self.warm_start = warm_start
        self.orthogonalization_epsilon = orthogonalization_epsilon
        self.random_seed = random_seed
        self.batch_tensors_with_same_shape = batch_tensors_with_same_shape
        # Draws the seeds of Q; advanced identically on every rank, so Q agrees across ranks.
        self.rng = random.Random(random_seed)
        # bucket index -> local residual (bucket-shaped)
        self.error_dict: dict[int, torch.Tensor] = {}
        self.p_memory_dict: dict[int, torch.Tensor] = {}   # bucket index -> all P matrices, flat
        self.q_memory_dict: dict[int, torch.Tensor] = {}   # bucket index -> all Q matrices, flat
        self.iter = 0
        self.total_numel_before_compression = 0
        self.total_numel_after_compression = 0
        self.compression_stats_logging_frequency = max(1, compression_stats_logging_frequency)
        self.next_stats_report = 0

    def maybe_increase_iter(self, bucket: GradBucketLike) -> None:
        """Count an iteration when the last bucket of a backward pass was handled."""
        if bucket.is_last():
            self.iter += 1
            if self.iter == self.start_powerSGD_iter:
                logger.info("PowerSGD: compressing gradients from iteration %d on", self.iter)

    def compression_stats(self) -> tuple[float, int, int]:
        """``(compression rate, elements before, elements after)`` summed over
        compressed iterations."""
        before, after = self.total_numel_before_compression, self.total_numel_after_compression
        return (before / after if after > 0 else 0.0), before, after

    def __getstate__(self) -> dict[str, Any]:
        # A process group is a live handle (threads, shared memory): checkpoints keep the rest.
        state = dict(self.__dict__)
        state["process_group"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)

    def __repr__(self) -> str:
        return (f"PowerSGDState(rank={self.matrix_approximation_rank}, iter={self.iter}, "
                f"start={self.start_powerSGD_iter}, error_feedback={self.use_error_feedback}, "
                f"warm_start={self.warm_start})")


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """Which gradients of a bucket are compressed, and where their P and Q live (pure)."""

    shapes: tuple[torch.Size, ...]
    # element offset of each gradient in the buffer
    offsets: tuple[int, ...]
    compressed: tuple[tuple[int, int, int, int], ...]  # (gradient index, rows n, cols m, rank r)
    uncompressed: tuple[int, ...]
    p_numel: int
    q_numel: int
    numel_before: int
    numel_after: int


def plan_bucket(shapes: list[torch.Size], rank: int, min_compression_rate: float) -> BucketPlan:
    """Decide per gradient: compress (as an n x m matrix at rank r) or all-reduce as is."""
    offsets, compressed, uncompressed = [], [], []
    off = p_numel = q_numel = before = after = 0
    shapes = [torch.Size(s) for s in shapes]
    for i, shape in enumerate(shapes):
        numel = shape.numel()
        offsets.append(off)
        off += numel
        n = shape[0] if len(shape) >= 2 else 0
        m = numel // n if n else 0
        r = min(n, m, rank)
        before += numel
        if len(shape) >= 2 and (n + m) * r * min_compression_rate < n * m:
            compressed.append((i, n, m, r))
            p_numel += n * r
            q_numel += m * r
            after += (n + m) * r
        else:
            uncompressed.append(i)
            after += numel
    return BucketPlan(tuple(shapes), tuple(offsets), tuple(compressed), tuple(uncompressed),
                      p_numel, q_numel, before, after)


def _views(buffer: torch.Tensor, plan: BucketPlan) -> list[torch.Tensor]:
    return [buffer[o:o + s.numel()].view(s) for o, s in zip(plan.offsets, plan.shapes)]


def _orthogonalize_(p: torch.Tensor, epsilon: float) -> None:
    """Make the columns of ``p`` orthonormal, in place (computed in at least float32)."""
    work = p.to(torch.float64 if p.dtype == torch.float64 else torch.float32)
    if epsilon == 0:
        # Householder QR stays orthonormal even when P is rank-deficient
        # (e.g. an all-zero gradient).
        work = torch.linalg.qr(work, mode="reduced").Q
    else:
        for i in range(work.shape[1]):
            col = work[:, i]
            col.div_(col.norm() + epsilon)
            if i + 1 < work.shape[1]:
                rest = work[:, i + 1:]
                rest.sub_(col[:, None] * (col @ rest)[None, :])
    p.copy_(work)


def _low_rank_memory(state: PowerSGDState, index: int, plan: BucketPlan, like: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """This bucket's flat P and Q memory; Q is (re)drawn at random when not warm-started."""
    p_mem, q_mem = state.p_memory_dict.get(index), state.q_memory_dict.get(index)
    fresh = (not state.warm_start or p_mem is None or q_mem is None
             or p_mem.numel() != plan.p_numel or q_mem.numel() != plan.q_numel)
    if not fresh and p_mem is not None and q_mem is not None:
        return p_mem, q_mem
    p_mem = torch.empty(plan.p_numel, dtype=like.dtype, device=like.device)
    q_mem = torch.empty(plan.q_numel, dtype=like.dtype, device=like.device)
    # A private generator: the same Q on every rank without touching the global RNG.
    gen = torch.Generator().manual_seed(state.rng.randrange(1_000_000_000))
    q_mem.copy_(torch.randn(plan.q_numel, generator=gen, dtype=torch.float32))
    state.p_memory_dict[index], state.q_memory_dict[index] = p_mem, q_mem
    return p_mem, q_mem


def _factors(plan: BucketPlan, views: list[torch.Tensor], p_mem: torch.Tensor, q_mem: torch.Tensor
             ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(M, P, Q) views for each compressed gradient."""
    out, p_off, q_off = [], 0, 0
    for i, n, m, r in plan.compressed:
        out.append((views[i].view(n, m), p_mem[p_off:p_off + n * r].view(n, r),
                    q_mem[q_off:q_off + m * r].view(m, r)))
        p_off += n * r
        q_off += m * r
    return out


def _record_stats(state: PowerSGDState, plan: BucketPlan) -> None:
    state.total_numel_before_compression += plan.numel_before
    state.total_numel_after_compression += plan.numel_after
    if state.iter >= state.next_stats_report:
        rate, before, after = state.compression_stats()
        logger.info("PowerSGD compression stats: iter %d, %d elements before, %d after, rate %.2f",
                    state.iter, before, after, rate)
        state.next_stats_report = state.iter + state.compression_stats_logging_frequency


def _start(work: Work | None) -> Work:
    if work is None:      # pragma: no cover - hook_group already refused non-members
        raise AssertionError("all_reduce returned no Work for a member group")
    return work


def powerSGD_hook(state: PowerSGDState, bucket: GradBucketLike) -> torch.futures.Future:
    """Average the bucket's gradients with PowerSGD low-rank compression (see the module docstring).

    Args:
        state: the :class:`PowerSGDState` (register the same object for every bucket).
        bucket: the ``GradBucket``; its buffer receives the result.

    Returns:
        A future of ``bucket.buffer()`` holding the (approximate) average.

    Raises:
        ValueError: the gradients' sizes do not add up to the bucket buffer.

    Example::

        state = PowerSGDState(None, matrix_approximation_rank=2, start_powerSGD_iter=10)
        model.register_comm_hook(state, powerSGD_hook)
    """
    pg = hook_group(state.process_group, "powerSGD_hook")
    buffer = bucket.buffer()
    if state.iter < state.start_powerSGD_iter:
        state.maybe_increase_iter(bucket)
        return allreduce_average(pg, buffer)
    index, world = bucket.index(), pg.size()
    plan = plan_bucket([g.shape for g in bucket.gradients()], state.matrix_approximation_rank,
                       state.min_compression_rate)
    if plan.numel_before != buffer.numel():
        raise ValueError("powerSGD_hook: expected the bucket's gradients to fill its buffer of "
                         f"{buffer.numel()} elements, got {plan.numel_before} (bucket {index})")
    local_input = _add_error_feedback(state, index, buffer)
    _record_stats(state, plan)
    views = _views(buffer, plan)
    flat = (torch.cat([views[i].reshape(-1) for i in plan.uncompressed]) if plan.uncompressed
            else None)
    work_u = _start(all_reduce(flat, group=pg, async_op=True)) if flat is not None else None
    factors, work_q = _start_low_rank(state, pg, index, plan, views, buffer)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()                # re-raises a failed all-reduce into the returned future
        if work_u is not None and flat is not None:
            work_u.wait()         # issued before Q on the same group, so already complete
            flat.div_(world)
            _unflatten_into(flat, [views[i] for i in plan.uncompressed])
        for m, p, q in factors:
            q.div_(world)
            torch.matmul(p, q.t(), out=m)
        if local_input is not None:
            state.error_dict[index] = local_input - buffer
        if not state.warm_start:
            state.p_memory_dict.pop(index, None)
            state.q_memory_dict.pop(index, None)
        state.maybe_increase_iter(bucket)
        return buffer
    last = work_q if work_q is not None else work_u
    if last is None:      # an empty bucket: nothing to send
        done: torch.futures.Future = torch.futures.Future()
        done.set_result(None)
        return done.then(finish)
    return last.get_future().then(finish)


def _start_low_rank(state: PowerSGDState, pg: ProcessGroup, index: int, plan: BucketPlan,
                    views: list[torch.Tensor], buffer: torch.Tensor,
                    ) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], Work | None]:
    """P = M Q, all-reduce P (waited), orthonormalize, Q = Mᵀ P, start the all-reduce of Q."""
    if not plan.compressed:
        return [], None
    p_mem, q_mem = _low_rank_memory(state, index, plan, buffer)
    factors = _factors(plan, views, p_mem, q_mem)
    for m, p, q in factors:
        torch.matmul(m, q, out=p)
    # see [Note: PowerSGD collective order]
    _start(all_reduce(p_mem, group=pg, async_op=True)).wait()
    for m, p, q in factors:
        _orthogonalize_(p, state.orthogonalization_epsilon)
        torch.matmul(m.t(), p, out=q)
    return factors, _start(all_reduce(q_mem, group=pg, async_op=True))


def _add_error_feedback(state: PowerSGDState, index: int,
                        buffer: torch.Tensor) -> torch.Tensor | None:
    """Add last iteration's residual to the bucket; return a copy of the corrected input."""
    if not state.use_error_feedback:
        return None
    err = state.error_dict.get(index)
    if err is not None and err.shape == buffer.shape:
        buffer.add_(err)
    return buffer.clone()


def _unflatten_into(flat: torch.Tensor, targets: list[torch.Tensor]) -> None:
    off = 0
    for t in targets:
        t.copy_(flat[off:off + t.numel()].view_as(t))
        off += t.numel()
