"""``ringlet.nn``: torch.nn's distributed parts (``SyncBatchNorm``; ``ringlet.nn.parallel`` for
DDP).

Re-exports only.
"""

from ringlet.nn import parallel
from ringlet.parallel.sync_batchnorm import *
from ringlet.parallel.sync_batchnorm import __all__ as _sync_batchnorm_all

__all__ = [*_sync_batchnorm_all, "parallel"]
