"""``ringlet.distributed.checkpoint.stateful``: ``Stateful`` (re-export only)."""

from ringlet.checkpoint.stateful import Stateful

__all__ = ["Stateful"]
