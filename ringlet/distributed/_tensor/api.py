"""``ringlet.distributed._tensor.api``: legacy path of the DTensor API (re-exports only)."""

from ringlet.distributed.tensor import *
from ringlet.distributed.tensor import __all__  # noqa: F401
