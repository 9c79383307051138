"""Moving a module's inputs to its device: the one helper DDP and fully_shard share.

DDP (``device_ids=[i]``) and fully_shard (parameters on an accelerator) both move a forward's
tensor arguments to the module's device before running it.  The rule lives here, beside both
strategies rather than inside either, so neither depends on the other's private modules.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["move_to"]


def move_to(obj: Any, device: torch.device) -> Any:
    """``obj`` with every tensor inside (tuples, lists, dicts, namedtuples) moved to ``device``.

    Copies from pinned memory are asynchronous on the current stream (``non_blocking``), so the
    host does not wait for them; other containers and values pass through unchanged.
    """
    if isinstance(obj, torch.Tensor):
        return obj if obj.device == device else obj.to(device, non_blocking=True)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):           # namedtuple
        return type(obj)(*(move_to(x, device) for x in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(move_to(x, device) for x in obj)
    if isinstance(obj, dict):
        return type(obj)((k, move_to(v, device)) for k, v in obj.items())
    return obj
