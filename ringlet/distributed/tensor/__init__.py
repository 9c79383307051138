"""``ringlet.distributed.tensor``: torch's ``torch.distributed.tensor`` (re-exports only).

The implementation lives in ``ringlet.dtensor`` (layer 6) and ``ringlet.mesh`` (layer 5).
"""

from ringlet.dtensor import (
    DTensor,
    Partial,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    ones,
    rand,
    randn,
    zeros,
)
from ringlet.mesh import DeviceMesh, init_device_mesh

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
