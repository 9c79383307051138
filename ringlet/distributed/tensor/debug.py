"""``ringlet.distributed.tensor.debug``: ``CommDebugMode`` (re-exports only)."""

from ringlet.dtensor.debug import CommDebugMode

__all__ = ["CommDebugMode"]
