"""``ReduceOp``: torch's reduction-operator API over ringlet's :class:`RedOpType`."""

from __future__ import annotations

from typing import Any

import torch

from ringlet.transport.reduce import RedOpType
from ringlet.transport.reduce import RedOpType as _RedOpType

__all__ = ["ReduceOp", "_make_nccl_premul_sum", "check_complex", "reduce_op", "resolve_op"]


class ReduceOp:
    """Reduction operators for ``all_reduce``, ``reduce`` and ``reduce_scatter``.

    Use the class attributes like torch's: ``ReduceOp.SUM``, ``ReduceOp.AVG``,
    ``ReduceOp.PRODUCT``, ``ReduceOp.MIN``, ``ReduceOp.MAX``, ``ReduceOp.BAND``,
    ``ReduceOp.BOR``, ``ReduceOp.BXOR``; ``PREMUL_SUM`` needs a factor, made with
    :func:`_make_nccl_premul_sum` (each contribution is multiplied before the sum).

    Example::

        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    """

    RedOpType = RedOpType
    SUM = RedOpType.SUM
    AVG = RedOpType.AVG
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX
    BAND = RedOpType.BAND
    BOR = RedOpType.BOR
    BXOR = RedOpType.BXOR
    PREMUL_SUM = RedOpType.PREMUL_SUM
    UNUSED = RedOpType.UNUSED

    def __init__(self, op: _RedOpType | int = _RedOpType.SUM, factor: float | None = None) -> None:
        self.op = _RedOpType(op)
        self.factor = factor

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ReduceOp):
            return (self.op, self.factor) == (other.op, other.factor)
        if isinstance(other, int):
            return self.factor is None and int(self.op) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash((self.op, self.factor))

    def __repr__(self) -> str:
        if self.op == RedOpType.PREMUL_SUM:
            return f"ReduceOp.PREMUL_SUM({self.factor})"
        return f"ReduceOp.{self.op.name}"


class reduce_op:
    """Deprecated alias kept for old scripts: use :class:`ReduceOp`."""

    SUM = RedOpType.SUM
    PRODUCT = RedOpType.PRODUCT
    MIN = RedOpType.MIN
    MAX = RedOpType.MAX


def _make_nccl_premul_sum(factor: float | torch.Tensor) -> ReduceOp:
    """A ``PREMUL_SUM`` operator: each rank's contribution is multiplied by
    ``factor``, then summed."""
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise ValueError("premul_sum factor: expected a scalar, got a tensor of "
                             f"shape {tuple(factor.shape)}")
        factor = factor.item()
    return ReduceOp(RedOpType.PREMUL_SUM, float(factor))


def resolve_op(op: Any, opname: str) -> tuple[RedOpType, float | None]:
    """Normalise what a user may pass as ``op`` into (RedOpType, factor)."""
    if type(op) is RedOpType and op != RedOpType.PREMUL_SUM:   # the common case, first
        return op, None
    if isinstance(op, ReduceOp):
        if op.op == RedOpType.PREMUL_SUM and op.factor is None:
            raise ValueError(f"{opname}: PREMUL_SUM needs a factor; use "
                             "_make_nccl_premul_sum(factor)")
        return op.op, op.factor
    if isinstance(op, int) and not isinstance(op, bool):   # RedOpType is an IntEnum; True is no op
        try:
            red = RedOpType(int(op))
        except ValueError:
            raise ValueError(f"{opname}: expected a ReduceOp, got {op!r}") from None
        if red == RedOpType.PREMUL_SUM:
            raise ValueError(f"{opname}: PREMUL_SUM needs a factor; use "
                             "_make_nccl_premul_sum(factor)")
        return red, None
    raise TypeError(f"{opname}: expected a ReduceOp, got {type(op).__name__} {op!r}")


_COMPLEX_OPS = (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM)


def check_complex(red: RedOpType, dtype: torch.dtype, opname: str) -> None:
    """Refuse an order-based or bitwise reduction of complex tensors with torch's error
    (``ValueError: all_reduce does not support ReduceOp.MAX on complex tensors``)."""
    if dtype.is_complex and red not in _COMPLEX_OPS:
        raise ValueError(f"all_reduce does not support ReduceOp.{red.name} on complex tensors "
                         f"({opname}: dtype {str(dtype).removeprefix('torch.')}); expected "
                         "ReduceOp.SUM, AVG or PREMUL_SUM")
