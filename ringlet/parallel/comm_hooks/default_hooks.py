"""The basic DDP communication hooks: averaged all-reduce, and all-reduce in fp16 or bf16.

Register one on a DDP model with ``model.register_comm_hook(process_group, hook)``
(``process_group=None`` means the default group).  Each returns a
``torch.futures.Future`` whose value is the bucket's averaged gradients, in the
bucket's own dtype, written into ``bucket.buffer()``.

Example::

    from ringlet.distributed.algorithms.ddp_comm_hooks import default_hooks
    model.register_comm_hook(None, default_hooks.fp16_compress_hook)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from ringlet.c10d import all_reduce
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.world import resolve_group

__all__ = [
    "GradBucketLike",
    "allreduce_hook",
    "bf16_compress_hook",
    "bf16_compress_wrapper",
    "fp16_compress_hook",
    "fp16_compress_wrapper",
]


class GradBucketLike(Protocol):
    """What a hook may call on its bucket (torch's ``GradBucket`` API)."""

    def index(self) -> int: ...
    def buffer(self) -> torch.Tensor: ...
    def gradients(self) -> list[torch.Tensor]: ...
    def parameters(self) -> list[torch.Tensor]: ...
    def is_last(self) -> bool: ...
    def set_buffer(self, tensor: torch.Tensor) -> None: ...


Hook = Callable[[Any, GradBucketLike], torch.futures.Future]


def hook_group(process_group: GroupArg, hook: str) -> ProcessGroup:
    """The ProcessGroup a hook talks on (None: the default group), resolved on the calling thread.

    Resolved here, once, because later stages may run in future callbacks on the
    group's communication thread, where the per-thread default world is not visible.
    """
    pg = resolve_group(process_group)
    if pg is None:
        raise ValueError(f"{hook}: expected a process group this rank is a member "
                         "of, got a non-member group")
    return pg


def allreduce_average(pg: ProcessGroup, tensor: torch.Tensor) -> torch.futures.Future:
    """Divide ``tensor`` by the group size, then start its sum all-reduce; future of ``tensor``.

    Dividing before summing (not after) keeps low-precision sums from overflowing.
    """
    tensor.div_(pg.size())
    work = all_reduce(tensor, group=pg, async_op=True)
    if work is None:      # pragma: no cover - hook_group already refused non-members
        raise AssertionError("all_reduce returned no Work for a member group")
    return work.get_future().then(lambda fut: fut.value()[0])


def allreduce_hook(process_group: GroupArg, bucket: GradBucketLike) -> torch.futures.Future:
    """Average the bucket's gradients across ``process_group`` (DDP's default behaviour).

    Args:
        process_group: the group to average over; None for the default group.
        bucket: the ``GradBucket``; its buffer is averaged in place.

    Returns:
        A future of ``bucket.buffer()`` holding the average.

    Example::

        model.register_comm_hook(None, default_hooks.allreduce_hook)
    """
    return allreduce_average(hook_group(process_group, "allreduce_hook"), bucket.buffer())


def _compress_hook(dtype: torch.dtype, process_group: GroupArg, bucket: GradBucketLike,
                   name: str) -> torch.futures.Future:
    pg = hook_group(process_group, name)
    buffer = bucket.buffer()
    compressed = buffer.to(dtype).div_(pg.size())
    work = all_reduce(compressed, group=pg, async_op=True)
    if work is None:      # pragma: no cover - hook_group already refused non-members
        raise AssertionError("all_reduce returned no Work for a member group")

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])     # in place: no second full-precision buffer
        return buffer
    return work.get_future().then(decompress)


def fp16_compress_hook(process_group: GroupArg, bucket: GradBucketLike) -> torch.futures.Future:
    """Average the bucket in float16: half the bytes on the wire, ~3 significant digits.

    The buffer is cast to float16 and divided by the group size, summed across the
    group, and cast back into the buffer's dtype.  Returns a future of ``bucket.buffer()``.

    Example::

        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    """
    return _compress_hook(torch.float16, process_group, bucket, "fp16_compress_hook")


def bf16_compress_hook(process_group: GroupArg, bucket: GradBucketLike) -> torch.futures.Future:
    """Like :func:`fp16_compress_hook` in bfloat16 (float32's range, ~2 significant digits)."""
    return _compress_hook(torch.bfloat16, process_group, bucket, "bf16_compress_hook")


def _compress_wrapper(dtype: torch.dtype, hook: Hook) -> Hook:
    def wrapped(hook_state: Any, bucket: GradBucketLike) -> torch.futures.Future:
        original = bucket.buffer()
        bucket.set_buffer(original.to(dtype))
        fut = hook(hook_state, bucket)

        def decompress(f: torch.futures.Future) -> torch.Tensor:
            original.copy_(f.value())
            bucket.set_buffer(original)
            return original
        return fut.then(decompress)
    wrapped.__name__ = f"{dtype_name(dtype)}_compress_wrapper({getattr(hook, '__name__', 'hook')})"
    return wrapped


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


def fp16_compress_wrapper(hook: Hook) -> Hook:
    """Run ``hook`` on a float16 copy of the bucket, and cast its result back.

    ``fp16_compress_wrapper(allreduce_hook)`` is equivalent to ``fp16_compress_hook``;
    the usual use is ``fp16_compress_wrapper(powerSGD_hook)`` with a ``PowerSGDState``.

    Example::

        state = powerSGD_hook.PowerSGDState(None, start_powerSGD_iter=10)
        model.register_comm_hook(state,
        default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook))
    """
    return _compress_wrapper(torch.float16, hook)


def bf16_compress_wrapper(hook: Hook) -> Hook:
    """Like :func:`fp16_compress_wrapper` in bfloat16."""
    return _compress_wrapper(torch.bfloat16, hook)
