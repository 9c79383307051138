"""``ringlet.utils.data``: ``DistributedSampler`` (``ringlet.utils.data.distributed``); the rest is torch.utils.data."""

from ringlet.utils.data.distributed import DistributedSampler

__all__ = ["DistributedSampler"]
