"""``__torch_dispatch__`` for DTensor: find the op's sharding rule, move inputs, run locally, wrap.

[Note: DTensor dispatch]
Every aten op on a DTensor arrives here below autograd.  The steps:

1. Collect the DTensor arguments (one mesh for all of them).  A plain tensor mixed
   in is an error, except a 0-d tensor (a scalar, used as is), the source of
   ``copy_`` (a full value, treated as Replicate) and anything inside
   ``implicit_replication()`` (treated as Replicate).
2. Ask the op's rule (``_ops``) for a :class:`Plan`: the placements each DTensor
   argument must have, the placements of each output, and optionally a local
   function that replaces ``func`` on the local tensors.  No rule and every argument
   Replicate: the op runs on the local tensors and its outputs are Replicate.
   No rule otherwise: ``NotImplementedError`` naming the op and the placements --
   never a silent all-gather.
3. Redistribute arguments whose placements differ.  An argument the op writes
   (``add_``'s self, ``out=``) must already be in place: moving it would write a copy.
4. Run on the local tensors.  Global output shapes come from the rule when it knows
   them (most do), else from running the op on meta tensors of the global shapes.
5. Wrap outputs as DTensors; ops that mutate return their original DTensor argument.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._api import DTensor
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._redistribute import redistribute_local
from ringlet.dtensor._spec import DTensorSpec, Placements
from ringlet.dtensor.placements import Replicate

__all__ = ["RULES", "OpCall", "Plan", "dispatch", "register"]

aten = torch.ops.aten
Rule = Callable[["OpCall"], "Plan"]
RULES: dict[Any, Rule] = {}
LocalFn = Callable[[Any, tuple[Any, ...], dict[str, Any]], Any]


def register(*ops: Any) -> Callable[[Rule], Rule]:
    """Register a sharding rule for aten overloads or whole overload packets."""
    def deco(rule: Rule) -> Rule:
        for op in ops:
            RULES[op] = rule
        return rule
    return deco


@dataclasses.dataclass
class Plan:
    """A rule's answer (see [Note: DTensor dispatch]).

    ``inputs[k]``: placements DTensor argument ``k`` (``OpCall.dts`` order) must have.
    ``outputs``: placements of every tensor output (one tuple for all, or a list with
    one entry per tensor in the output's flattened order); ``None``: the local result
    is returned as is (a Python value).
    """

    inputs: list[Placements]
    outputs: Placements | list[Placements] | None
    local_fn: LocalFn | None = None
    # Global output shapes when the rule knows them (one for all outputs, or one per output
    # leaf); ``"local"``: every output is Replicate, so the local shape is the global one;
    # None: run the op on meta tensors.  Elementwise ops, cat, addmm, layer norm... must say:
    # their meta kernels are Python references whose first use imports torch._dynamo (seconds).
    shapes: tuple[int, ...] | list[tuple[int, ...] | None] | str | None = None


def unsupported(call: OpCall, why: str = "") -> NotImplementedError:
    extra = f" ({why})" if why else ""
    return NotImplementedError(
        f"{call.func}: no DTensor sharding rule for {call.describe()} on {call.mesh!r}{extra}; ops without a "
        "rule run only when every DTensor argument is Replicate: redistribute first (e.g. "
        ".redistribute(mesh, [Replicate()]) or .full_tensor())")


def replicate_rule(call: OpCall) -> Plan:
    """Any op whose DTensor arguments are all Replicate: run it locally, outputs Replicate."""
    rep = (Replicate(),) * call.mesh.ndim
    return Plan([rep] * len(call.dts), rep, shapes="local")


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``DTensor.__torch_dispatch__`` (see [Note: DTensor dispatch])."""
    call = OpCall(func, args, kwargs)
    rule = RULES.get(func) or RULES.get(func.overloadpacket) or _family_rule(func)
    if rule is None:
        if all(all(p.is_replicate() for p in d.placements) for d in call.dts):
            rule = replicate_rule
        else:
            raise unsupported(call)
    plan = rule(call)
    written = call.written_positions()
    flat = list(call.flat)
    for k, (pos, d) in enumerate(zip(call.positions, call.dts)):
        want = plan.inputs[k]
        local = d._local_tensor
        if want != d.placements:
            if pos in written:
                raise RuntimeError(f"{func}: the op writes {d!r} in place but its rule needs it as "
                                   f"{''.join(map(repr, want))}; redistribute it first")
            local = redistribute_local(local, call.mesh, d.placements, want, d._spec.shape)
        flat[pos] = local
    largs, lkwargs = call.rebuild(flat)
    out = plan.local_fn(func, largs, lkwargs) if plan.local_fn is not None else func(*largs, **lkwargs)
    if plan.outputs is None:
        return out
    if written and _returns_written(func):
        return _written_results(call)
    return _wrap(call, out, plan)


def _family_rule(func: Any) -> Rule | None:
    from ringlet.dtensor._ops import family_rule

    return family_rule(func)


def _returns_written(func: Any) -> bool:
    rets = func._schema.returns
    return not rets or all(r.alias_info is not None and r.alias_info.is_write for r in rets)


def _written_results(call: OpCall) -> Any:
    rets = call.func._schema.returns
    if not rets:
        return None
    bound = call.bound()
    by_set = {}
    for a in call.func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            by_set[frozenset(a.alias_info.before_set)] = bound.get(a.name)
    out = [by_set.get(frozenset(r.alias_info.before_set)) for r in rets]
    return out[0] if len(out) == 1 else tuple(out)


def _leaves(out: Any) -> list[Any]:
    return list(out) if isinstance(out, list | tuple) else [out]


def _wrap(call: OpCall, out: Any, plan: Plan) -> Any:
    """Local results -> DTensors; list ``outputs``/``shapes`` have one entry per output leaf."""
    leaves = _leaves(out)
    outputs, shapes = plan.outputs, plan.shapes
    if outputs is None:  # pragma: no cover - dispatch returns raw results before wrapping
        raise AssertionError("no output placements")
    metas = _leaves(call.meta()) if shapes is None else None
    if isinstance(outputs, list) and len(outputs) != len(leaves):
        raise AssertionError(f"{call.func}: rule gave {len(outputs)} output placements for {len(leaves)} outputs")
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        pls = outputs if isinstance(outputs, tuple) else outputs[i]
        if metas is not None:
            shape, stride = tuple(metas[i].shape), tuple(metas[i].stride())
        elif shapes == "local":
            shape, stride = tuple(x.shape), tuple(x.stride())
        else:
            got = shapes if isinstance(shapes, tuple) else shapes[i]  # type: ignore[index]
            if got is None:
                raise AssertionError(f"{call.func}: rule gave no shape for output {i}")
            shape = tuple(got)
            stride = _shard_math.strides_like(x, shape)
        leaves[i] = DTensor(x, DTensorSpec(call.mesh, pls, shape, stride), requires_grad=False)
    if isinstance(out, list | tuple):
        return type(out)(leaves) if type(out) in (list, tuple) else tuple(leaves)
    return leaves[0]


from ringlet.dtensor import _ops  # noqa: F401  (registers the rules)
