"""``ringlet.distributed.tensor.parallel.loss``: ``loss_parallel`` (re-exports only)."""

from ringlet.parallel.tensor_parallel.loss import *
from ringlet.parallel.tensor_parallel.loss import __all__  # noqa: F401
