"""Pure planning for fully_shard: per-rank shard sizes, padding and a group's flat layouts.

Nothing here talks to peers; the param group takes a finished :class:`GroupLayout` and
moves bytes with the copy helpers below.

[Note: flat layouts]
Each parameter is sharded on one dim (dim 0 unless ``shard_placement_fn`` says otherwise)
with ``torch.chunk`` semantics (DTensor's rule, ``ringlet/dtensor/_shard_math.py``, so a
fully_shard parameter's shard is its DTensor's local tensor): ``chunk = ceil(size / world)``
units per rank, rank ``r`` owns units ``[r * chunk, min(size, (r + 1) * chunk))`` -- possibly
none (33 rows on 2 ranks: 17 and 16; 1 row on 2 ranks: 1 and 0).  A *unit* is one index along
the shard dim, i.e. ``numel / size`` elements.  Every rank stores each parameter's shard padded
to ``chunk`` units, back to back, in one flat *shard buffer* of ``shard_numel`` elements::

    [p0 shard | pad][p1 shard | pad] ...

Every rank's layout is the same, so ``all_gather_into_tensor`` of the shard buffers gives a
rank-major *gathered buffer* (``world x shard_numel``) in which rank ``r``'s piece of ``p``
sits at ``r * shard_numel + p.shard_offset``.  The copy-out moves those pieces into the
param-major *unsharded buffer*, where every unsharded parameter is one contiguous view.  The
reduce-scatter input is built in the gathered layout from the unsharded gradients, so its
output has the shard buffer's layout and becomes the flat sharded gradient without a copy.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import torch

from ringlet.dtensor._shard_math import chunk_offset, chunk_size, padded_chunk

__all__ = ["GroupLayout", "ParamSpec", "copy_in_grads", "copy_out", "plan_group", "shard_of"]


@dataclasses.dataclass(frozen=True)
class ParamSpec:
    """Where one parameter lives in its group's flat buffers (see [Note: flat layouts])."""

    shape: tuple[int, ...]       # global (unsharded) shape
    dim: int                     # shard dim
    world: int                   # ranks the dim is sharded over
    shard_offset: int            # start of this param's padded shard in the shard buffer
    unsharded_offset: int        # start of the unsharded param in the unsharded buffer

    @property
    def size(self) -> int:
        return self.shape[self.dim]

    @functools.cached_property
    def numel(self) -> int:
        return math.prod(self.shape)

    @functools.cached_property
    def unit(self) -> int:
        """Elements per index along the shard dim."""
        return math.prod(s for i, s in enumerate(self.shape) if i != self.dim)

    @functools.cached_property
    def chunk(self) -> int:
        """Padded units per rank."""
        return padded_chunk(self.size, self.world)

    @functools.cached_property
    def padded_numel(self) -> int:
        """Elements of one rank's padded shard."""
        return self.chunk * self.unit

    def local_units(self, rank: int) -> int:
        return chunk_size(self.size, self.world, rank)

    def local_shape(self, rank: int) -> tuple[int, ...]:
        s = list(self.shape)
        s[self.dim] = self.local_units(rank)
        return tuple(s)

    def local_numel(self, rank: int) -> int:
        return self.local_units(rank) * self.unit

    def contiguous_stride(self) -> tuple[int, ...]:
        stride, acc = [], 1
        for s in reversed(self.shape):
            stride.append(acc)
            acc *= max(s, 1)
        return tuple(reversed(stride))


@dataclasses.dataclass(frozen=True)
class GroupLayout:
    """The flat layouts of one group's parameters over ``world`` ranks."""

    specs: tuple[ParamSpec, ...]
    world: int
    shard_numel: int             # elements of one rank's shard buffer (padding included)
    unsharded_numel: int         # elements of the unsharded buffer (no padding)

    @property
    def gathered_numel(self) -> int:
        return self.world * self.shard_numel

    def padding_numel(self) -> int:
        """Padding elements in one rank's shard buffer (the same on every rank)."""
        return self.shard_numel * self.world - sum(s.numel for s in self.specs)


def plan_group(shapes: Sequence[Sequence[int]], dims: Sequence[int], world: int) -> GroupLayout:
    """Lay out parameters of ``shapes``, sharded on ``dims``, over ``world`` ranks.

    Raises:
        ValueError: a 0-d shape, a dim out of range, or a non-zero shard dim whose size
            does not divide evenly by ``world`` (only dim 0 may be uneven, as in torch).
    """
    if world < 1:
        raise ValueError(f"plan_group: expected world >= 1, got {world}")
    if len(shapes) != len(dims):
        raise ValueError(f"plan_group: expected one dim per shape, got {len(shapes)} "
                         f"shapes and {len(dims)} dims")
    specs, shard_off, unsharded_off = [], 0, 0
    for i, (shape, dim) in enumerate(zip(shapes, dims)):
        shape = tuple(int(s) for s in shape)
        if not shape:
            raise ValueError(f"plan_group: parameter {i}: expected at least 1 dim, got a scalar "
                             f"(fully_shard needs a dim to shard; use shape (1,))")
        if not 0 <= dim < len(shape):
            raise ValueError(f"plan_group: parameter {i}: expected a shard dim in "
                             f"[0, {len(shape)}), got {dim}")
        if dim != 0 and shape[dim] % world:
            raise ValueError(f"plan_group: parameter {i} of shape {list(shape)}: "
                             f"sharding on dim {dim} needs its size ({shape[dim]}) "
                             f"divisible by the world size ({world})")
        spec = ParamSpec(shape, dim, world, shard_off, unsharded_off)
        specs.append(spec)
        shard_off += spec.padded_numel
        unsharded_off += spec.numel
    return GroupLayout(tuple(specs), world, shard_off, unsharded_off)


def shard_of(full: torch.Tensor, spec: ParamSpec, rank: int) -> torch.Tensor:
    """Rank ``rank``'s (unpadded) shard of the full tensor ``full``: a view, not a copy."""
    if tuple(full.shape) != spec.shape:
        raise ValueError("shard_of: expected a tensor of shape "
                         f"{list(spec.shape)}, got {list(full.shape)}")
    start = chunk_offset(spec.size, spec.world, rank)
    return full.narrow(spec.dim, start, spec.local_units(rank))


def _dim0_split(spec: ParamSpec) -> tuple[int, int]:
    """(ranks holding a full chunk, units held by the next rank) for a dim-0 shard."""
    if spec.chunk == 0:
        return 0, 0
    full = spec.size // spec.chunk
    return full, spec.size - full * spec.chunk


def copy_out(gathered: torch.Tensor, unsharded: torch.Tensor, layout: GroupLayout) -> None:
    """Copy a rank-major gathered buffer into the param-major unsharded buffer (one
    or two ops per param)."""
    g = gathered.view(layout.world, layout.shard_numel)
    for spec in layout.specs:
        if spec.numel == 0:
            continue
        dst = unsharded[spec.unsharded_offset:spec.unsharded_offset + spec.numel]
        off, piece = spec.shard_offset, spec.padded_numel
        if spec.dim == 0:
            full, rem = _dim0_split(spec)
            if full:
                dst[:full * piece].view(full, piece).copy_(g[:full, off:off + piece])
            if rem:
                dst[full * piece:].copy_(g[full, off:off + rem * spec.unit])
            continue
        pre = math.prod(spec.shape[:spec.dim])
        post = spec.chunk * math.prod(spec.shape[spec.dim + 1:])
        # dst viewed as (pre, world, chunk*post): rank r's piece is [:, r, :]
        block = g[:, off:off + piece].view(layout.world, pre, post)
        dst.view(pre, layout.world, post).transpose(0, 1).copy_(block)


def copy_in_grads(rs_input: torch.Tensor, grads: Sequence[torch.Tensor | None],
                  layout: GroupLayout) -> None:
    """Lay unsharded gradients out rank-major for a reduce-scatter; padding
    and missing grads become 0.

    ``grads[i]`` is the unsharded gradient of ``layout.specs[i]`` (any dtype; cast on copy) or None.
    """
    g = rs_input.view(layout.world, layout.shard_numel)
    for spec, grad in zip(layout.specs, grads):
        off, piece = spec.shard_offset, spec.padded_numel
        if piece == 0:
            continue
        if grad is None:
            g[:, off:off + piece].zero_()
            continue
        src = grad.reshape(-1)
        if spec.dim == 0:
            full, rem = _dim0_split(spec)
            if full:
                g[:full, off:off + piece].copy_(src[:full * piece].view(full, piece))
            if full < layout.world:
                row = g[full, off:off + piece]
                if rem:
                    row[:rem * spec.unit].copy_(src[full * piece:])
                row[rem * spec.unit:].zero_()
                g[full + 1:, off:off + piece].zero_()
            continue
        pre = math.prod(spec.shape[:spec.dim])
        post = spec.chunk * math.prod(spec.shape[spec.dim + 1:])
        block = src.view(pre, layout.world, post).transpose(0, 1)
        g[:, off:off + piece].view(layout.world, pre, post).copy_(block)
