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
    reduceOp: Any = ReduceOp.SUM
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllreduceCoalescedOptions(AllreduceOptions):
    pass


@dataclasses.dataclass
class BroadcastOptions:
    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ReduceOptions:
    reduceOp: Any = ReduceOp.SUM
    rootRank: int = 0
    rootTensor: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllgatherOptions:
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class GatherOptions:
    rootRank: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ScatterOptions:
    rootRank: int = 0
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class ReduceScatterOptions:
    reduceOp: Any = ReduceOp.SUM
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class AllToAllOptions:
    timeout: timedelta | None = None
    asyncOp: bool = True


@dataclasses.dataclass
class BarrierOptions:
    device_ids: list[int] = dataclasses.field(default_factory=list)
    timeout: timedelta | None = None
    asyncOp: bool = True
