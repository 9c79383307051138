"""DTensor (layer 6): placements, the DTensor class, redistribution and sharding rules."""

# Loading the dispatcher installs DTensor.__torch_dispatch__ and registers the sharding rules.
from ringlet.dtensor import _dispatch  # noqa: F401
from ringlet.dtensor._api import DTensor, distribute_tensor, serialization_globals
from ringlet.dtensor._factory import empty, full, ones, rand, randn, zeros
from ringlet.dtensor._module import distribute_module
from ringlet.dtensor.debug import CommDebugMode
from ringlet.dtensor.experimental import implicit_replication
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard


def _use_foreach_kernels() -> None:
    """Let torch.optim and ``clip_grad_norm_`` pick their multi-tensor (foreach) kernels for
    DTensor parameters by default, as they do for plain tensors on a GPU: their defaults accept
    only the tensor types in these lists, and a per-parameter loop would cost one dispatch per
    parameter and op (the foreach ops have a sharding rule, ``_ops/pointwise.py``)."""
    import torch.optim.optimizer as optim_mod
    import torch.utils._foreach_utils as foreach_mod

    for mod in (optim_mod, foreach_mod):
        kinds = getattr(mod, "_foreach_supported_types", None)   # private: may move in torch
        if isinstance(kinds, list) and DTensor not in kinds:
            kinds.append(DTensor)


_use_foreach_kernels()

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
