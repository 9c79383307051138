"""``ringlet.distributed.checkpoint.state_dict_saver``: torch's module of ``save``,
``async_save``, ``AsyncCheckpointerType`` and the deprecated ``save_state_dict`` (re-exports
only)."""

from ringlet.checkpoint._api import AsyncCheckpointerType, async_save, save
from ringlet.checkpoint._deprecated import save_state_dict

__all__ = ["AsyncCheckpointerType", "async_save", "save", "save_state_dict"]
