"""User-supplied collectives for fully_shard (torch's ``_fsdp_api`` ``Comm``,
``AllGather``, ``ReduceScatter``).

``FSDPModule.set_custom_all_gather(comm)`` / ``set_custom_reduce_scatter(comm)`` hand a group's
collective to ``comm``: fully_shard asks it for the big buffer (``allocate``: the gathered
buffer of an all-gather, the input of a reduce-scatter) and then calls it to run the
collective on ringlet's process group.  A subclass may keep a persistent buffer, use another
transport, or instrument the collective.

Example::

    class CountingAllGather(AllGather):
        calls = 0
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            CountingAllGather.calls += 1
            return dist.all_gather_into_tensor(output_tensor, input_tensor,
            group=group, async_op=async_op)

    block.set_custom_all_gather(CountingAllGather())
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["AllGather", "Comm", "ReduceScatter"]


class Comm(abc.ABC):
    """A collective that also decides where its buffers come from."""

    @abc.abstractmethod
    def allocate(self, size: Sequence[int], *, dtype: torch.dtype,
                 device: torch.device) -> torch.Tensor:
        """A buffer of ``size`` for the collective (``torch.empty(*size,
        ...)`` is a fine default)."""


class AllGather(Comm):
    """``comm(output_tensor, input_tensor, group, async_op=False) -> Work | None``: an all-gather
    into ``output_tensor`` in group-rank order (``all_gather_into_tensor`` semantics)."""

    @abc.abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: ProcessGroup, async_op: bool = False) -> Any: ...


class ReduceScatter(Comm):
    """``comm(output_tensor, input_tensor, group, op, async_op=False) -> Work | None``: a
    reduce-scatter (``reduce_scatter_tensor`` semantics) with reduce op ``op``."""

    @abc.abstractmethod
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: ProcessGroup, op: Any, async_op: bool = False) -> Any: ...
