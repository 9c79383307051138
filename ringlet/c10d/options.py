"""torch's per-call option objects for ``ProcessGroup`` methods (``BroadcastOptions`` and friends).

Comm hooks and older code build them and hand them to ``pg.broadcast([t], opts)``; their fields
carry torch's names.  Roots (``rootRank``) are ranks within the group, as in torch.  ``timeout``
is accepted for compatibility; the group's timeout bounds every operation.
"""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from ringlet.c10d.reduce_op import ReduceOp

__all__ = [
    "AllToAllOptions", "AllgatherOptions", "AllreduceCoalescedOptions", "AllreduceOptions",
    "BarrierOptions", "BroadcastOptions", "GatherOptions", "ReduceOptions", "ReduceScatterOptions",
    "ScatterOptions",
]


@dataclasses.dataclass
class AllreduceOptions:
    """Options of ``pg.allreduce([t], opts)``: the reduce op (``reduceOp``)."""

    reduceOp: Any = ReduceOp.SUM
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllreduceCoalescedOptions(AllreduceOptions):
    """Options of ``pg.allreduce_coalesced(tensors, opts)``: as :class:`AllreduceOptions`."""


@dataclasses.dataclass
class BroadcastOptions:
    """Options of ``pg.broadcast([t], opts)``: the root's group rank (``rootRank``)."""

    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ReduceOptions:
    """Options of ``pg.reduce([t], opts)``: the reduce op and the root's group rank."""

    reduceOp: Any = ReduceOp.SUM
    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllgatherOptions:
    """Options of ``pg.allgather(outputs, inputs, opts)`` and ``_allgather_base``."""

    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class GatherOptions:
    """Options of ``pg.gather(outputs, inputs, opts)``: the root's group rank."""

    rootRank: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ScatterOptions:
    """Options of ``pg.scatter(outputs, inputs, opts)``: the root's group rank."""

    rootRank: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ReduceScatterOptions:
    """Options of ``pg.reduce_scatter(outputs, inputs, opts)``: the reduce op."""

    reduceOp: Any = ReduceOp.SUM
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllToAllOptions:
    """Options of ``pg.alltoall`` and ``pg.alltoall_base``."""

    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class BarrierOptions:
    """Options of ``pg.barrier(opts)``: ``device_ids`` is checked and otherwise unused."""

    device_ids: list[int] = dataclasses.field(default_factory=list)
    timeout: timedelta | None = None
    asyncOp: bool = True
