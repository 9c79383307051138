"""``ringlet.distributed._tensor.device_mesh``: legacy path of ``DeviceMesh`` (re-exports only)."""

from ringlet.mesh import *
from ringlet.mesh import __all__  # noqa: F401
