"""``ringlet.distributed.optim``: ``ZeroRedundancyOptimizer`` (implemented in
ringlet.parallel.zero)."""

from ringlet.parallel.zero import ZeroRedundancyOptimizer

__all__ = ["ZeroRedundancyOptimizer"]
