"""``ringlet.distributed.checkpoint.state_dict_loader``: torch's module of ``load`` and the
deprecated ``load_state_dict`` (re-exports only)."""

from ringlet.checkpoint import load, load_state_dict

__all__ = ["load", "load_state_dict"]
