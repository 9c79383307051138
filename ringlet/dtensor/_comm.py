"""The thin communication of DTensor: one collective along one mesh axis, sizes given.

Every function takes the local tensor and the shard sizes a finished plan computed
(``_redistribute``), talks to the axis's process group through the public collective
API, and returns a new tensor (inputs are never written).  Uneven shards travel
padded to the largest one, or through the uneven list collectives.

A group's ranks are sorted while a mesh line may list them in any order, so pieces
are placed by *group rank* and read back by *mesh coordinate* (``_order``).
"""

from __future__ import annotations

import torch

from ringlet.c10d import collectives as C
from ringlet.c10d.group import ProcessGroup
from ringlet.dtensor import _shard_math, _traceable, debug
from ringlet.dtensor.placements import Partial
from ringlet.mesh import DeviceMesh

__all__ = ["all_gather", "all_reduce", "all_to_all", "broadcast", "reduce_scatter"]


def _group(mesh: DeviceMesh, axis: int) -> ProcessGroup:
    pg = mesh.get_group(axis)
    if isinstance(pg, ProcessGroup):
        return pg
    raise ValueError(f"rank {mesh.get_rank()} is not part of {mesh!r} (axis {axis})")


def _order(mesh: DeviceMesh, axis: int) -> list[int]:
    """Group rank of each coordinate along ``axis`` (the identity for meshes in rank order)."""
    return [mesh._group_rank_of(axis, c) for c in range(mesh.shape[axis])]


def all_gather(t: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int,
               sizes: list[int]) -> torch.Tensor:
    """Concatenate every coordinate's shard of ``dim`` (``sizes[c]`` rows
    each) in coordinate order."""
    pg = _group(mesh, axis)
    debug.record("all_gather")
    order = _order(mesh, axis)
    moved = t.movedim(dim, 0).contiguous()
    rest = list(moved.shape[1:])
    # even and in rank order: one flat buffer
    if len(set(sizes)) == 1 and order == sorted(order):
        out = moved.new_empty([sizes[0] * len(sizes)] + rest)
        return _traceable.all_gather(out, moved, pg).movedim(0, dim)
    if _traceable.tracing(moved):
        raise NotImplementedError(
            f"torch.compile: an all-gather of uneven shards {sizes} (or over a mesh line whose "
            "ranks are out of order) is not traceable; shard evenly, or run this op eagerly")
    by_group = [moved.new_empty([0] + rest)] * len(sizes)
    for c, g in enumerate(order):
        by_group[g] = moved.new_empty([sizes[c]] + rest)
    C.all_gather(by_group, moved, group=pg)
    return torch.cat([by_group[g] for g in order], 0).movedim(0, dim)


def reduce_scatter(t: torch.Tensor, mesh: DeviceMesh, axis: int, dim: int,
                   partial: Partial) -> torch.Tensor:
    """Reduce ``t`` (whole along ``dim``) across the axis and keep this
    coordinate's chunk of ``dim``."""
    pg = _group(mesh, axis)
    debug.record("reduce_scatter")
    order = _order(mesh, axis)
    n = len(order)
    me = mesh.get_local_rank(axis)
    moved = partial.before_reduce(t).movedim(dim, 0)
    sizes = _shard_math.chunk_sizes(moved.shape[0], n)
    full = max(sizes)
    pieces: list[torch.Tensor] = [moved] * n
    for c, g in enumerate(order):
        off = _shard_math.chunk_offset(moved.shape[0], n, c)
        pieces[g] = _shard_math.pad_dim(moved.narrow(0, off, sizes[c]), 0, full)
    out = moved.new_empty([full] + list(moved.shape[1:]))
    out = _traceable.reduce_scatter(out, torch.cat(pieces, 0), partial.c10d_op(), pg)
    return partial.after_reduce(out.narrow(0, 0, sizes[me]), t.dtype).movedim(0, dim).contiguous()


def all_reduce(t: torch.Tensor, mesh: DeviceMesh, axis: int, partial: Partial) -> torch.Tensor:
    """The reduction of ``t`` across the axis (a new tensor)."""
    pg = _group(mesh, axis)
    debug.record("all_reduce")
    buf = partial.before_reduce(t)
    buf = buf.clone(memory_format=torch.contiguous_format) if buf is t else buf.contiguous()
    buf = _traceable.all_reduce(buf, partial.c10d_op(), pg)
    return partial.after_reduce(buf, t.dtype)


def all_to_all(t: torch.Tensor, mesh: DeviceMesh, axis: int, src_dim: int, dst_dim: int,
               src_sizes: list[int]) -> torch.Tensor:
    """Shard(src_dim) -> Shard(dst_dim) along ``axis``: send chunk ``c`` of
    ``dst_dim`` to coordinate ``c``.

    ``src_sizes[c]`` is coordinate ``c``'s shard of ``src_dim``; ``t`` holds ``dst_dim`` whole.
    """
    pg = _group(mesh, axis)
    debug.record("all_to_all")
    order = _order(mesh, axis)
    n = len(order)
    me = mesh.get_local_rank(axis)
    whole = t.shape[dst_dim]
    dst_sizes = _shard_math.chunk_sizes(whole, n)
    send: list[torch.Tensor] = [t] * n
    recv_shapes: list[list[int]] = [[]] * n
    for c, g in enumerate(order):
        send[g] = t.narrow(dst_dim, _shard_math.chunk_offset(whole, n, c), dst_sizes[c]).reshape(-1)
        shape = list(t.shape)
        shape[src_dim], shape[dst_dim] = src_sizes[c], dst_sizes[me]
        recv_shapes[g] = shape
    in_splits = [s.numel() for s in send]
    out_splits = [_numel(s) for s in recv_shapes]
    out = t.new_empty(sum(out_splits))
    out = _traceable.all_to_all_single(out, torch.cat(send), out_splits, in_splits, pg)
    parts = out.split(out_splits)
    return torch.cat([parts[g].view(recv_shapes[g]) for g in order], src_dim)


def broadcast(t: torch.Tensor, mesh: DeviceMesh, axis: int, src_coord: int) -> torch.Tensor:
    """The tensor of the rank at ``src_coord`` along ``axis`` (a new tensor on every rank)."""
    pg = _group(mesh, axis)
    debug.record("broadcast")
    buf = t.detach().clone(memory_format=torch.contiguous_format)
    return _traceable.broadcast(buf, mesh._group_rank_of(axis, src_coord), pg)


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
