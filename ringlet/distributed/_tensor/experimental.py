"""``ringlet.distributed._tensor.experimental``: legacy path (re-exports only)."""

from ringlet.distributed.tensor.experimental import *
from ringlet.distributed.tensor.experimental import __all__  # noqa: F401
