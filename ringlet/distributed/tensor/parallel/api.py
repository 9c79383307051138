"""``ringlet.distributed.tensor.parallel.api``: ``parallelize_module`` (re-exports only)."""

from ringlet.parallel.tensor_parallel.api import *
from ringlet.parallel.tensor_parallel.api import __all__  # noqa: F401
