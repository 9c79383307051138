"""DTensor's seeding helpers at torch's private path ``torch.distributed.tensor._random``:
``manual_seed(seed, device_mesh)`` and ``is_rng_supported_mesh(device_mesh)``.

ringlet's DTensor random ops draw from torch's default generator of the mesh's device: the
factories ``rand``/``randn`` draw the whole tensor and keep this rank's piece (so they equal
one process's draw after the same seed), elementwise random ops (dropout) draw each rank's
piece independently.  So seeding DTensor randomness is seeding torch, on every device type;
torch 2.13's ``manual_seed`` also just calls ``torch.manual_seed`` (on an accelerator mesh; on
a CPU mesh it only warns).

Example::

    manual_seed(1234, mesh)                 # every rank of mesh, the same seed
    w = randn(8, 4, device_mesh=mesh, placements=[Shard(0)])
"""

from __future__ import annotations

import torch

from ringlet.mesh import DeviceMesh

__all__ = ["is_rng_supported_mesh", "manual_seed"]


def is_rng_supported_mesh(device_mesh: DeviceMesh) -> bool:
    """Whether DTensor random ops work on ``device_mesh``: always (they use torch's default
    generator of the mesh's device type)."""
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"is_rng_supported_mesh: device_mesh: expected a DeviceMesh, got "
                        f"{type(device_mesh).__name__}")
    return True


def manual_seed(seed: int, device_mesh: DeviceMesh) -> None:
    """Seed the random numbers DTensor draws on this rank (``torch.manual_seed(seed)``).

    Every rank of ``device_mesh`` must call it with the same ``seed`` (not checked, as in torch).

    Raises:
        TypeError: ``seed`` is not an int or ``device_mesh`` not a DeviceMesh.
        RuntimeError: this rank is not part of ``device_mesh`` (its DTensor random ops would
            not follow the mesh's seed).
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed: seed: expected an int, got {type(seed).__name__}")
    if not isinstance(device_mesh, DeviceMesh):
        raise TypeError(f"manual_seed: device_mesh: expected a DeviceMesh, got "
                        f"{type(device_mesh).__name__}")
    if device_mesh.get_coordinate() is None:
        raise RuntimeError(f"manual_seed: expected rank {device_mesh.get_rank()} to be part of "
                           f"{device_mesh!r}, got a mesh without it: only the mesh's ranks may "
                           "seed its random ops")
    torch.manual_seed(seed)
