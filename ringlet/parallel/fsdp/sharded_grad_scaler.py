"""``ShardedGradScaler``: torch's loss scaler for float16 training whose ranks agree on overflow.

A ``GradScaler`` skips the optimizer step (and lowers its scale) when a gradient holds an inf or
a NaN.  With sharded training each rank sees only its own pieces of the gradients, so one rank
may find an overflow that the others do not; if it skips the step alone the ranks' parameters
(and their scales) drift apart.  This scaler makes the ranks of ``process_group`` agree: after
each rank has unscaled its gradients, one ``all_reduce(MAX)`` of the overflow flag, and every
rank skips or steps together.

(With ``fully_shard`` torch's plain ``torch.amp.GradScaler`` already agrees: its unscale on
DTensor gradients reduces the flag over the mesh.  This class is for scripts written for torch's
``torch.distributed.fsdp.sharded_grad_scaler.ShardedGradScaler``, and for gradients that are plain
tensors holding different values on each rank.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringlet.c10d.collectives import all_reduce
from ringlet.c10d.reduce_op import ReduceOp

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` whose ranks agree on whether a step overflowed.

    Args:
        device: the device of the scale (``"cuda"``, or ``"cpu"`` for CPU autocast).
        init_scale, backoff_factor, growth_factor, growth_interval, enabled: as
            ``torch.amp.GradScaler``.
        process_group: the ranks that must agree (``None``: the default group).  Every rank of
            it must call ``unscale_`` (or ``step``, which unscales) for the same optimizer steps.

    Unlike ``GradScaler``, ``unscale_`` accepts float16 gradients (sharded training may keep
    them in the parameters' dtype).

    Example::

        scaler = ShardedGradScaler("cuda")
        with torch.autocast("cuda", dtype=torch.float16):
            loss = model(batch)
        scaler.scale(loss).backward()
        scaler.step(opt)        # skipped on every rank if any rank saw an inf or NaN
        scaler.update()
    """

    def __init__(self, device: str = "cuda", init_scale: float = 2.0**16,
                 backoff_factor: float = 0.5, growth_factor: float = 2.0,
                 growth_interval: int = 2000, enabled: bool = True,
                 process_group: GroupArg = None) -> None:
        super().__init__(device, init_scale=init_scale, growth_factor=growth_factor,
                         backoff_factor=backoff_factor, growth_interval=growth_interval,
                         enabled=enabled)
        self.process_group = process_group

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor,
                        found_inf: torch.Tensor, allow_fp16: bool) -> dict[torch.device,
                                                                           torch.Tensor]:
        """Unscale this rank's gradients, then agree on the overflow flag across the group.

        Exactly one collective per call on every rank, whatever devices its gradients are on
        (a rank's per-device flags are folded into one on the scale's device first), so ranks
        whose gradients live on different devices (offloaded or not) still match.
        """
        per_device = super()._unscale_grads_(optimizer, inv_scale, found_inf, True)
        flag = found_inf.clone()
        for f in per_device.values():
            torch.maximum(flag, f.to(flag.device), out=flag)
        all_reduce(flag, op=ReduceOp.MAX, group=self.process_group)
        for f in per_device.values():
            f.copy_(flag)
        return per_device
