"""``ringlet.distributed.tensor.device_mesh``: ``DeviceMesh`` where torch also has it (re-exports only)."""

from ringlet.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
