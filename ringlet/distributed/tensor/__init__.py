"""``ringlet.distributed.tensor``: torch's ``torch.distributed.tensor`` (re-exports only).

The implementation lives in ``ringlet.dtensor`` (layer 6) and ``ringlet.mesh`` (layer 5).  The
names are the mesh's list and torch's part of ``ringlet.dtensor``, whose other names
(``CommDebugMode``, ``implicit_replication``) live at torch's submodules ``debug`` and
``experimental``.
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
from ringlet.mesh import *
from ringlet.mesh import __all__ as _mesh_all

__all__ = [
    *_mesh_all,
    "DTensor",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "ones",
    "rand",
    "randn",
    "zeros",
]
