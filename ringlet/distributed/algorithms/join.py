"""``ringlet.distributed.algorithms.join``: ``Join``, ``Joinable``, ``JoinHook`` (implemented in
ringlet.parallel.join)."""

from ringlet.parallel.join import *
from ringlet.parallel.join import __all__  # noqa: F401
