"""DTensor (layer 6): placements, the DTensor class, redistribution and sharding rules."""

# Loading the dispatcher installs DTensor.__torch_dispatch__ and registers the sharding rules.
from ringlet.dtensor import _dispatch  # noqa: F401
from ringlet.dtensor._api import DTensor, distribute_tensor, serialization_globals
from ringlet.dtensor._factory import empty, full, ones, rand, randn, zeros
from ringlet.dtensor._module import distribute_module
from ringlet.dtensor.debug import CommDebugMode
from ringlet.dtensor.experimental import implicit_replication
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = [
    "CommDebugMode",
    "DTensor",
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "distribute_module",
    "distribute_tensor",
    "empty",
    "full",
    "implicit_replication",
    "ones",
    "rand",
    "randn",
    "serialization_globals",
    "zeros",
]
