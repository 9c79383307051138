"""Pure shard arithmetic with ``torch.chunk`` semantics (no process group needed).

A dimension of ``size`` elements split over ``n`` shards gives every shard
``ceil(size / n)`` elements until the data runs out, then empty shards: 33 rows on
2 ranks -> 17, 16; 3 rows on 4 ranks -> 1, 1, 1, 0; 5 rows on 4 ranks -> 2, 2, 1, 0.
That is what ``torch.chunk`` returns, padded with empty chunks to ``n`` pieces, so a
shard is always ``tensor.chunk(n, dim)[i]`` (or empty).

Several mesh axes may shard the same tensor dim (``[S(0), S(0)]``): placements are
applied in mesh-axis order, each axis chunking what the axes before it left
(chunk of a chunk).  A ``_StridedShard`` is applied after every plain shard, so the
order is: plain shards in mesh order, then strided ones in mesh order
(:func:`shard_order`).  :func:`local_shape_and_offset` walks that order.

This is ringlet's one ``torch.chunk`` size rule: fully_shard's flat layouts
(``ringlet/parallel/fsdp/_shard_math.py``) take their shard sizes from here too.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "chunk_offset",
    "chunk_size",
    "chunk_sizes",
    "contiguous_strides",
    "local_shape_and_offset",
    "pad_dim",
    "padded_chunk",
    "shard_order",
    "size_seen_by_axis",
    "strides_like",
]


def padded_chunk(size: int, n: int) -> int:
    """The size every shard but the last non-empty ones has: ``ceil(size / n)`` (what a shard is
    padded to when all ``n`` must be equal, e.g. for an all-gather or fully_shard's buffers)."""
    return -(-size // n)


def chunk_sizes(size: int, n: int) -> list[int]:
    """Sizes of the ``n`` shards of a dim of ``size`` elements (``torch.chunk`` then empty pads).

    >>> chunk_sizes(33, 2), chunk_sizes(3, 4), chunk_sizes(5, 4)
    ([17, 16], [1, 1, 1, 0], [2, 2, 1, 0])
    """
    if n <= 0:
        raise ValueError(f"chunk_sizes: n: expected a positive number of shards, got {n}")
    if size < 0:
        raise ValueError(f"chunk_sizes: size: expected a non-negative size, got {size}")
    full = padded_chunk(size, n)
    return [max(0, min(full, size - i * full)) for i in range(n)]


def chunk_size(size: int, n: int, i: int) -> int:
    """Size of shard ``i`` of ``n`` (see :func:`chunk_sizes`)."""
    full = padded_chunk(size, n)
    return max(0, min(full, size - i * full))


def chunk_offset(size: int, n: int, i: int) -> int:
    """Index of the first element of shard ``i`` of ``n`` along the dim (``size`` when empty)."""
    return min(i * padded_chunk(size, n), size)


def shard_order(placements: Sequence[object]) -> list[int]:
    """The mesh axes that shard, in the order their chunks are taken (see the module docstring)."""
    plain = [a for a, p in enumerate(placements)
             if _is_shard(p) and not getattr(p, "_applied_last", False)]
    return plain + [a for a, p in enumerate(placements)
                    if _is_shard(p) and getattr(p, "_applied_last", False)]


def local_shape_and_offset(global_shape: Sequence[int], mesh_shape: Sequence[int],
                           coord: Sequence[int], placements: Sequence[object],
                           ) -> tuple[list[int], list[int]]:
    """The shape of this rank's shard and its offset in the global tensor.

    ``placements`` are objects with ``is_shard()`` and ``dim`` (``Shard``); anything
    else (``Replicate``, ``Partial``) leaves the dim whole.
    """
    shape = list(global_shape)
    offset = [0] * len(shape)
    for axis in shard_order(placements):
        p = placements[axis]
        d = p.dim  # type: ignore[attr-defined]
        n, i = mesh_shape[axis], coord[axis]
        offset[d] += chunk_offset(shape[d], n, i)
        shape[d] = chunk_size(shape[d], n, i)
    return shape, offset


def size_seen_by_axis(global_shape: Sequence[int], mesh_shape: Sequence[int], coord: Sequence[int],
                      placements: Sequence[object], axis: int, dim: int) -> int:
    """Size of ``dim`` before ``axis`` splits it: what the shards of the axes before it leave.

    The planner makes sure no later axis shards ``dim`` when ``axis`` talks about it,
    so this is also the size of the local tensor's ``dim`` whenever ``axis`` holds it whole.
    """
    size = global_shape[dim]
    for a in shard_order(placements):
        if a == axis:
            break
        if placements[a].dim == dim:  # type: ignore[attr-defined]
            size = chunk_size(size, mesh_shape[a], coord[a])
    return size


def _is_shard(p: object) -> bool:
    return bool(getattr(p, "is_shard", lambda: False)())


def pad_dim(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``t`` grown to ``size`` along ``dim`` with zeros (returned as is when already that size)."""
    have = t.shape[dim]
    if have == size:
        return t
    if have > size:
        raise AssertionError(f"pad_dim: cannot pad dim {dim} of size {have} down to {size}")
    pad_shape = list(t.shape)
    pad_shape[dim] = size - have
    return torch.cat([t, t.new_zeros(pad_shape)], dim)


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides of ``shape``."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * max(1, shape[d + 1])
    return tuple(strides)


def strides_like(local: torch.Tensor, global_shape: Sequence[int]) -> tuple[int, ...]:
    """Strides for ``global_shape`` that keep the dim order of ``local``'s layout.

    A contiguous shard gives contiguous global strides; a transposed shard gives
    transposed global strides, so ``is_contiguous()`` answers the same on both.
    """
    if local.is_contiguous() or local.dim() < 2:
        return contiguous_strides(global_shape)
    st = local.stride()
    order = sorted(range(local.dim()), key=lambda d: (-st[d], -d))
    strides = [0] * len(global_shape)
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= max(1, global_shape[d])
    return tuple(strides)
