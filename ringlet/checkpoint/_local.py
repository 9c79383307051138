"""What this rank holds of a tensor: its local piece and that piece's box in the global tensor.

A plain tensor is held whole (replicated on every rank that has the key: DDP parameters,
optimizer step counters).  A DTensor holds the box its placements give this rank's mesh
coordinate (``Shard`` splits a dim, ``Replicate`` keeps it whole; axes that shard the
same dim nest in mesh-axis order, and uneven shards follow torch.chunk's sizes -- the
same arithmetic DTensor itself uses, so any mesh, any placement, 2-d included).
A ``Partial`` DTensor is reduced before saving (one collective on that axis); loading into
one gives the full value to coordinate 0 of the axis and the reduction's neutral part
to the others (``Partial.partition``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ringlet.checkpoint._geometry import Box
from ringlet.dtensor import DTensor, Replicate
from ringlet.dtensor._shard_math import local_shape_and_offset

__all__ = ["load_piece", "save_piece"]


def _box(t: DTensor) -> Box:
    coord = t.device_mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"a DTensor on {t.device_mesh!r} reached a rank outside its mesh")
    sizes, offsets = local_shape_and_offset(tuple(t.shape), t.device_mesh.shape, coord,
                                            t.placements)
    return Box.of(offsets, sizes)


def save_piece(t: torch.Tensor) -> tuple[torch.Tensor, Box]:
    """This rank's piece of ``t`` (detached, sharing memory unless a reduction
    was needed) and its box."""
    with torch.no_grad():
        if isinstance(t, DTensor):
            if any(p.is_partial() for p in t.placements):
                t = t.redistribute(t.device_mesh,
                                   [Replicate() if p.is_partial() else p for p in t.placements])
            local = t.to_local().detach()
            box = _box(t)
            if tuple(local.shape) != box.sizes:
                raise AssertionError(f"DTensor local shape {list(local.shape)} differs from "
                                     f"its placements' box {box}")
            return local, box
        return t.detach(), Box.of([0] * t.dim(), t.shape)


def load_piece(t: torch.Tensor) -> tuple[torch.Tensor, Box, Callable[[], None] | None]:
    """The local tensor to fill for target ``t``, its box, and a step to run once it is filled."""
    if not isinstance(t, DTensor):
        return t.detach(), Box.of([0] * t.dim(), t.shape), None
    local = t.to_local().detach()
    box = _box(t)
    partial = [(axis, p) for axis, p in enumerate(t.placements) if p.is_partial()]
    if not partial:
        return local, box, None
    coord = t.device_mesh.get_coordinate() or []

    def finish() -> None:
        with torch.no_grad():
            for axis, p in partial:
                part = p.partition(local, coord[axis])   # type: ignore[attr-defined]
                if part is not local:
                    local.copy_(part)
    return local, box, finish
