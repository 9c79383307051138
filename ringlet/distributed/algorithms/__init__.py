"""``ringlet.distributed.algorithms``: torch.distributed.algorithms' public names (re-exports only)."""

from ringlet.parallel.join import Join, Joinable, JoinHook

__all__ = ["Join", "JoinHook", "Joinable"]
