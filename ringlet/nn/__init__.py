"""``ringlet.nn``: torch.nn's distributed parts (``SyncBatchNorm``; ``ringlet.nn.parallel`` for DDP). Re-exports only."""

from ringlet.nn import parallel
from ringlet.parallel.sync_batchnorm import SyncBatchNorm

__all__ = ["SyncBatchNorm", "parallel"]
