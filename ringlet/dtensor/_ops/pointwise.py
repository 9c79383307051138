"""Elementwise ops (aten ops tagged ``pointwise``, copies, casts, fills, random fills) and
the ``_foreach_*`` multi-tensor ops that ``torch.optim`` uses with ``foreach=True``.

Placements follow ``_common.plan_pointwise``: the output takes the first
non-broadcast shard; Replicate operands chunk locally to match; Partial operands pass
through linear ops and are reduced before any other.  A ``_foreach_`` op is planned
element by element (the i-th tensor of every list together) and then runs once on
the lists of local tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.dtensor import _comm
from ringlet.dtensor._api import DTensor
from ringlet.dtensor._opcall import OpCall, broadcast_shapes
from ringlet.dtensor._ops._common import linearity, plan_pointwise
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Partial, Replicate

__all__ = ["amp_unscale_rule", "foreach_rule", "pointwise_rule"]

aten = torch.ops.aten


def _out_shape(call: OpCall) -> list[int]:
    return broadcast_shapes(*[x.shape for x in call.flat if isinstance(x, torch.Tensor)])


def pointwise_rule(call: OpCall) -> Plan:
    """Elementwise op with broadcasting (see the module docstring)."""
    written = call.written()
    inplace = min(written) if written else None
    operands = [(d.placements, tuple(d.shape)) for d in call.dts]
    shape = list(call.dts[inplace].shape) if inplace is not None else _out_shape(call)
    req, out = plan_pointwise(call.mesh, operands, shape, inplace, linearity(call),
                              first_partial_only=call.name == "div")
    return Plan([tuple(r) for r in req], tuple(out), shapes=tuple(shape))


# Only the presence of a number matters to these rules (``linearity``), not its value, except
# masked_fill's zero (see FLOAT_BLIND in ``_plan``; ``_decide`` leaves masked_fill out).
pointwise_rule.float_blind = True   # type: ignore[attr-defined]

register(aten.detach.default, aten.detach_.default, aten.alias.default, aten.clone.default,
         aten._to_copy.default, aten.copy_.default, aten.zero_.default, aten.lift_fresh.default,
         aten.lift_fresh_copy.default, aten.masked_fill, aten.masked_fill_, aten.normal_.default,
         aten.uniform_.default, aten.bernoulli_.float, aten.bernoulli_.Tensor,
         aten.exponential_.default, aten.random_, aten.native_dropout.default,
         aten.native_dropout_backward.default,
         aten.bernoulli.p, aten.bernoulli.default)(pointwise_rule)


_MATERIALIZE = {aten._conj.default: torch.conj_physical, aten._neg_view.default: torch.neg}


@register(aten._conj.default, aten._neg_view.default)
def lazy_view_rule(call: OpCall) -> Plan:
    """``_conj``/``_neg_view`` (what ``x.conj()`` and the conjugate in complex gradients call):
    elementwise, computed on the local tensor instead of flagged ([Note: lazy conjugate and
    negative] in ``_api``); a sum-Partial stays Partial (both maps are real-linear)."""
    plan = pointwise_rule(call)
    materialize = _MATERIALIZE[call.func]
    plan.local_fn = lambda func, args, kwargs: materialize(*args, **kwargs)
    return plan


register(aten.resolve_conj.default, aten.resolve_neg.default)(pointwise_rule)


@register(aten.fill_.Scalar, aten.fill_.Tensor)
def fill_rule(call: OpCall) -> Plan:
    """``fill_`` keeps self's placements; on a sum-Partial only coordinate 0 holds the value."""
    pls = call.dts[0].placements
    rep = (Replicate(),) * call.mesh.ndim
    inputs = [pls] + [rep] * (len(call.dts) - 1)          # a tensor fill value: Replicate
    coord = call.mesh.get_coordinate() or []

    def local_fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        out = func(*args, **kwargs)
        for axis, p in enumerate(pls):
            if isinstance(p, Partial):
                out.copy_(p.partition(out, coord[axis]))
        return out
    return Plan(inputs, pls, local_fn, tuple(call.dts[0].shape))


def foreach_rule(call: OpCall) -> Plan:
    """``_foreach_<op>``: plan element i of every list (plus shared tensor arguments) together."""
    lists = [k for k, a in enumerate(call.args) if isinstance(a, list | tuple) and a
             and isinstance(a[0], torch.Tensor)]
    if not lists:
        raise AssertionError(f"{call.func}: foreach op without a tensor list")
    shared: list[int | str] = [k for k, a in enumerate(call.args) if isinstance(a, DTensor)]
    shared += [key for key, v in call.kwargs.items() if isinstance(v, DTensor)]
    written = call.written()
    kind = linearity(call)
    req: dict[int, Placements] = {k: d.placements for k, d in enumerate(call.dts)}
    shared_req: dict[int, Placements] = {}
    outs: list[Placements] = []
    shapes: list[tuple[int, ...] | None] = []
    for i in range(len(call.args[lists[0]])):
        slots = [call.slots[k][i] for k in lists] + [call.slot(k) for k in shared]
        shared_args = [call.args[k] if isinstance(k, int) else call.kwargs[k] for k in shared]
        elems = [call.args[k][i] for k in lists] + shared_args
        operands = [(e.placements, tuple(e.shape)) if isinstance(e, DTensor) else (None, ())
                    for e in elems]
        elem_shapes = [tuple(e.shape) for e in elems if isinstance(e, torch.Tensor)]
        out_shape = broadcast_shapes(*elem_shapes)
        inplace = 0 if slots[0] is not None and slots[0] in written else None
        r, o = plan_pointwise(call.mesh, operands, out_shape, inplace, kind,
                              call.name.endswith("div"))
        for j, s in enumerate(slots):
            if s is None:
                continue
            # a tensor shared by every element must agree across elements
            if j >= len(lists) and shared_req.setdefault(s, tuple(r[j])) != tuple(r[j]):
                raise NotImplementedError(f"{call.func}: the shared tensor {call.dts[s]!r} would "
                                          "need different placements for different list elements")
            req[s] = tuple(r[j])
        outs.append(tuple(o))
        shapes.append(tuple(out_shape))
    return Plan([req[k] for k in range(len(call.dts))], outs, shapes=shapes)


foreach_rule.float_blind = True   # type: ignore[attr-defined]


@register(aten._amp_foreach_non_finite_check_and_unscale_.default)
def amp_unscale_rule(call: OpCall) -> Plan:
    """``GradScaler.unscale_`` on DTensor gradients (fully_shard, tensor parallelism).

    Each rank unscales its local pieces in place and sets ``found_inf`` (a plain 0-d tensor)
    from them; then the ranks agree: ``found_inf`` becomes its maximum over every mesh axis
    that some gradient is split on (Shard or Partial), so that every rank skips, or takes,
    the optimizer step together and the scaler's scale stays the same everywhere.  (An inf in
    one rank's shard is an inf of the whole gradient.)
    """
    axes = sorted({a for d in call.dts for a, p in enumerate(d.placements)
                   if not p.is_replicate()})
    mesh = call.mesh

    def local_fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        func(*args, **kwargs)
        found = args[1] if len(args) > 1 else kwargs["found_inf"]
        for axis in axes:
            found.copy_(_comm.all_reduce(found, mesh, axis, Partial("max")))
    return Plan([d.placements for d in call.dts], None, local_fn)
