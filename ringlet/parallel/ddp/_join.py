"""DDP's part in ``Join`` (uneven inputs): what a rank that ran out of data does for the model.

Per iteration, an active rank's DDP issues (inside a Join context):

1. Join's "still active" all-reduce (``Join.notify_join_context``, async);
2. a MAX all-reduce of ``[sync?, rank, rebuild pending?]``: whether any rank synchronises
   gradients this iteration, which active rank is the source of buffers and of the bucket
   order (rank 0 may have joined), and whether the one-time bucket rebuild happens now;
3. the bucket-order broadcast, once (bucket rebuild);
4. the buffer broadcast (``broadcast_buffers``);
5. in backward, one SUM all-reduce per bucket, in bucket order, then the used-map all-gather.

A joined rank's :meth:`DDPJoinHook.main_hook` issues 2-5 with neutral contributions (zeros,
"joined" in the used-map); Join itself answers 1.  Gradients are then divided by the initial
world size, or by the number of active ranks (``divide_by_initial_world_size=False``).  When
every rank has joined, :meth:`DDPJoinHook.post_hook` broadcasts the parameters and buffers of
the last rank to join, so all ranks end with the same model.

The hook uses the model only through its documented interface: ``process_group``, ``device``,
``broadcast_buffers``, :meth:`~DistributedDataParallel.sync_buffers`,
:meth:`~DistributedDataParallel.sync_parameters_and_buffers` and the reducer's public methods
(``rebuild_pending``, ``rebuild_buckets``, ``shadow_backward``, ``annotate``).
``divide_by_initial_world_size`` comes with ``join_hook(**kwargs)``: the model keeps it for its
active iterations (torch's attribute ``_divide_by_initial_world_size``, which the reducer receives
with each backward) and the hook for the iterations it shadows.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import ReduceOp, all_reduce
from ringlet.parallel.ddp._cuda import aux_device
from ringlet.parallel.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from ringlet.parallel.ddp.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook", "Join", "JoinHook", "Joinable", "active_iteration"]


class DDPJoinHook(JoinHook):
    """The join hook of one DDP model (see the module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        self.divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one training iteration of the active ranks with zero gradients."""
        ddp = self.ddp
        sync, src, rebuild = _agree(ddp, active=False, sync=False)
        if rebuild:
            ddp.reducer.rebuild_buckets(src)
        if sync and ddp.broadcast_buffers:
            ddp.sync_buffers(src, "joined rank's buffer broadcast")
        if sync:
            ddp.reducer.shadow_backward(self.divide_by_initial_world_size)

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every rank's final parameters and buffers those of the last joiner."""
        ddp = self.ddp
        pg = ddp.process_group
        src = torch.tensor([pg.rank() if is_last_joiner else -1],
                           device=aux_device(pg, ddp.device))
        with ddp.reducer.annotate("final model sync after Join"):
            all_reduce(src, op=ReduceOp.MAX, group=pg)
        ddp.sync_parameters_and_buffers(int(src.item()), "final model sync after Join")


def active_iteration(ddp: DistributedDataParallel, sync: bool) -> tuple[Any, bool, int, bool]:
    """An active rank's Join collectives before a training forward (1 and 2 above).

    Returns ``(join_work, sync, src, rebuild)``: Join's "still active" work (``None`` outside a
    Join context), whether any rank synchronises, the rank to broadcast from and whether the
    bucket rebuild happens now.
    """
    join_work = Join.notify_join_context(ddp)
    if join_work is None:
        return None, sync, 0, ddp.reducer.rebuild_pending()
    return (join_work, *_agree(ddp, active=True, sync=sync))


def _agree(ddp: DistributedDataParallel, active: bool, sync: bool) -> tuple[bool, int, bool]:
    """Inside Join: (does any rank sync, an active rank to broadcast from, rebuild now?).

    One MAX all-reduce that joined ranks shadow; it picks the highest active rank as the
    source of buffers and of the bucket order, since rank 0 may have run out of data.
    """
    pg = ddp.process_group
    flags = torch.tensor([int(sync), pg.rank() if active else -1,
                          int(ddp.reducer.rebuild_pending())], device=aux_device(pg, ddp.device))
    with ddp.reducer.annotate("Join agreement"):
        all_reduce(flags, op=ReduceOp.MAX, group=pg)
    any_sync, src, rebuild = flags.tolist()
    return bool(any_sync), int(src), bool(rebuild)
