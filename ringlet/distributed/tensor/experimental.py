"""``ringlet.distributed.tensor.experimental``: ``implicit_replication`` (re-exports only)."""

from ringlet.dtensor.experimental import implicit_replication

__all__ = ["implicit_replication"]
