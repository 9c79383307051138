"""Live meshes per world, so that an unpickled DTensor finds its mesh ([Note: DTensor pickling]).

Root meshes are remembered (weakly) on the world object they were built in -- the
world of a rank thread or of the process -- never in a module global, so ranks that
are threads in one process never see each other's meshes.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ringlet.mesh.device_mesh import DeviceMesh

__all__ = ["find", "register"]


def register(w: Any, mesh: DeviceMesh) -> None:
    """Remember root meshes per world so that unpickled DTensors find their live mesh."""
    w.meshes[:] = [r for r in w.meshes if r() is not None]
    w.meshes.append(weakref.ref(mesh))


def find(w: Any, device_type: str, ranks: list[Any],
         names: tuple[str, ...] | None) -> DeviceMesh | None:
    """The live mesh of world ``w`` with this layout (a root, or a slice or flattening of one).

    ``None`` when this world built none; :func:`ringlet.mesh.device_mesh.restore_mesh` decides
    what then happens.
    """
    target = torch.tensor(ranks, dtype=torch.int64)
    for ref in list(w.meshes):
        root = ref()
        if root is None or root._device_type != device_type:
            continue
        found = _match(root, target, names)
        if found is not None:
            return found
    return None


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
