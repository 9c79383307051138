"""Live meshes per world, so that an unpickled DTensor finds its mesh ([Note: DTensor pickling]).

Root meshes are remembered (weakly) on the world object they were built in -- the
world of a rank thread or of the process -- never in a module global, so ranks that
are threads in one process never see each other's meshes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import world as _world

if TYPE_CHECKING:
    from ringlet.mesh.device_mesh import DeviceMesh

__all__ = ["register", "restore_mesh"]


def register(w: Any, mesh: DeviceMesh) -> None:
    """Remember root meshes per world so that unpickled DTensors find their live mesh."""
    w.meshes[:] = [r for r in w.meshes if r() is not None]
    w.meshes.append(weakref.ref(mesh))


def restore_mesh(device_type: str, ranks: list[Any], names: tuple[str, ...] | None) -> DeviceMesh:
    """Reattach a pickled mesh to the current world (policy in docs/dtensor.md, "Saving").

    The mesh must have been built in this world already (it, or a root it is a slice or
    flattening of); a 1-d mesh of the whole world in rank order is rebuilt on the default
    group.  Building groups here is not an option: unpickling is not collective.
    """
    w = _world.current_world(required=False)
    if w is None:
        raise ValueError("torch.load of a DTensor: expected an initialized process group (the "
                         "DTensor's DeviceMesh is reattached to the current world), got none; call "
                         "init_process_group and build the mesh first")
    target = torch.tensor(ranks, dtype=torch.int64)
    for ref in list(w.meshes):
        root = ref()
        if root is None or root._device_type != device_type:
            continue
        found = _match(root, target, names)
        if found is not None:
            return found
    if target.dim() == 1 and target.tolist() == list(range(w.world_size)):
        from ringlet.mesh.device_mesh import DeviceMesh

        return DeviceMesh.from_group(w.default_pg, device_type, mesh_dim_names=names)
    raise ValueError(f"torch.load of a DTensor: expected DeviceMesh({device_type}, {ranks}, "
                     f"names={names}) to exist in this world, got none; build it (init_device_mesh "
                     "/ DeviceMesh) on every rank before loading")


def _match(root: DeviceMesh, target: torch.Tensor,
           names: tuple[str, ...] | None) -> DeviceMesh | None:
    candidates = [root]
    if names is not None and names != root._names and root._coord is not None:
        try:
            candidates.append(root[names])
        except (KeyError, ValueError):
            pass
    for m in candidates:
        if m._names == names and m.shape == tuple(target.shape) and torch.equal(m._mesh, target):
            return m
    return None
