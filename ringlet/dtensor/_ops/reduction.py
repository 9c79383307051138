"""Reductions: a reduction over a sharded dim gives a Partial result, reduced only when needed.

``sum``/``mean`` over a sharded dim -> ``P(sum)`` (the mean divides the local sum by the
*global* count, so uneven shards stay exact); ``amax``/``max`` -> ``P(max)``,
``amin``/``min`` -> ``P(min)``; p-norms -> ``P(normp)`` (``_NormPartial``), so
``clip_grad_norm_`` over sharded gradients stacks per-parameter partial norms and
reduces the total once.  A Partial input passes through a reduction of its own kind
(sum of sums, max of maxes, norm of norms); other reductions over a sharded dim
(``prod``, ``var``, ``argmax``, ``max(dim)`` with indices) gather that dim first.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard, _NormPartial

__all__ = ["foreach_reduction_rule", "reduction_rule"]

aten = torch.ops.aten
R = Replicate()

_KIND = {"sum": "sum", "nansum": "sum", "mean": "mean", "amax": "max", "amin": "min", "max": "max",
         "min": "min", "linalg_vector_norm": "norm", "norm": "norm", "any": "max", "all": "min"}


def _dims(call: OpCall, ndim: int) -> list[int]:
    dim = call.bound().get("dim")
    if dim is None or (isinstance(dim, list | tuple) and len(dim) == 0):
        return list(range(ndim))
    dims = [dim] if isinstance(dim, int) else list(dim)
    return sorted({d % max(ndim, 1) for d in dims}) if ndim else []


def _norm_type(bound: dict[str, Any]) -> float:
    p = bound.get("ord", bound.get("p"))
    if p is None:
        return 2                    # torch's default order, printed as torch prints it
    return p if type(p) is int else float(p)      # the number as given: _NormPartial(2) or (2.0)


def _partial_for(kind: str | None, norm_type: float) -> Partial | None:
    if kind in ("sum", "mean"):
        return Partial("sum")
    if kind in ("max", "min"):
        return Partial(kind)
    if kind == "norm":
        return _NormPartial(norm_type=norm_type)
    return None


def _passes(p: Partial, target: Partial | None) -> bool:
    """May a Partial input stay Partial through this reduction?  (sum of sums, max of maxes...)"""
    if target is None:
        return False
    if isinstance(target, _NormPartial):
        return p == target
    if target.reduce_op == "sum":
        return p.is_linear
    return p == target


def reduce_placements(pls: Placements, reduced: list[int], keepdim: bool,
                      target: Partial | None) -> tuple[list[Placement], list[Placement]]:
    """(required input placements, output placements) of a reduction over dims ``reduced``."""
    req: list[Placement] = []
    out: list[Placement] = []
    for p in pls:
        if isinstance(p, Shard) and p.dim in reduced:
            if target is None:
                req.append(R)
                out.append(R)
            else:
                req.append(p)
                out.append(target)
        elif isinstance(p, Shard):
            shift = 0 if keepdim else sum(1 for d in reduced if d < p.dim)
            req.append(p)
            out.append(Shard(p.dim - shift))
        elif isinstance(p, Partial) and _passes(p, target):
            req.append(p)
            out.append(p)
        else:
            req.append(R)
            out.append(R)
    return req, out


def reduced_shape(shape: Any, reduced: list[int], keepdim: bool) -> tuple[int, ...]:
    """Global shape after reducing ``reduced`` (kept as size 1 with ``keepdim``)."""
    if keepdim:
        return tuple(1 if d in reduced else s for d, s in enumerate(shape))
    return tuple(s for d, s in enumerate(shape) if d not in reduced)


def _fill_empty(kind: str | None, func: Any, local: torch.Tensor, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
    """max/min of an empty shard: the identity of the reduction (torch refuses empty max)."""
    m = func(torch.empty_strided(local.shape, local.stride(), dtype=local.dtype, device="meta"),
             *args[1:], **kwargs)
    if local.dtype.is_floating_point:
        value: Any = -math.inf if kind == "max" else math.inf
    elif local.dtype == torch.bool:
        value = kind != "max"
    else:
        info = torch.iinfo(local.dtype)
        value = info.min if kind == "max" else info.max
    return torch.full(m.shape, value, dtype=m.dtype, device=local.device)


@register(aten.sum.default, aten.sum.dim_IntList, aten.nansum.default, aten.mean.default,
          aten.mean.dim, aten.amax.default, aten.amin.default, aten.max.default, aten.min.default,
          aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
          aten.any.default, aten.any.dim, aten.any.dims, aten.all.default, aten.all.dim,
          aten.all.dims,
          aten.prod.default, aten.prod.dim_int, aten.var.correction, aten.std.correction,
          aten.argmax.default,
          aten.argmin.default, aten.max.dim, aten.min.dim, aten.logsumexp.default)
def reduction_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    name = call.name
    kind = None if call.func in (aten.max.dim, aten.min.dim) else _KIND.get(name)
    bound = call.bound()
    norm_type = _norm_type(bound) if kind == "norm" else 2.0
    reduced = _dims(call, x.dim())
    keepdim = bool(bound.get("keepdim", False))
    req, out = reduce_placements(x.placements, reduced, keepdim, _partial_for(kind, norm_type))
    inputs = [tuple(req)] + [d.placements for d in call.dts[1:]]
    shape = reduced_shape(x.shape, reduced, keepdim)
    if kind == "mean":
        count = math.prod(x.shape[d] for d in reduced)
        dtype = bound.get("dtype")

        def mean_fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            local = args[0]
            s = torch.sum(local, dim=reduced, keepdim=keepdim, dtype=dtype)
            return s / count if count else s * math.nan
        return Plan(inputs, tuple(out), mean_fn, shape)
    if kind in ("max", "min"):
        def maxmin_fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            if args[0].numel() == 0:
                return _fill_empty(kind, func, args[0], args, kwargs)
            return func(*args, **kwargs)
        return Plan(inputs, tuple(out), maxmin_fn, shape)
    return Plan(inputs, tuple(out), shapes=shape)


def foreach_reduction_rule(call: OpCall) -> Plan:
    """``_foreach_norm`` (-> ``P(normp)`` per sharded tensor) and
    ``_foreach_max`` (-> ``P(max)``)."""
    name = call.name.removeprefix("_foreach_")
    kind = "norm" if name == "norm" else "max"
    bound = call.bound()
    norm_type = _norm_type(bound)
    target = _partial_for(kind, norm_type)
    req: list[Placements] = []
    outs: list[Placements] = []
    for x in call.args[0]:
        r, o = reduce_placements(x.placements, list(range(x.dim())), False, target)
        req.append(tuple(r))
        outs.append(tuple(o))
    shapes: list[tuple[int, ...] | None] = [() for _ in outs]
    if kind == "norm":
        return Plan(req, outs, shapes=shapes)

    def max_fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        return [torch.amax(t) if t.numel() else _fill_empty("max", aten.amax.default, t, (t,), {})
                for t in args[0]]
    return Plan(req, outs, max_fn, shapes)
