"""``ringlet.nn.parallel.distributed``: mirror of ``torch.nn.parallel.distributed``. Re-exports
only."""

from ringlet.parallel.ddp import DistributedDataParallel

__all__ = ["DistributedDataParallel"]
