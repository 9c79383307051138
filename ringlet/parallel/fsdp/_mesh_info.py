"""Which process groups a fully_shard call communicates over, read once from its DeviceMesh.

A 1-d mesh is plain FSDP: parameters are ``Shard(0)`` over its one axis.  A 2-d mesh is HSDP:
axis 0 replicates, axis 1 shards, placements ``(Replicate(), Shard(0))``; gradients are
reduce-scattered over the shard axis and then all-reduced over the replicate axis.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ringlet.c10d.group import ProcessGroup
from ringlet.dtensor import Replicate, Shard
from ringlet.mesh import DeviceMesh, init_device_mesh
from ringlet.mesh.device_mesh import joined_world
from ringlet.parallel.fsdp import _device

__all__ = ["MeshInfo", "resolve_mesh", "subgroups"]


@dataclasses.dataclass(frozen=True)
class MeshInfo:
    """The groups and ranks of one fully_shard call (kept for the life of its hooks)."""

    mesh: DeviceMesh                         # 1-d or 2-d
    shard_group: ProcessGroup
    shard_rank: int
    shard_size: int
    replicate_group: ProcessGroup | None     # HSDP only
    replicate_size: int

    @property
    def is_hsdp(self) -> bool:
        return self.replicate_group is not None

    @property
    def data_parallel_size(self) -> int:
        """Ranks whose gradients are averaged: shard x replicate."""
        return self.shard_size * self.replicate_size

    def placements(self, dim: int = 0) -> tuple[Any, ...]:
        if self.is_hsdp:
            return (Replicate(), Shard(dim))
        return (Shard(dim),)

    def __deepcopy__(self, memo: dict[int, Any]) -> MeshInfo:
        return self     # process groups are shared resources: a copied model uses the same ones

    def __repr__(self) -> str:
        kind = (f"HSDP {self.replicate_size}x{self.shard_size}" if self.is_hsdp
                else f"FSDP {self.shard_size}")
        return f"MeshInfo({kind}, shard rank {self.shard_rank})"


def resolve_mesh(mesh: DeviceMesh | None) -> MeshInfo:
    """Build a :class:`MeshInfo` from ``mesh``.

    ``None``: a 1-d mesh over the default world (joined first if this process has not, as
    ``init_device_mesh`` does), a ``"cuda"`` one when CUDA is available, else a ``"cpu"`` one
    ([Note: FSDP devices] in ``_device.py``).

    Raises:
        TypeError: ``mesh`` is not a DeviceMesh.
        ValueError: a mesh of more than 2 axes, or a device type other than "cpu" or "cuda".
    """
    if mesh is None:
        kind = _device.default_mesh_type()
        mesh = init_device_mesh(kind, (joined_world(kind).world_size,))
    if not isinstance(mesh, DeviceMesh):
        raise TypeError("fully_shard: mesh: expected a DeviceMesh or None, "
                        f"got {type(mesh).__name__}")
    if getattr(mesh, "device_type", "cpu") not in ("cpu", "cuda"):
        raise ValueError("fully_shard: mesh: expected device type 'cpu' or 'cuda', "
                         f"got {mesh.device_type!r}")
    if mesh.ndim == 1:
        pg = mesh.get_group(0)
        return MeshInfo(mesh, pg, pg.rank(), pg.size(), None, 1)
    if mesh.ndim == 2:
        rep, shard = mesh.get_group(0), mesh.get_group(1)
        return MeshInfo(mesh, shard, shard.rank(), shard.size(), rep, rep.size())
    raise ValueError("fully_shard: mesh: expected a 1-d (FSDP) or 2-d (HSDP) "
                     f"mesh, got {mesh.ndim} axes")


def subgroups(info: MeshInfo, size: int, kind: str) -> ProcessGroup:
    """This rank's group among new groups of ``size`` consecutive shard ranks (collective, cached).

    Every line of the shard axis, across the whole root mesh, is cut into blocks of ``size``
    ranks (sorted, as group ranks are) and each block gets a new group, on every rank in the
    same order (``new_group`` is collective over the world), so every rank must make the same
    calls.  ``kind`` keeps groups of different purposes apart (``"post_forward"``: resharding to
    a smaller group; ``"reduce_scatter"``: a separate group for reduce-scatters, ``size`` = the
    shard size).  Cached per root mesh.
    """
    from ringlet.c10d.world import current_world, new_group

    mesh = info.mesh
    root, axes = mesh._root, mesh._axes[-1]
    cache = root.__dict__.setdefault("_ringlet_fsdp_subgroups", {})
    key = (kind, axes, size)
    if key in cache:
        return cache[key]
    me = current_world().rank
    others = [a for a in range(root.ndim) if a not in axes]
    lines = root.mesh.permute(others + list(axes)).reshape(-1,
                                                           math.prod(root.shape[a] for a in axes))
    mine = None
    for line in lines.tolist():
        ranks = sorted(line)
        for start in range(0, len(ranks), size):
            block = ranks[start:start + size]
            group = new_group(block, group_desc=f"fully_shard {kind} {block}")
            if me in block:
                mine = group
    if mine is None:
        raise AssertionError(f"fully_shard: rank {me} is in none of the {kind} groups of {root!r}")
    cache[key] = mine
    return mine
