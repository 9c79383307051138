"""``ringlet.distributed._tensor.device_mesh``: legacy path of ``DeviceMesh`` (re-exports only)."""

from ringlet.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
