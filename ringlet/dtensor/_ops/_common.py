"""Building blocks of sharding rules: strategy choice by cost, broadcasting, the pointwise planner.

[Note: strategy choice]
A rule with several valid layouts (``mm``: S(0)xR->S(0), RxS(1)->S(1), S(1)xS(0)->P,
...) lists them per mesh axis as tuples (one placement per operand, then the output),
and :func:`choose` takes, on each axis independently, the one whose input moves cost
least: nothing for an operand already in place or Replicate (it can chunk or partition
locally), the moved elements for a gather, reduce-scatter or all-to-all, twice that for
an all-reduce.  Ties go to the earlier strategy, so rules list their preferred layout
first.  Axes are independent because a shard on one axis and a shard on another of the
same dim nest (chunk of a chunk) identically in every operand.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from numbers import Number
from typing import Any

import torch

from ringlet.dtensor._api import DTensor
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard
from ringlet.mesh import DeviceMesh

__all__ = ["Operand", "broadcast_req", "choose", "linearity", "move_cost", "plan_pointwise", "rep"]

R = Replicate()
# (placements or None for a non-DTensor, global shape)
Operand = tuple[Placements | None, Sequence[int]]


def rep(mesh: DeviceMesh) -> Placements:
    return (R,) * mesh.ndim


def move_cost(cur: Placement, want: Placement, numel: int) -> float:
    """Elements moved to turn ``cur`` into ``want`` on one axis (see [Note: strategy choice])."""
    if cur == want or isinstance(cur, Replicate):
        return 0.0
    if isinstance(cur, Partial) and isinstance(want, Replicate | Partial):
        return 2.0 * numel + 1
    return float(numel) + 1


def choose(mesh: DeviceMesh, operands: Sequence[Operand],
           strategies: Sequence[tuple[Placement, ...]],
           ) -> tuple[list[list[Placement]], list[Placement]]:
    """Pick a strategy per mesh axis; returns (required placements per operand, output placements).

    Each strategy is ``(operand 0, ..., operand n-1, output)``; ``None`` operands are skipped.
    """
    req: list[list[Placement]] = [list(pls) if pls is not None else [R] * mesh.ndim
                                  for pls, _ in operands]
    out: list[Placement] = []
    for axis in range(mesh.ndim):
        best, best_cost = strategies[0], math.inf
        for s in strategies:
            c = sum(move_cost(pls[axis], s[k], math.prod(shape))
                    for k, (pls, shape) in enumerate(operands) if pls is not None)
            if c < best_cost:
                best, best_cost = s, c
        for k in range(len(operands)):
            req[k][axis] = best[k]
        out.append(best[-1])
    return req, out


def broadcast_req(out_pl: Placement, shape: Sequence[int], out_shape: Sequence[int]) -> Placement:
    """What an operand of ``shape`` broadcast to ``out_shape`` must be for an
    output placed ``out_pl``."""
    if isinstance(out_pl, Shard):
        d = out_pl.dim - (len(out_shape) - len(shape))
        if d >= 0 and shape[d] == out_shape[out_pl.dim]:
            return dataclasses.replace(out_pl, dim=d)   # keeps a _StridedShard strided
        return R
    return out_pl


def linearity(call: OpCall) -> str:
    """How Partial inputs may pass through a pointwise op (see ``plan_pointwise``).

    ``copy``: any Partial (clone, casts, zero_); ``unary``: a sum/avg Partial (neg, x * 2.0);
    ``add``: every tensor operand shares one sum/avg Partial (add, sub, lerp);
    ``mul``: one sum/avg Partial operand, the others Replicate (mul; div's numerator;
    ``masked_fill`` with 0);
    ``none``: Partial operands are reduced first.
    """
    name = call.name.removeprefix("_foreach_")
    if name in _COPY:
        return "copy"
    tensors = sum(1 for x in call.args if _is_tensorish(x))
    if name in _UNARY_LINEAR or (name in ("mul", "div") and tensors == 1):
        return "unary"
    if name in ("add", "sub", "lerp"):
        bound = call.bound()
        constants = [k for k, v in bound.items()
                     if k not in ("alpha", "weight", "self") and _numbers(v)]
        return "none" if constants or any(_plain_scalar(x) for x in call.args) else "add"
    if name in ("mul", "div"):
        return "mul"
    if name == "masked_fill" and _is_zero(call.bound().get("value")):
        return "mul"          # zeroing entries of every partial keeps their sum: a product with 0/1
    return "none"


def _is_zero(v: Any) -> bool:
    # A Python number only: it is part of the dispatch cache key, a tensor's value is not.
    return isinstance(v, int | float) and not isinstance(v, bool) and v == 0


_COPY = {"clone", "detach", "alias", "_to_copy", "copy", "zero", "lift_fresh", "contiguous",
         "resolve_conj", "resolve_neg"}
# (real-)linear maps of one operand: a sum of partials maps to the sum of the images
_UNARY_LINEAR = {"neg", "positive", "_conj", "conj_physical", "_neg_view"}


def _is_tensorish(x: Any) -> bool:
    return isinstance(x, torch.Tensor) or (isinstance(x, list | tuple) and bool(x)
                                           and isinstance(x[0], torch.Tensor))


def _numbers(v: Any) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, Number):
        return True
    return isinstance(v, list | tuple) and bool(v) and all(isinstance(x, Number) for x in v)


def _plain_scalar(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, DTensor)


def plan_pointwise(mesh: DeviceMesh, operands: Sequence[Operand], out_shape: Sequence[int],
                   inplace: int | None, kind: str,
                   first_partial_only: bool = False) -> tuple[list[list[Placement]],
                                                              list[Placement]]:
    """Placements for an elementwise op with broadcasting; returns (required per operand, output).

    Per axis the output follows ``inplace``'s placement when the op writes an operand, else
    the first operand sharded on a dim that is not broadcast, else a Partial that ``kind``
    (see :func:`linearity`) lets through, else Replicate.  ``first_partial_only``: only
    operand 0 may stay Partial under ``mul`` (division's numerator).
    """
    req: list[list[Placement]] = [list(p) if p is not None else [R] * mesh.ndim
                                  for p, _ in operands]
    out: list[Placement] = []
    nd = len(out_shape)
    for axis in range(mesh.ndim):
        target = _target(operands, axis, nd, out_shape, inplace, kind, first_partial_only)
        keeper = -1
        for k, (pls, shape) in enumerate(operands):
            if pls is None:
                continue
            if isinstance(target, Partial) and kind == "mul":
                keep = keeper < 0 and pls[axis] == target and (k == 0 or not first_partial_only)
                if inplace is not None:
                    keep = k == inplace
                keeper = k if keep else keeper
                req[k][axis] = target if keep else R
            else:
                req[k][axis] = broadcast_req(target, shape, out_shape)
        out.append(target)
    return req, out


def _target(operands: Sequence[Operand], axis: int, nd: int, out_shape: Sequence[int],
            inplace: int | None, kind: str, first_partial_only: bool) -> Placement:
    if inplace is not None:
        pls, shape = operands[inplace]
        if pls is None:
            raise AssertionError("in-place operand without placements")
        p = pls[axis]
        if isinstance(p, Partial) and not _passes(p, kind, inplace, first_partial_only):
            return R      # the op cannot keep a Partial; dispatch refuses to move a written operand
        return dataclasses.replace(p, dim=p.dim + nd - len(shape)) if isinstance(p, Shard) else p
    partial: Placement | None = None
    for k, (pls, shape) in enumerate(operands):
        if pls is None:
            continue
        p = pls[axis]
        if isinstance(p, Shard):
            od = p.dim + nd - len(shape)
            if shape[p.dim] == out_shape[od]:
                return dataclasses.replace(p, dim=od)
        elif isinstance(p, Partial) and partial is None and _passes(p, kind, k, first_partial_only):
            partial = p
    if partial is not None and kind in ("add",) and any(
            pls is not None and isinstance(pls[axis], Partial) and pls[axis] != partial
            for pls, _ in operands):
        return R
    return partial if partial is not None else R


def _passes(p: Partial, kind: str, k: int, first_partial_only: bool) -> bool:
    if kind == "copy":
        return True
    if kind in ("unary", "add"):
        return p.is_linear
    if kind == "mul":
        return p.is_linear and (k == 0 or not first_partial_only)
    return False
