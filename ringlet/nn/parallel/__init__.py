"""``ringlet.nn.parallel``: torch.nn.parallel's distributed part. Re-exports only.

``from ringlet.nn.parallel import DistributedDataParallel`` (implemented in
``ringlet.parallel.ddp``).
"""

from ringlet.nn.parallel.distributed import *
from ringlet.nn.parallel.distributed import __all__  # noqa: F401
