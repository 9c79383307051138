"""Reductions, decided once: what a reduce op means for one dtype, and the kernels that apply it.

[Note: reductions]
A collective's ``(op, factor)`` resolves -- once, in :func:`reduction` -- into a
:class:`Reduction` for its dtype and number of contributions:

- ``fold``: the pairwise operator, applied left to right in rank order
  (``((x0 op x1) op x2) op ...``) so that every rank and every transport computes the
  same bits; AVG and PREMUL_SUM fold with SUM, bool SUM/PRODUCT are logical or/and;
- ``pre``: a scale applied to each contribution before the fold (PREMUL_SUM's factor), or None;
- ``post``: a divisor applied to the folded result (AVG: the number of contributions), or 1.

Transports only move bytes and call the kernels: :meth:`Reduction.contribute` (this rank's
contribution, scaled), :meth:`Reduction.fold_` (combine in order, then the post-scale; torch),
:meth:`Reduction.np_fold` (the same on numpy views, for the small-message paths).  A
collective built from steps (the hierarchical transport: a local reduce-scatter, then a
reduction among hosts) passes each step a stage of the one reduction: :meth:`Reduction.partial`
(scale, fold, no divide) and :meth:`Reduction.completing` (fold, divide).

In-place folds: a fold reads contributions 0 and 1 before it first writes its output, so either
may *be* the output (:func:`reads_first`): a rank folds its own input in place instead of a
copy, which is the two-rank case of every transport.  A later contribution that is the output is
copied first.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

__all__ = ["NP_DTYPES", "RedOpType", "Reduction", "check_op_dtype", "reads_first", "reduction"]


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


def check_op_dtype(op: RedOpType, dtype: torch.dtype, opname: str) -> None:
    """Raise ``TypeError`` for an operator that makes no sense on ``dtype``."""
    if op in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{opname}: ReduceOp.{op.name} expects an integer or bool tensor, "
                        f"got {dtype}")
    if op == RedOpType.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"{opname}: ReduceOp.AVG expects a floating-point or complex tensor "
                        f"(an integer average would be truncated), got {dtype}; reduce with "
                        "ReduceOp.SUM and divide, or convert to a floating dtype first")
    if op in (RedOpType.MIN, RedOpType.MAX) and dtype.is_complex:
        raise TypeError(f"{opname}: ReduceOp.{op.name} is not defined for complex dtype {dtype}")
    if op == RedOpType.UNUSED:
        raise ValueError(f"{opname}: ReduceOp.UNUSED is not a reduction")


# The one operator table: each fold operator's torch kernel (bool: logical), its numpy ufunc.
_TORCH: dict[RedOpType, Callable[..., Any]] = {
    RedOpType.SUM: torch.add, RedOpType.PRODUCT: torch.mul, RedOpType.MIN: torch.minimum,
    RedOpType.MAX: torch.maximum, RedOpType.BAND: torch.bitwise_and,
    RedOpType.BOR: torch.bitwise_or, RedOpType.BXOR: torch.bitwise_xor,
}
_TORCH_BOOL = {RedOpType.SUM: torch.logical_or, RedOpType.PRODUCT: torch.logical_and}
_NUMPY: dict[RedOpType, np.ufunc] = {
    RedOpType.SUM: np.add, RedOpType.PRODUCT: np.multiply, RedOpType.MIN: np.minimum,
    RedOpType.MAX: np.maximum, RedOpType.BAND: np.bitwise_and, RedOpType.BOR: np.bitwise_or,
    RedOpType.BXOR: np.bitwise_xor,
}
NP_DTYPES: dict[torch.dtype, type] = {   # dtypes the numpy kernel serves (numpy has no bfloat16)
    torch.float32: np.float32, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8,
    torch.bool: np.bool_,
}

# torch has no add/minimum/maximum kernels for uint16/32/64: those dtypes fold on a signed view
# of the same width.  Addition and multiplication modulo 2**bits give the same bits signed or
# unsigned (as do the bitwise ops); for MIN/MAX, flipping the sign bit maps unsigned order onto
# signed order.
_SIGNED_VIEW = {torch.uint16: torch.int16, torch.uint32: torch.int32, torch.uint64: torch.int64}


def _on_signed_view(pair: Callable[..., Any], signed: torch.dtype,
                    flip: bool) -> Callable[..., Any]:
    """``pair`` of an unsigned dtype, run on signed views of its operands (see above)."""
    sign = torch.iinfo(signed).min

    def fold(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        a, b, o = a.view(signed), b.view(signed), out.view(signed)
        if not flip:
            pair(a, b, out=o)
            return out
        pair(torch.bitwise_xor(a, sign), torch.bitwise_xor(b, sign), out=o)
        o.bitwise_xor_(sign)
        return out

    return fold


try:   # numpy's own errstate costs ~3 us a call; setting its context variable directly ~0.2 us
    from numpy._core.umath import _extobj_contextvar, _make_extobj

    # bound C callables, no Python frame: np_fold runs on every small reduction
    _quiet: Callable[[], Any] = functools.partial(_extobj_contextvar.set,
                                                  _make_extobj(all="ignore"))
    _loud: Callable[[Any], object] = _extobj_contextvar.reset
except ImportError:  # pragma: no cover - other numpy versions
    def _errstate_enter() -> np.errstate:
        state = np.errstate(all="ignore")
        state.__enter__()
        return state

    def _errstate_exit(state: np.errstate) -> None:
        state.__exit__(None, None, None)

    _quiet, _loud = _errstate_enter, _errstate_exit


def reads_first(index: int) -> bool:
    """Whether a fold reads contribution ``index`` before it first writes its output (see the
    module docstring): contributions 0 and 1 may be the output itself, later ones may not."""
    return index < 2


class Reduction:
    """One reduce op resolved for one dtype (see [Note: reductions]); immutable, shared.

    Built by :func:`reduction`.  A plain ``__slots__`` class: it is looked up on every call.
    """

    __slots__ = ("dtype", "fold", "op", "pair", "post", "pre", "ufunc")

    def __init__(self, op: RedOpType, fold: RedOpType, dtype: torch.dtype, pre: float | None,
                 post: int) -> None:
        self.op = op                # what the caller asked for (messages)
        self.fold = fold            # the pairwise operator
        self.dtype = dtype
        self.pre = pre              # each contribution times this first, or None
        self.post = post            # the folded result divided by this (1: not at all)
        pair = (_TORCH_BOOL.get(fold) if dtype == torch.bool else None) or _TORCH.get(fold)
        if pair is None:
            raise AssertionError(f"unknown reduce op {op!r}")
        if dtype in _SIGNED_VIEW:
            pair = _on_signed_view(pair, _SIGNED_VIEW[dtype],
                                   fold in (RedOpType.MIN, RedOpType.MAX))
        self.pair: Callable[..., Any] = pair
        # The numpy kernel serves exact contributions of numpy's dtypes; AVG on floats only.
        numpy_ok = dtype in NP_DTYPES and pre is None and (post == 1 or dtype.is_floating_point)
        self.ufunc = _NUMPY[fold] if numpy_ok else None

    def __repr__(self) -> str:
        return (f"Reduction({self.op.name} on {self.dtype}: fold {self.fold.name}, pre {self.pre}, "
                f"post /{self.post})")

    @property
    def exact(self) -> bool:
        """Whether each contribution is the input itself (no pre-scale)."""
        return self.pre is None

    # -- stages of a reduction built from several steps ---------------------------------------
    def partial(self) -> Reduction:
        """Scale and fold, without the final divide: a step whose result is combined further."""
        return self if self.post == 1 else _stage(self, self.pre, 1)

    def completing(self) -> Reduction:
        """Fold already-scaled partial results and divide: the last step of a composition."""
        return self if self.pre is None else _stage(self, None, self.post)

    # -- kernels --------------------------------------------------------------------------------
    def contribute(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Write this rank's contribution of ``src`` into ``dst`` (``dst`` may be ``src``)."""
        if self.pre is not None:
            torch.mul(src, self.pre, out=dst)
        elif dst is not src:
            dst.copy_(src)

    def contribution(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's contribution: ``t`` itself, or a scaled copy."""
        if self.pre is None:
            return t
        out = torch.empty_like(t)
        torch.mul(t, self.pre, out=out)
        return out

    def combine_(self, out: torch.Tensor, parts: Sequence[torch.Tensor]) -> None:
        """``out = parts[0] op parts[1] op ...`` left to right, no post-scale; ``out`` may be any
        part (one after the first two is copied first: see :func:`reads_first`)."""
        if len(parts) == 1:
            if out.data_ptr() != parts[0].data_ptr():
                out.copy_(parts[0])
            return
        if len(parts) > 2:
            ptr = out.data_ptr()
            if any(parts[k].data_ptr() == ptr for k in range(2, len(parts))):
                parts = [p.clone() if not reads_first(k) and p.data_ptr() == ptr else p
                         for k, p in enumerate(parts)]
        pair = self.pair
        pair(parts[0], parts[1], out=out)
        for k in range(2, len(parts)):
            pair(out, parts[k], out=out)

    def finish_(self, out: torch.Tensor) -> None:
        """The post-scale: AVG divides by the number of contributions (integers truncate)."""
        post = self.post
        if post == 1:
            return
        if out.dtype.is_floating_point or out.dtype.is_complex:
            out.div_(post)
        else:
            out.copy_(torch.div(out, post, rounding_mode="trunc"))

    def fold_(self, out: torch.Tensor, parts: Sequence[torch.Tensor],
              groups: Sequence[Sequence[int]] | None = None) -> None:
        """``out`` = ``parts`` folded in order, then post-scaled.  ``groups`` (indices into
        ``parts``) folds each group first and then the groups' results, in order: the host-major
        order of a group that spans hosts ([Note: tcp reduction order])."""
        if groups is not None:
            partials = []
            for g in groups:       # every part is read before out (maybe one of them) is written
                acc = torch.empty_like(out)
                self.combine_(acc, [parts[i] for i in g])
                partials.append(acc)
            parts = partials
        self.combine_(out, parts)
        self.finish_(out)

    def np_fold(self, out: np.ndarray, parts: Sequence[np.ndarray]) -> None:
        """:meth:`fold_` on numpy arrays (``ufunc`` is not None): the small-message kernel, where
        numpy's ~1 us per call beats torch's 3-6 us (measured on a 2-core machine)."""
        ufunc = self.ufunc
        if ufunc is None:
            raise AssertionError(f"{self!r} has no numpy kernel")
        token = _quiet()    # overflow to inf is a result, as in torch, not a warning
        try:
            ufunc(parts[0], parts[1], out=out)
            if len(parts) > 2:
                for part in parts[2:]:
                    ufunc(out, part, out=out)
            if self.post != 1:
                np.divide(out, self.post, out=out)
        finally:
            _loud(token)


@functools.lru_cache(maxsize=256)
def _stage(red: Reduction, pre: float | None, post: int) -> Reduction:
    return Reduction(red.op, red.fold, red.dtype, pre, post)


@functools.lru_cache(maxsize=1024)
def _resolve(op: RedOpType, factor: float | None, dtype: torch.dtype, n: int) -> Reduction:
    if op in (RedOpType.AVG, RedOpType.PREMUL_SUM):
        fold = RedOpType.SUM
    else:
        fold = RedOpType(op)
    pre = (1.0 if factor is None else factor) if op == RedOpType.PREMUL_SUM else None
    if pre is not None and type(pre) in (float, int) and pre == 1:
        pre = None          # x * 1.0 == x exactly: spare the pass (a one-rank DDP's 1/world)
    post = n if op == RedOpType.AVG and n > 1 and dtype != torch.bool else 1
    return Reduction(RedOpType(op), fold, dtype, pre, post)


def reduction(op: RedOpType | Reduction, factor: float | None, dtype: torch.dtype,
              n: int) -> Reduction:
    """The :class:`Reduction` of ``op`` (with PREMUL_SUM's ``factor``) on ``dtype`` over ``n``
    contributions; a :class:`Reduction` given as ``op`` (a stage of a composed collective) is
    returned as it is.

    Example::

        >>> red = reduction(RedOpType.AVG, None, torch.float32, 4)
        >>> red.fold.name, red.pre, red.post
        ('SUM', None, 4)
    """
    if type(op) is Reduction:
        return op
    return _resolve(op, factor, dtype, n)
