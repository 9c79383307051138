"""``ringlet.distributed.device_mesh``: torch's ``torch.distributed.device_mesh`` (re-exports only)."""

from ringlet.mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
