"""``ringlet.distributed.algorithms.join``: ``Join``, ``Joinable``, ``JoinHook`` (implemented in ringlet.parallel.join)."""

from ringlet.parallel.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
