"""Reduction arithmetic shared by every transport.

A transport combines contributions in rank order (0, 1, ..., n-1) so that every
rank computes bit-identical results, whatever the transport and whatever order
the bytes arrived in.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

import torch

__all__ = ["RedOpType", "check_op_dtype", "combine_", "finish_", "prepare_contribution"]


class RedOpType(enum.IntEnum):
    """Reduction operators, numbered like torch's ``ReduceOp.RedOpType``."""

    SUM = 0
    AVG = 1
    PRODUCT = 2
    MIN = 3
    MAX = 4
    BAND = 5
    BOR = 6
    BXOR = 7
    PREMUL_SUM = 8
    UNUSED = 9


_BITWISE = (RedOpType.BAND, RedOpType.BOR, RedOpType.BXOR)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_op_dtype(op: RedOpType, dtype: torch.dtype, opname: str) -> None:
    """Raise ``TypeError`` for an operator that makes no sense on ``dtype``."""
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{opname}: ReduceOp.{op.name} expects an integer or bool tensor, got {dtype}")
    if op in (RedOpType.MIN, RedOpType.MAX) and dtype.is_complex:
        raise TypeError(f"{opname}: ReduceOp.{op.name} is not defined for complex dtype {dtype}")
    if op == RedOpType.UNUSED:
        raise ValueError(f"{opname}: ReduceOp.UNUSED is not a reduction")


def prepare_contribution(src: torch.Tensor, dst: torch.Tensor, op: RedOpType, factor: float | None) -> None:
    """Write this rank's contribution of ``src`` into ``dst`` (PREMUL_SUM scales it first)."""
    if op == RedOpType.PREMUL_SUM:
        torch.mul(src, 1.0 if factor is None else factor, out=dst)
    else:
        dst.copy_(src)


def _pair(op: RedOpType, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    if op in (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM):
        if a.dtype == torch.bool:
            torch.logical_or(a, b, out=out)
        else:
            torch.add(a, b, out=out)
    elif op == RedOpType.PRODUCT:
        if a.dtype == torch.bool:
            torch.logical_and(a, b, out=out)
        else:
            torch.mul(a, b, out=out)
    elif op == RedOpType.MIN:
        torch.minimum(a, b, out=out)
    elif op == RedOpType.MAX:
        torch.maximum(a, b, out=out)
    elif op == RedOpType.BAND:
        torch.bitwise_and(a, b, out=out)
    elif op == RedOpType.BOR:
        torch.bitwise_or(a, b, out=out)
    elif op == RedOpType.BXOR:
        torch.bitwise_xor(a, b, out=out)
    else:
        raise AssertionError(f"unknown reduce op {op!r}")


def combine_(out: torch.Tensor, parts: Sequence[torch.Tensor], op: RedOpType) -> None:
    """``out = parts[0] (op) parts[1] (op) ...`` left to right; ``out`` may alias ``parts[0]``."""
    if len(parts) == 1:
        if out.data_ptr() != parts[0].data_ptr():
            out.copy_(parts[0])
        return
    _pair(op, parts[0], parts[1], out)
    for p in parts[2:]:
        _pair(op, out, p, out)


def finish_(out: torch.Tensor, op: RedOpType, world_size: int) -> None:
    """Post-processing after the combine: AVG divides by the number of contributions."""
    if op != RedOpType.AVG or world_size == 1:
        return
    if out.dtype.is_floating_point or out.dtype.is_complex:
        out.div_(world_size)
    elif out.dtype != torch.bool:
        out.copy_(torch.div(out, world_size, rounding_mode="trunc"))
