"""``GradBucket``: what a DDP communication hook receives (torch's ``dist.GradBucket`` API).

A hook is called once per bucket and iteration, as soon as the bucket's gradients are all
ready, with a :class:`GradBucket` whose :meth:`buffer` holds the local (not yet averaged)
gradients flattened into one tensor.  It returns a ``torch.futures.Future`` whose value is the
reduced buffer; DDP waits for it at the end of backward and writes it into the gradients.

Example (an all-reduce hook that averages)::

    def allreduce_avg(pg, bucket: GradBucket) -> torch.futures.Future:
        buf = bucket.buffer().div_(pg.size())
        fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
        return fut.then(lambda f: f.value()[0])

    ddp.register_comm_hook(ddp.process_group, allreduce_avg)
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["GradBucket"]


class GradBucket:
    """One bucket of gradients handed to a communication hook.

    Args:
        index: the bucket's position in the iteration's all-reduce order (0 first).
        buffer: the flat buffer holding the bucket's gradients (one dtype).
        parameters: the bucket's parameters, in buffer order.
        offsets: element offset of each parameter in ``buffer``.
        is_last: whether this bucket is the last one all-reduced in an iteration (it holds the
            first layers of the forward pass).
    """

    def __init__(self, index: int, buffer: torch.Tensor, parameters: Sequence[torch.Tensor],
                 offsets: Sequence[int], is_last: bool) -> None:
        if len(parameters) != len(offsets):
            raise ValueError(f"GradBucket: expected one offset per parameter ({len(parameters)}), "
                             f"got {len(offsets)}")
        self._index = index
        self._buffer = buffer
        self._parameters = list(parameters)
        self._offsets = list(offsets)
        self._is_last = is_last

    def index(self) -> int:
        """The bucket's index: 0 is all-reduced first (its parameters are the last layers)."""
        return self._index

    def buffer(self) -> torch.Tensor:
        """The flat 1-d tensor holding this bucket's gradients (writable in place)."""
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient as a view of :meth:`buffer`, shaped like the parameter."""
        return [self._buffer[off:off + p.numel()].view(p.shape)
                for p, off in zip(self._parameters, self._offsets)]

    def parameters(self) -> list[torch.Tensor]:
        """The parameters whose gradients this bucket holds, in buffer order."""
        return list(self._parameters)

    def offsets(self) -> list[int]:
        """Element offset of each parameter's gradient in :meth:`buffer` (ringlet addition)."""
        return list(self._offsets)

    def is_last(self) -> bool:
        """Whether this is the last bucket all-reduced in the iteration."""
        return self._is_last

    def set_buffer(self, buffer: torch.Tensor) -> None:
        """Replace the buffer (e.g. with a compressed or decompressed copy) that hooks see.

        Raises:
            ValueError: ``buffer`` has a different number of elements than the bucket.
        """
        if buffer.numel() != self._buffer.numel():
            raise ValueError(f"GradBucket.set_buffer: expected {self._buffer.numel()} elements, "
                             f"got {buffer.numel()}")
        self._buffer = buffer

    def __repr__(self) -> str:
        dt = str(self._buffer.dtype).removeprefix("torch.")
        return (f"GradBucket(index {self._index}, {len(self._parameters)} params, "
                f"{dt}[{self._buffer.numel()}]{', last' if self._is_last else ''})")
