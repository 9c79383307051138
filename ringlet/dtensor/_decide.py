"""The uncached path of DTensor dispatch: ask the rule, move, run, wrap -- and record the decision.

Steps 1-5 of [Note: DTensor dispatch]; :func:`decide` also turns what it did into a
:class:`~ringlet.dtensor._plan.Decision` for the cache ([Note: dispatch cache]), so that
the cached path repeats exactly these moves and output specs.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._api import DTensor, resolve_lazy
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._ops import family_rule
from ringlet.dtensor._outside import outside_result
from ringlet.dtensor._plan import (
    FLOAT_BLIND,
    LOCAL,
    MANY,
    NO_CACHE,
    ONE,
    OVERRIDES,
    RAW,
    RULES,
    WRITTEN,
    Decision,
    Plan,
    replicate_rule,
    unsupported,
)
from ringlet.dtensor._redistribute import redistribute_local
from ringlet.dtensor._spec import DTensorSpec, decisions_of
from ringlet.dtensor.placements import Shard

__all__ = ["decide", "rule_for"]

MAX_DECISIONS = 4096         # per mesh; past that many distinct calls the cache starts over


def rule_for(func: Any) -> Any:
    """The registered rule of ``func`` (overload, then packet, then family), or None."""
    rule = RULES.get(func) or RULES.get(func.overloadpacket)
    if rule is None:
        rule = family_rule(func)
    return rule


def decide(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any],
           key: tuple[Any, ...] | None = None, *, overrides: bool = True) -> Any:
    """Dispatch one call through its rule; with ``key``, record the decision on the mesh.

    ``overrides=False``: ignore ``OVERRIDES`` (how an override hands a call it declines back).
    """
    handlers = OVERRIDES.get() if overrides else None
    if handlers is not None and func in handlers:
        return handlers[func](func, args, kwargs)
    if _reshapes_in_place(func):
        return _view_in_place(func, args, kwargs)
    call = OpCall(func, args, kwargs)
    rule = rule_for(func)
    if rule is None:
        if not all(all(p.is_replicate() for p in d.placements) for d in call.dts):
            if _decomposes(func):           # [Note: composite ops]
                return func.decompose(*call.args, **call.kwargs)
            raise unsupported(call)
        rule = replicate_rule
    if getattr(rule, "float_blind", False) and call.name != "masked_fill":
        FLOAT_BLIND.add(func)
    plan = rule(call)
    _check_strided(call, plan)
    written = call.written_positions()
    if call.mesh.get_coordinate() is None:      # [Note: ranks outside the mesh] in ``_outside``
        back = _written_results(call) if written and _returns_written(func) else None
        return outside_result(call, plan, back)
    flat = list(call.flat)
    moves: list[tuple[int, Any, Any, Any]] = []
    for k, (pos, d) in enumerate(zip(call.positions, call.dts)):
        want = plan.inputs[k]
        local = d._local_tensor
        if want != d.placements:
            if pos in written:
                raise RuntimeError(f"{func}: the op writes {d!r} in place but its rule needs it as "
                                   f"{''.join(map(repr, want))}; redistribute it first")
            local = redistribute_local(local, call.mesh, d.placements, want, d._spec.shape)
            moves.append((pos, d.placements, want, d._spec.shape))
        flat[pos] = local
    largs, lkwargs = call.rebuild(flat)
    fn = _runner(func, plan)
    if rule is replicate_rule:      # a kernel we know nothing about: it may make lazy views
        fn = _with_lazy_views(fn)
    out = fn(*largs, **lkwargs)
    if _flagged(out):           # [Note: lazy conjugate and negative] in ``_api``
        fn = _resolving(fn)
        out = _resolve_out(out)
    kind: int | None
    if plan.outputs is None:
        result, kind, desc = out, RAW, None
    elif written and _returns_written(func):
        result, kind, desc = _written_results(call), WRITTEN, _written_slots(call)
    else:
        with alias_context(args, func):
            result = _wrap(call, out, plan)
        kind, desc = _describe(call, result, plan)
        if kind is not None and _aliases(func):
            kind |= ALIAS
    if key is not None and kind is not None and func not in NO_CACHE:
        cache = decisions_of(call.mesh)
        if len(cache) >= MAX_DECISIONS:
            cache.clear()
        cache[key] = Decision(fn, tuple(_slot_moves(call, moves)), kind, desc)
    return result


ALIAS = 8
"""Flag on a ``Decision.kind``: the op's outputs alias its first argument (a view)."""


@functools.cache
def _aliases(func: Any) -> bool:
    """Whether ``func`` returns views of an argument (a non-written alias annotation)."""
    return any(r.alias_info is not None and not r.alias_info.is_write
               for r in func._schema.returns)


def alias_context(args: tuple[Any, ...], func: Any = None) -> Any:
    """Where the DTensor outputs of a view op (``func``, or any op when None) are created:
    outside inference mode when its base is a normal tensor (under ``torch.inference_mode()``
    a view of a normal tensor is a normal tensor: torch then shares the base's version counter
    with it, which an inference tensor does not have)."""
    if (torch.is_inference_mode_enabled() and (func is None or _aliases(func)) and args
            and isinstance(args[0], torch.Tensor) and not args[0].is_inference()):
        return torch.inference_mode(False)
    return _NO_CONTEXT


_NO_CONTEXT = contextlib.nullcontext()


@functools.cache
def _reshapes_in_place(func: Any) -> bool:
    """Whether ``func`` changes its argument's metadata in place (``unsqueeze_``, ``t_``,
    ``as_strided_``, ``resize_``...): the wrapper's shape would no longer be the global one."""
    name: str = func.overloadpacket.__name__
    if name in ("resize_", "resize_as_", "set_"):
        return True
    if not name.endswith("_") or name.endswith("__") or name == "detach_":
        return False
    base = getattr(torch.ops.aten, name[:-1], None)
    if base is None:
        return False
    views = [getattr(base, o) for o in base.overloads()]
    return any(v.is_view and v._schema.arguments and str(v._schema.arguments[0].type) == "Tensor"
               for v in views)


# in-place views that only permute, add or drop size-1 dims: the out-of-place view's rule places
# the result, and the wrapper's own shape and strides are changed to match
_IN_PLACE_VIEWS = frozenset({"unsqueeze_", "squeeze_", "transpose_", "t_", "swapdims_",
                             "swapaxes_"})


def _view_in_place(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``unsqueeze_``, ``squeeze_``, ``transpose_``, ``t_`` on a DTensor: the local piece and the
    wrapper's metadata change in place, the layout is the out-of-place view's.  Other in-place
    metadata changes (``as_strided_``, ``resize_``, ``set_``) are refused."""
    name: str = func.overloadpacket.__name__
    self = args[0] if args else None
    if name not in _IN_PLACE_VIEWS or not isinstance(self, DTensor):
        call = OpCall(func, args, kwargs)
        raise NotImplementedError(
            f"{func}: changes the shape or strides of {call.describe()} in place, which a "
            f"DTensor cannot follow; use the out-of-place op ({name.rstrip('_')}) instead")
    view = getattr(torch.Tensor, name[:-1])(self, *args[1:], **kwargs)
    local = self._local_tensor
    moved = not local.is_meta and (view._local_tensor.untyped_storage().data_ptr()
                                   != local.untyped_storage().data_ptr())
    if moved:
        raise NotImplementedError(f"{func}: {self!r} would have to be redistributed to "
                                  f"{''.join(map(repr, view.placements))}, which an in-place op "
                                  f"cannot do; use the out-of-place op ({name[:-1]})")
    func(local, *args[1:], **kwargs)
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Python)):
        func(self, *args[1:], **kwargs)        # the wrapper's own sizes and strides
    if tuple(local.shape) != tuple(view._local_tensor.shape) or self.shape != view.shape:
        raise AssertionError(f"{func}: in-place view gave {list(local.shape)} locally, "
                             f"{list(self.shape)} globally; expected {view!r}")
    self._spec = view._spec
    return self


@functools.cache
def _decomposes(func: Any) -> bool:
    """Whether ``func`` has a composite (implicit autograd) decomposition.

    [Note: composite ops]
    With autograd on, torch decomposes ops such as ``linear``, ``matmul``, ``layer_norm``,
    ``softmax`` or ``scaled_dot_product_attention`` into the ops they are made of before they
    reach a tensor subclass; under ``torch.inference_mode()`` (and for some ops under
    ``torch.no_grad()``) they arrive whole.  An op without a rule of its own that has such a
    decomposition runs it on the DTensors, so each piece meets its own rule: the same
    placements, collectives and values as with autograd on.  (All-Replicate calls still run
    the op whole on the local tensors.)
    """
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


def _check_strided(call: OpCall, plan: Plan) -> None:
    """Refuse a plan that keeps a ``_StridedShard`` input but gives a plain
    ``Shard`` output on its axis.

    Rules build output placements from input dims; a plain shard built from a strided one
    would describe the output's pieces wrongly ([Note: strided shards] in ``_redistribute``).
    Elementwise rules keep the strided placement; other ops on such tensors must redistribute.
    """
    axes = {a for req in plan.inputs
            for a, p in enumerate(req) if isinstance(p, Shard) and p._applied_last}
    if not axes or plan.outputs is None or call.name.startswith("_foreach_"):
        # _foreach_ ops are elementwise per list element: their planner keeps the layout
        return
    outs = plan.outputs if isinstance(plan.outputs, list) else [plan.outputs]
    for pls in outs:
        for a in axes:
            p = pls[a]
            if isinstance(p, Shard) and not p._applied_last:
                raise NotImplementedError(
                    f"{call.func}: no DTensor sharding rule for {call.describe()} on "
                    f"{call.mesh!r} that keeps the strided layout of mesh axis {a} "
                    "(fully_shard over tensor-parallel parameters); redistribute() to plain "
                    "placements or use full_tensor() first")


def _runner(func: Any, plan: Plan) -> Any:
    if plan.local_fn is None:
        return getattr(func, "_op", func)       # OpOverload.__call__ only forwards to _op
    local_fn = plan.local_fn

    def run(*args: Any, **kwargs: Any) -> Any:
        return local_fn(func, args, kwargs)
    return run


_KEYS = (torch._C.DispatchKey.Conjugate, torch._C.DispatchKey.Negative)
_excluded = torch._C._dispatch_tls_is_dispatch_key_excluded
_set_excluded = torch._C._dispatch_tls_set_dispatch_key_excluded


def _with_lazy_views(fn: Any) -> Any:
    """``fn`` run with torch's conjugate and negative views handled.

    Inside ``__torch_dispatch__`` torch turns off its handling of those views (the dispatch keys
    above the subclass's are excluded), so a kernel that makes a conjugate view of a plain
    tensor and computes with it (``linalg.pinv``, ``linalg.lstsq`` on complex inputs) would use
    the unconjugated values.  Kernels with a rule are plain ones; the replicate fallback runs
    any op, so it turns the handling back on ([Note: lazy conjugate and negative] in ``_api``).
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        was = [_excluded(k) for k in _KEYS]
        for k in _KEYS:
            _set_excluded(k, False)
        try:
            return fn(*args, **kwargs)
        finally:
            for k, w in zip(_KEYS, was):
                _set_excluded(k, w)
    return run


def _flagged(out: Any) -> bool:
    """Whether a local result holds a tensor with a lazy conjugate or negative bit."""
    return any(isinstance(x, torch.Tensor) and (x.is_conj() or x.is_neg()) for x in _leaves(out))


def _resolve_out(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        return resolve_lazy(out)
    if type(out) in (list, tuple):
        return type(out)(resolve_lazy(x) if isinstance(x, torch.Tensor) else x for x in out)
    return out


def _resolving(fn: Any) -> Any:
    """``fn`` whose tensor results are resolved: what a cached decision of an op that returned
    a flagged tensor runs (inputs are never flagged, so the op flags every time)."""
    def run(*args: Any, **kwargs: Any) -> Any:
        return _resolve_out(fn(*args, **kwargs))
    return run


def _slot_moves(call: OpCall, moves: list[tuple[int, Any, Any, Any]]) -> list[tuple[Any, ...]]:
    """Flat positions -> (argument index or keyword, element index or -1)."""
    where: dict[int, tuple[Any, int]] = {}
    offset = 0
    names = list(call.kwargs)
    for i, entry in enumerate(call.spec):
        slot: Any = i if i < len(call.args) else names[i - len(call.args)]
        if entry is None:
            where[offset] = (slot, -1)
            offset += 1
        else:
            for j in range(entry[1]):
                where[offset + j] = (slot, j)
            offset += entry[1]
    return [where[pos] + (src, dst, shape) for pos, src, dst, shape in moves]


def _describe(call: OpCall, result: Any, plan: Plan) -> tuple[int | None, Any]:
    """How the cached path rebuilds ``result`` from the local output (None: do not cache)."""
    if plan.shapes == "local":
        if isinstance(result, DTensor):
            return LOCAL, (call.mesh, result.placements, {})
        return None, None
    if isinstance(result, DTensor):
        return ONE, result._spec
    if type(result) in (list, tuple):
        return MANY, (type(result), [x._spec if isinstance(x, DTensor) else None for x in result])
    return None, None


def local_spec(out: Any, local: torch.Tensor) -> DTensorSpec:
    """The spec of a ``LOCAL`` output (Replicate: the local shape is the global
    one), cached by shape."""
    mesh, pls, specs = out
    k = (tuple(local.shape), tuple(local.stride()))
    spec = specs.get(k)
    if spec is None:
        if len(specs) >= 64:          # data-dependent shapes (nonzero, unique): keep a few
            specs.clear()
        spec = specs[k] = DTensorSpec(mesh, pls, k[0], k[1])
    return spec


@functools.cache
def _returns_written(func: Any) -> bool:
    rets = func._schema.returns
    return not rets or all(r.alias_info is not None and r.alias_info.is_write for r in rets)


def _written_names(func: Any) -> list[str]:
    """Schema names of the written arguments that ``func`` returns, in return order."""
    by_set = {}
    for a in func._schema.arguments:
        if a.alias_info is not None and a.alias_info.is_write:
            by_set[frozenset(a.alias_info.before_set)] = a.name
    return [by_set[frozenset(r.alias_info.before_set)] for r in func._schema.returns]


def _written_results(call: OpCall) -> Any:
    bound = call.bound()
    out = [bound.get(n) for n in _written_names(call.func)]
    return None if not out else out[0] if len(out) == 1 else tuple(out)


def _written_slots(call: OpCall) -> tuple[Any, ...]:
    """Where the returned written arguments sit in the call: positional index or keyword."""
    positional = [a.name for a in call.func._schema.arguments][:len(call.args)]
    return tuple(positional.index(n) if n in positional else n for n in _written_names(call.func))


def _leaves(out: Any) -> list[Any]:
    return list(out) if isinstance(out, list | tuple) else [out]


def _wrap(call: OpCall, out: Any, plan: Plan) -> Any:
    """Local results -> DTensors; list ``outputs``/``shapes`` have one entry per output leaf."""
    leaves = _leaves(out)
    outputs, shapes = plan.outputs, plan.shapes
    if outputs is None:  # pragma: no cover - decide returns raw results before wrapping
        raise AssertionError("no output placements")
    metas = _leaves(call.meta()) if shapes is None else None
    if isinstance(outputs, list) and len(outputs) != len(leaves):
        raise AssertionError(f"{call.func}: rule gave {len(outputs)} output placements "
                             f"for {len(leaves)} outputs")
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor):
            continue
        if x.layout != torch.strided:
            raise NotImplementedError(f"{call.func}: a DTensor holds strided tensors only, got "
                                      f"a {x.layout} result for {call.describe()}")
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
