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

[Note: dispatch cache]
Steps 1-2 and the output specs of step 5 depend only on the op, the layouts of the
DTensor arguments (``DTensorSpec._key``: placements, global shape, stride) and the
other arguments' values, so the first call records a :class:`Decision` under that key
in the mesh's dict of decisions ([Note: decisions per mesh] in ``_spec.py``), and later
calls with the same key skip the rule: they build the key, swap DTensors for their local
tensors, run the recorded moves (if any) and the local function, and wrap the result with
the recorded spec -- the same spec object every time, so the next op's key is built from
identical tokens.  Nothing is
ever invalidated: specs are immutable values and a rule's answer is a pure function of
the key (rules must not look at tensor values or at state outside the key).  A Python
float argument of an op in ``FLOAT_BLIND`` (elementwise ops, whose rules only ask whether
a number is there) enters the key as its type: an optimizer's step size and bias
corrections change every step, and keyed by value every such call would miss.  Each mesh
object belongs to one rank (ranks that are threads build their own), so cached local
functions may close over this rank's coordinate.  Not cached: calls with a non-scalar
plain tensor (adopted as Replicate), arguments that do not hash, and ops in
``NO_CACHE`` (those ``OVERRIDES`` may take over, e.g. under ``loss_parallel()``).
Outputs of the replicate fallback take their shape from the local result on every
call (data-dependent ops such as ``nonzero`` run there).

Under torch.compile dynamo does not trace this dispatch: when its tracer reaches it, it runs
eagerly (``_eager_dispatch``, compiler-disabled) on the tracer's fake local tensors, and the
styles' and fully_shard's hooks are disabled likewise.  AOT autograd then traces the DTensor
ops through the subclass (``__tensor_flatten__``), running this dispatch on functional
tensors; the collectives it meets are recorded as custom ops ([Note: traceable collectives]
in ``_traceable.py``).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch

from ringlet._compile import compiler_disable
from ringlet.dtensor._api import DTensor
from ringlet.dtensor._decide import ALIAS, alias_context, decide, local_spec
from ringlet.dtensor._plan import (
    FLOAT_BLIND,
    LOCAL,
    MANY,
    ONE,
    WRITTEN,
)
from ringlet.dtensor._redistribute import redistribute_local
from ringlet.dtensor._spec import DTensorSpec

if TYPE_CHECKING:
    from ringlet.mesh import DeviceMesh

__all__ = ["dispatch", "torch_dispatch", "wrap_local"]

aten = torch.ops.aten
_new_wrapper = torch.Tensor._make_wrapper_subclass
_ATOMS = frozenset({int, float, bool, type(None), str})
_SCALAR = object()              # key marker: a 0-d plain tensor (its dtype follows)
_STRIDED = torch.strided


class _Uncached(Exception):
    """This call cannot use the cache (see [Note: dispatch cache])."""


def wrap_local(local: torch.Tensor, spec: DTensorSpec) -> DTensor:
    """A DTensor around ``local`` (no checks, no autograd): the cheapest constructor."""
    # positional arguments: measurably cheaper to parse than keywords (size, strides,
    # storage_offset, memory_format, dtype, layout, device)
    r = _new_wrapper(DTensor, spec.shape, spec.stride, None, None, local.dtype, _STRIDED,
                     local.device)
    r._local_tensor = local
    r._spec = spec
    return r


def torch_dispatch(cls: Any, func: Any, types: Any, args: tuple[Any, ...] = (),
                   kwargs: dict[str, Any] | None = None) -> Any:
    """``DTensor.__torch_dispatch__`` itself (installed by ``_api``; see
    [Note: DTensor dispatch] and
    [Note: dispatch cache])."""
    if _is_compiling() and not _EAGER.active:   # torch.compile must not trace the dispatch
        return _eager_dispatch(cls, func, types, args, kwargs)
    # Any: the decisions live in an attribute dtensor sets on the mesh ([Note: decisions per
    # mesh]), read without a check; no mesh (None) raises the AttributeError caught below
    mesh: Any = None
    key: list[Any] = [func]
    largs: list[Any] = []
    lkwargs: dict[str, Any] = {}
    blind = func in FLOAT_BLIND
    try:
        for x in args:                     # the common leaves inline: this loop is the hot path
            if type(x) is DTensor:
                s = x._spec
                if s.mesh is not mesh:
                    mesh = _same_mesh(mesh, s.mesh)
                key.append(s._key)
                largs.append(x._local_tensor)
            elif type(x) in _ATOMS:
                key.append(float if blind and type(x) is float else x)
                largs.append(x)
            else:
                mesh = _leaf(x, key, largs, mesh)
        if kwargs:
            vals: list[Any] = []
            for k, v in kwargs.items():
                key.append(k)
                if blind and type(v) is float:
                    key.append(float)
                    vals.append(v)
                else:
                    mesh = _leaf(v, key, vals, mesh)
                lkwargs[k] = vals[-1]
        tkey = tuple(key)
        decision = mesh._dtensor_decisions.get(tkey)      # [Note: decisions per mesh]
    # TypeError: unhashable; AttributeError: no mesh
    except (_Uncached, TypeError, AttributeError):
        return decide(func, args, kwargs or {}, None)
    if decision is None:
        return decide(func, args, kwargs or {}, tkey)
    fn, moves, kind, out = decision
    if moves:
        _move(moves, largs, lkwargs, mesh)
    res = fn(*largs, **lkwargs) if lkwargs else fn(*largs)
    if kind == ONE or (kind == _ONE_VIEW and not _inference_mode()):
        return wrap_local(res, out)
    return _finish(kind, out, res, args, kwargs or {})


_is_compiling = torch.compiler.is_compiling
_inference_mode = torch.is_inference_mode_enabled
_ONE_VIEW = ONE | ALIAS


class _Eager(threading.local):
    active = False                      # inside _eager_dispatch on this thread


_EAGER = _Eager()


@compiler_disable
def _eager_dispatch(cls: Any, func: Any, types: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any] | None) -> Any:
    """The dispatch run eagerly when torch.compile's tracer reaches it: a graph break at each
    DTensor op (ringlet's DTensor ops, collectives included, are not traceable)."""
    _EAGER.active = True
    try:
        return torch_dispatch(cls, func, types, args, kwargs)
    finally:
        _EAGER.active = False


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
    """Dispatch ``func`` on DTensor arguments as ``__torch_dispatch__`` would."""
    return torch_dispatch(DTensor, func, (), args, kwargs)


def _same_mesh(mesh: DeviceMesh | None, other: DeviceMesh) -> DeviceMesh:
    if mesh is None:
        return other
    if other != mesh:
        raise _Uncached                     # the rule-driven path names the two meshes
    return mesh


def _leaf(x: Any, key: list[Any], out: list[Any], mesh: DeviceMesh | None) -> DeviceMesh | None:
    """Key and local value of an argument that is not a DTensor or an atom; returns the mesh."""
    t = type(x)
    if t is DTensor:
        s = x._spec
        key.append(s._key)
        out.append(x._local_tensor)
        return _same_mesh(mesh, s.mesh)
    if t is list or t is tuple:
        sub_key: list[Any] = []
        sub: list[Any] = []
        for y in x:
            mesh = _leaf(y, sub_key, sub, mesh)
        key.append(tuple(sub_key))
        out.append(t(sub))
        return mesh
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            raise _Uncached                 # a plain tensor among DTensors: adoption rules apply
        key.append(_SCALAR)
        key.append(x.dtype)
    else:
        key.append(x)
    out.append(x)
    return mesh


def _move(moves: tuple[Any, ...], largs: list[Any], lkwargs: dict[str, Any],
          mesh: DeviceMesh) -> None:
    for slot, j, src, dst, shape in moves:
        holder: Any = largs if isinstance(slot, int) else lkwargs
        if j < 0:
            holder[slot] = redistribute_local(holder[slot], mesh, src, dst, shape)
        else:
            seq = list(holder[slot])
            seq[j] = redistribute_local(seq[j], mesh, src, dst, shape)
            holder[slot] = type(holder[slot])(seq)


def _finish(kind: int, out: Any, res: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Outputs of a cached decision other than a single tensor (see ``Decision``), and of views
    (``ALIAS``: created where ``alias_context`` says)."""
    if kind & ALIAS:
        if _inference_mode():
            with alias_context(args):
                return _finish(kind & ~ALIAS, out, res, args, kwargs)
        kind &= ~ALIAS
    if kind == ONE:
        return wrap_local(res, out)
    if kind == MANY:
        container, specs = out
        return container([x if s is None else wrap_local(x, s) for x, s in zip(res, specs)])
    if kind == WRITTEN:
        picked = [args[p] if isinstance(p, int) else kwargs[p] for p in out]
        return None if not picked else picked[0] if len(picked) == 1 else tuple(picked)
    if kind == LOCAL:
        return wrap_local(res, local_spec(out, res))
    return res


# The hook is the hot path itself: one Python frame less per op ([Note: dispatch cache]).  The
# package imports this module, so DTensor never runs without it.
DTensor.__torch_dispatch__ = classmethod(torch_dispatch)  # type: ignore[assignment]
