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
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringlet.parallel.join import Join, Joinable, JoinHook

if TYPE_CHECKING:
    from ringlet.parallel.ddp.ddp import DistributedDataParallel

__all__ = ["DDPJoinHook", "Join", "JoinHook", "Joinable"]


class DDPJoinHook(JoinHook):
    """The join hook of one DDP model (see the module docstring)."""

    def __init__(self, ddp: DistributedDataParallel, divide_by_initial_world_size: bool) -> None:
        self.ddp = ddp
        ddp._divide_by_initial_world_size = divide_by_initial_world_size

    def main_hook(self) -> None:
        """Shadow one training iteration of the active ranks with zero gradients."""
        self.ddp._shadow_iteration()

    def post_hook(self, is_last_joiner: bool) -> None:
        """Make every rank's final parameters and buffers those of the last joiner."""
        self.ddp._sync_final_model(is_last_joiner)
