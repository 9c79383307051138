"""``ringlet.distributed._tensor``: the legacy path of ``ringlet.distributed.tensor`` (re-exports only).

Published examples still import from here (``from torch.distributed._tensor import DTensor,
Shard, Replicate, distribute_tensor``), so it keeps torch's legacy names and submodules
(``api``, ``placement_types``, ``device_mesh``, ``experimental``).
"""

from ringlet.distributed.tensor import (
    DeviceMesh,
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    init_device_mesh,
    ones,
    rand,
    randn,
    zeros,
)

__all__ = [
    "DTensor",
    "DeviceMesh",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "init_device_mesh",
    "ones",
    "rand",
    "randn",
    "zeros",
]
