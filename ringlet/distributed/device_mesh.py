"""``ringlet.distributed.device_mesh``: torch's ``torch.distributed.device_mesh`` (re-exports
only)."""

from ringlet.mesh import *
from ringlet.mesh import __all__  # noqa: F401
