"""``ringlet.distributed.tensor.device_mesh``: ``DeviceMesh`` where torch also has it (re-exports
only)."""

from ringlet.mesh import *
from ringlet.mesh import __all__  # noqa: F401
