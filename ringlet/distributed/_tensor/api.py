"""``ringlet.distributed._tensor.api``: legacy path of the DTensor API (re-exports only)."""

from ringlet.distributed.tensor import (
    DTensor,
    distribute_module,
    distribute_tensor,
    empty,
    full,
    ones,
    rand,
    randn,
    zeros,
)

__all__ = ["DTensor", "distribute_module", "distribute_tensor", "empty", "full", "ones", "rand", "randn", "zeros"]
