"""``ringlet.distributed._tensor.experimental``: legacy path (re-exports only)."""

from ringlet.distributed.tensor.experimental import implicit_replication

__all__ = ["implicit_replication"]
