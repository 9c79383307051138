"""``DTensorSpec``: a DTensor's mesh, placements, global shape and stride (pure metadata).

Specs are immutable values.  Each one carries ``_key``: a token shared by every spec with
the same placements, shape and stride (interned here), which is what the dispatch cache
keys on ([Note: dispatch cache] in ``_dispatch.py``): the token hashes and compares by
identity, so building a cache key costs an attribute read per DTensor argument.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor.placements import Placement, Replicate, Shard
from ringlet.mesh import DeviceMesh

__all__ = ["DECISIONS", "DTensorSpec", "Placements", "decisions_of", "format_spec",
           "normalize_placements"]

Placements = tuple[Placement, ...]

_DTYPE_TAGS = {
    torch.float32: "f32", torch.float64: "f64", torch.float16: "f16", torch.bfloat16: "bf16",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8",
    torch.bool: "b8", torch.complex64: "c64", torch.complex128: "c128",
}


@dataclasses.dataclass(frozen=True)
class DTensorSpec:
    """Where a DTensor's global value lives: ``placements[i]`` says what mesh axis ``i`` does."""

    mesh: DeviceMesh
    placements: Placements
    shape: tuple[int, ...]        # global shape
    stride: tuple[int, ...]       # global stride (what the wrapper tensor reports)
    # the interned (placements, shape, stride) token the dispatch cache keys on (see above)
    _key: object = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_key", _intern(self.placements, self.shape, self.stride))
        if DECISIONS not in self.mesh.__dict__:     # before the first op on this mesh's DTensors
            decisions_of(self.mesh)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def coordinate(self) -> list[int]:
        coord = self.mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"rank {self.mesh.get_rank()} is not part of {self.mesh!r}; DTensors "
                             "live on the ranks of their mesh")
        return coord

    def local_shape(self) -> list[int]:
        return _shard_math.local_shape_and_offset(self.shape, self.mesh.shape, self.coordinate(),
                                                  self.placements)[0]

    def local_offset(self) -> list[int]:
        return _shard_math.local_shape_and_offset(self.shape, self.mesh.shape, self.coordinate(),
                                                  self.placements)[1]

    def with_placements(self, placements: Placements) -> DTensorSpec:
        return dataclasses.replace(self, placements=placements)

    def is_replicated(self) -> bool:
        return all(p.is_replicate() for p in self.placements)


# [Note: decisions per mesh]
# The dispatch cache ([Note: dispatch cache] in ``_dispatch.py``) holds one dict of decisions
# per mesh *object*: ranks that are threads build equal meshes, and a cached local function may
# close over its own rank's coordinate.  The dict is DTensor's state, created and read only
# here and in the dispatch; ``ringlet.mesh`` knows nothing of it.  It hangs on the mesh object
# under the attribute ``DECISIONS`` (set on the first spec of a mesh) rather than in a map
# beside it: the recorded output specs name their mesh, so a map keyed by the mesh (even
# weakly) would keep every mesh, and its process groups, alive for ever; on the mesh, the dict
# goes with it.  The hot path reads it as one attribute, as fast as a field of the mesh.
DECISIONS = "_dtensor_decisions"


def decisions_of(mesh: DeviceMesh) -> dict[Any, Any]:
    """The dispatch decisions recorded for ``mesh`` (see [Note: decisions per mesh])."""
    found = mesh.__dict__.get(DECISIONS)
    if found is None:
        found = mesh.__dict__.setdefault(DECISIONS, {})
    return found


class _SpecKey:
    """A layout token: hashes and compares by identity (C-level), unlike a tuple of tuples."""

    __slots__ = ("serial", "value")

    def __init__(self, value: tuple[Any, ...], serial: int) -> None:
        self.value = value
        self.serial = serial

    def __repr__(self) -> str:
        return f"SpecKey#{self.serial}"


_KEYS: dict[tuple[Any, ...], _SpecKey] = {}
_SERIAL = itertools.count()
_MAX_KEYS = 100_000      # distinct layouts remembered; past that the table restarts (see _intern)


def _intern(placements: Placements, shape: tuple[int, ...], stride: tuple[int, ...]) -> _SpecKey:
    """The token of a layout.  Thread-safe under the GIL (``dict.setdefault`` is atomic).

    Models see a few hundred layouts; a program that keeps inventing shapes (e.g. every
    sequence length) would grow the table forever, so it restarts past ``_MAX_KEYS``.
    Specs made before then keep their tokens: their cache entries just stop being shared.
    """
    value = (placements, shape, stride)
    key = _KEYS.get(value)
    if key is None:
        if len(_KEYS) >= _MAX_KEYS:
            _KEYS.clear()
        key = _KEYS.setdefault(value, _SpecKey(value, next(_SERIAL)))
    return key


def normalize_placements(placements: Sequence[Placement] | None, mesh: DeviceMesh, ndim: int,
                         op: str) -> Placements:
    """``placements`` as a tuple of one placement per mesh axis, negative shard dims resolved.

    ``None`` means all ``Replicate``.  Raises ``ValueError``/``TypeError`` naming ``op``.
    """
    if placements is None:
        return (Replicate(),) * mesh.ndim
    pls = tuple(placements)
    if len(pls) != mesh.ndim:
        raise ValueError(f"{op}: placements: expected one placement per mesh axis ({mesh.ndim} for "
                         f"{mesh!r}), got {list(pls)}")
    out: list[Placement] = []
    for p in pls:
        if not isinstance(p, Placement):
            raise TypeError(f"{op}: placements: expected Shard, Replicate or "
                            f"Partial objects, got {p!r}")
        if isinstance(p, Shard):
            if not -ndim <= p.dim < max(ndim, 1) or ndim == 0:
                raise ValueError(f"{op}: placements: {p!r} names a dim outside a {ndim}-d tensor")
            p = dataclasses.replace(p, dim=p.dim % ndim)   # keeps subclasses (_StridedShard)
        out.append(p)
    return tuple(out)


def format_spec(spec: DTensorSpec, dtype: torch.dtype) -> str:
    """One line: ``DTensor(f32[8@tp,4] S(0)R)``; a sharded dim names the axes that split it."""
    names = spec.mesh.mesh_dim_names
    dims = []
    for d, size in enumerate(spec.shape):
        axes = [names[a] if names else str(a)
                for a, p in enumerate(spec.placements) if p.is_shard(d)]
        dims.append(str(size) + "".join(f"@{a}" for a in axes))
    tag = _DTYPE_TAGS.get(dtype, str(dtype).replace("torch.", ""))
    pls = "".join(str(p) for p in spec.placements)
    return f"DTensor({tag}[{','.join(dims)}] {pls})"


