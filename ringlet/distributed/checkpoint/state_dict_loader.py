"""``ringlet.distributed.checkpoint.state_dict_loader``: torch's module of ``load``
(re-export only)."""

from ringlet.checkpoint import load

__all__ = ["load"]
