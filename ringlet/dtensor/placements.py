"""Placements: how a DTensor's global value is laid out along one mesh axis.

Three small frozen value objects that own their math.  Each prints as torch's does: ``repr``
spells it out (``Shard(dim=0)``), ``str`` is a short tag (``S(0)``, used in ringlet's one-line
DTensor repr):

* ``Shard(dim)`` -- ``S(0)``: every rank along the axis holds one ``torch.chunk``
  piece of tensor dim ``dim`` (uneven sizes allowed, see ``_shard_math``).
* ``Replicate()`` -- ``R``: every rank holds the whole value.
* ``Partial(reduce_op="sum")`` -- ``P(sum)`` (repr ``Partial(sum)``): every rank holds a tensor
  of the full shape and the global value is their reduction (``sum``, ``avg``, ``max``, ``min``).
* ``_StridedShard(dim, split_factor)`` -- ``_S(0, 2)`` (repr ``_StridedShard(dim=0, sf=2)``): a
  ``Shard`` that chunks after the later axes' shards of the same dim (fully_shard over
  tensor-parallel parameters).

``_NormPartial(norm_type)`` -- ``_NormP(2.0)`` (repr ``_NormPartial(2.0)``) -- is the partial
state of a p-norm: the global value is ``(sum_r x_r ** p) ** (1 / p)``; reductions produce it
so that ``clip_grad_norm_`` reduces once, at the end.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import torch

from ringlet.c10d.reduce_op import ReduceOp
from ringlet.dtensor import _shard_math

__all__ = ["Partial", "Placement", "Replicate", "Shard", "_NormPartial", "_StridedShard"]


class Placement:
    """Base class of ``Shard``, ``Replicate`` and ``Partial`` (torch's spelling)."""

    def is_shard(self, dim: int | None = None) -> bool:
        return False

    def is_replicate(self) -> bool:
        return False

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return False


@dataclasses.dataclass(frozen=True, repr=False)
class Shard(Placement):
    """Split tensor dim ``dim`` across the ranks of a mesh axis (``torch.chunk`` sizes).

    Example::

        Shard(0).shard_sizes(33, 2)        # [17, 16]
        Shard(1).local_chunk(t, 4, 3)      # t.chunk(4, 1)[3], or an empty slice
    """

    dim: int
    _applied_last: ClassVar[bool] = False      # see _StridedShard

    def __post_init__(self) -> None:
        if not isinstance(self.dim, int) or isinstance(self.dim, bool):
            raise TypeError(f"Shard: dim: expected an int, got {self.dim!r}")

    def __repr__(self) -> str:
        return f"Shard(dim={self.dim})"

    def __str__(self) -> str:
        return f"S({self.dim})"

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def shard_sizes(self, size: int, n: int) -> list[int]:
        """Sizes of the ``n`` shards of a dim of ``size`` elements."""
        return _shard_math.chunk_sizes(size, n)

    def local_chunk(self, t: torch.Tensor, n: int, coord: int) -> torch.Tensor:
        """The piece of ``t`` (whole along ``dim``) that the rank at ``coord`` of
        ``n`` holds (a view)."""
        size = t.shape[self.dim]
        return t.narrow(self.dim, _shard_math.chunk_offset(size, n, coord),
                        _shard_math.chunk_size(size, n, coord))


@dataclasses.dataclass(frozen=True, repr=False)
class _StridedShard(Shard):
    """A ``Shard(dim)`` applied *after* the shards of the later mesh axes on the same dim.

    Prints as ``_StridedShard(dim=0, sf=2)`` (``str``: ``_S(0, 2)``).  Plain shards nest in
    mesh-axis order (chunk of a chunk); a strided shard takes its chunk last, out of what the
    plain ones left.  fully_shard over a
    tensor-parallel parameter needs it: on mesh ``(dp, tp)`` with ``(_StridedShard(0, 2),
    Shard(0))`` the rank at ``(d, t)`` holds piece ``d`` of tp chunk ``t`` -- so an all-gather
    over dp gives back exactly the tensor-parallel shard -- where ``(Shard(0), Shard(0))``
    would hold piece ``t`` of dp chunk ``d``.  ``split_factor`` is the number of pieces the
    later axes cut the dim into (torch's name; the layout follows from the placements alone).

    Example::

        # 8 rows on a 2x2 (dp, tp) mesh: rank (d, t) holds rows 4*t + 2*d .. 4*t + 2*d + 2
        dt = distribute_tensor(w, mesh, [_StridedShard(0, split_factor=2), Shard(0)])
    """

    split_factor: int = 1
    _applied_last: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if (not isinstance(self.split_factor, int) or isinstance(self.split_factor, bool)
                or self.split_factor < 1):
            raise ValueError("_StridedShard: split_factor: expected a positive int, "
                             f"got {self.split_factor!r}")

    def __repr__(self) -> str:
        return f"_StridedShard(dim={self.dim}, sf={self.split_factor})"

    def __str__(self) -> str:
        return f"_S({self.dim}, {self.split_factor})"


@dataclasses.dataclass(frozen=True, repr=False)
class Replicate(Placement):
    """Every rank along the mesh axis holds the whole value."""

    def __repr__(self) -> str:
        return "Replicate()"

    def __str__(self) -> str:
        return "R"

    def is_replicate(self) -> bool:
        return True


_C10D_OPS: dict[str, Any] = {"sum": ReduceOp.SUM, "avg": ReduceOp.AVG, "max": ReduceOp.MAX,
                             "min": ReduceOp.MIN}


@dataclasses.dataclass(frozen=True, repr=False)
class Partial(Placement):
    """The global value is the reduction (``reduce_op``) of the ranks' tensors along the axis.

    Args:
        reduce_op: ``"sum"`` (default), ``"avg"``, ``"max"`` or ``"min"``.

    Raises:
        ValueError: for any other reduce op.
    """

    reduce_op: str = "sum"

    def __post_init__(self) -> None:
        if self.reduce_op not in _C10D_OPS and not isinstance(self, _NormPartial):
            raise ValueError("Partial: reduce_op: expected one of "
                             f"{sorted(_C10D_OPS)}, got {self.reduce_op!r}")

    def __repr__(self) -> str:
        return f"Partial({self.reduce_op})"

    def __str__(self) -> str:
        return f"P({self.reduce_op})"

    def is_partial(self, reduce_op: str | None = None) -> bool:
        return reduce_op is None or reduce_op == self.reduce_op

    @property
    def is_linear(self) -> bool:
        """Sum and average commute with linear maps (add, mul by a replicated
        value, matmul, views)."""
        return self.reduce_op in ("sum", "avg")

    # -- the reduction, split so the communication layer only runs one all_reduce ---------
    def c10d_op(self) -> Any:
        return _C10D_OPS[self.reduce_op]

    def before_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The tensor that goes into the all-reduce (bool max/min travel as uint8)."""
        return t.to(torch.uint8) if t.dtype == torch.bool else t

    def after_reduce(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return t.to(dtype) if t.dtype != dtype else t

    def partition(self, t: torch.Tensor, coord: int) -> torch.Tensor:
        """This rank's part of a replicated value ``t`` (Replicate -> Partial, no communication).

        ``sum``: the rank at coordinate 0 keeps the value and the others hold zeros (exact
        for integers too).  ``avg``, ``max`` and ``min`` of equal values are that value, so
        every rank keeps it.
        """
        if self.reduce_op == "sum" and coord != 0:
            return torch.zeros_like(t)
        return t


@dataclasses.dataclass(frozen=True, repr=False)
class _NormPartial(Partial):
    """Partial p-norm: the global value is ``(sum over ranks of x ** p) ** (1 / p)``.

    ``p = inf`` reduces with max, ``-inf`` with min, ``0`` (a count) with sum.
    """

    reduce_op: str = "norm"
    norm_type: float = 2.0

    def __repr__(self) -> str:
        return f"_NormPartial({self.norm_type})"

    def __str__(self) -> str:
        return f"_NormP({self.norm_type})"

    @property
    def is_linear(self) -> bool:
        return False

    def c10d_op(self) -> Any:
        if math.isinf(self.norm_type):
            return ReduceOp.MAX if self.norm_type > 0 else ReduceOp.MIN
        return ReduceOp.SUM

    def before_reduce(self, t: torch.Tensor) -> torch.Tensor:
        p = self.norm_type
        return t if math.isinf(p) or p in (0.0, 1.0) else t.pow(p)

    def after_reduce(self, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        p = self.norm_type
        return t if math.isinf(p) or p in (0.0, 1.0) else t.pow(1.0 / p)

    def partition(self, t: torch.Tensor, coord: int) -> torch.Tensor:
        # A norm is non-negative, so zeros are neutral for every p except -inf (a min).
        if coord != 0 and self.norm_type != -math.inf:
            return torch.zeros_like(t)
        return t
