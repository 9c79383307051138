"""``ringlet.utils.data``: ``DistributedSampler`` (``ringlet.utils.data.distributed``); the rest is
torch.utils.data."""

from ringlet.utils.data.distributed import *
from ringlet.utils.data.distributed import __all__  # noqa: F401
