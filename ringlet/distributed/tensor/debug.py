"""``ringlet.distributed.tensor.debug``: ``CommDebugMode`` (re-exports only)."""

from ringlet.dtensor.debug import *
from ringlet.dtensor.debug import __all__  # noqa: F401
