"""DeviceMesh (layer 5): n-d meshes of ranks with one process group per axis line."""

from ringlet.mesh.device_mesh import DeviceMesh, init_device_mesh

__all__ = ["DeviceMesh", "init_device_mesh"]
