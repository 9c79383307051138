"""``ringlet.distributed.checkpoint.state_dict_saver``: torch's module of ``save``,
``async_save`` and ``AsyncCheckpointerType`` (re-exports only)."""

from ringlet.checkpoint._api import AsyncCheckpointerType, async_save, save

__all__ = ["AsyncCheckpointerType", "async_save", "save"]
