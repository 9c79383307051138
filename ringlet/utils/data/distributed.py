"""``ringlet.utils.data.distributed``: ``DistributedSampler`` (implemented in
ringlet.parallel.sampler)."""

from ringlet.parallel.sampler import DistributedSampler

__all__ = ["DistributedSampler"]
