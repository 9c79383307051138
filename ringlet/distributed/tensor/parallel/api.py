"""``ringlet.distributed.tensor.parallel.api``: ``parallelize_module`` (re-exports only)."""

from ringlet.parallel.tensor_parallel.api import parallelize_module

__all__ = ["parallelize_module"]
