"""``ringlet.distributed.algorithms``: torch.distributed.algorithms' public names (re-exports
only)."""

from ringlet.parallel.join import *
from ringlet.parallel.join import __all__  # noqa: F401
