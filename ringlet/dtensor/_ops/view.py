"""Views and shape ops: a sharded dim is kept when the op only moves it, else gathered first.

``view``/``reshape`` group input and output dims with equal products; a sharded dim
survives when it leads its group (``[B, T, H] -> [B*T, H]`` keeps ``S(0)``) and, if the
group merges or splits dims, when its size and the new leading size divide by the
number of shards (uneven shards of a merged dim would not be ``torch.chunk`` pieces
of the result).  Transposes and permutes move the shard; ``unsqueeze``/``squeeze``
shift it; selecting, slicing, splitting or concatenating *along* a sharded dim
gathers it first (a full-range slice is a no-op).  Partial passes through every view.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Placement, Replicate, Shard

__all__ = ["view_groups"]

aten = torch.ops.aten
R = Replicate()


def view_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input dims with runs of output dims of equal product (pure).

    >>> view_groups([2, 3, 4], [6, 4])
    [([0, 1], [0]), ([2], [1])]
    """
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) or j < len(b):
        ins: list[int] = []
        outs: list[int] = []
        pa = pb = 1
        if i < len(a):
            ins.append(i)
            pa *= a[i]
            i += 1
        if j < len(b):
            outs.append(j)
            pb *= b[j]
            j += 1
        while pa != pb:
            if pa < pb and i < len(a):
                ins.append(i)
                pa *= a[i]
                i += 1
            elif pb < pa and j < len(b):
                outs.append(j)
                pb *= b[j]
                j += 1
            else:
                break
        groups.append((ins, outs))
    return groups


def _view_target(d: int, groups: list[tuple[list[int], list[int]]], a: Sequence[int],
                 b: Sequence[int], count: int) -> int | None:
    """The output dim that input dim ``d`` (split into ``count`` shards) becomes, or None."""
    for ins, outs in groups:
        if d not in ins:
            continue
        big_in = [k for k in ins if a[k] != 1]
        big_out = [k for k in outs if b[k] != 1]
        if not big_in or big_in[0] != d or not big_out:
            return None
        o = big_out[0]
        if len(big_in) == 1 and len(big_out) == 1:
            return o
        return o if a[d] % count == 0 and b[o] % count == 0 else None
    return None


def _local_shape(call: OpCall, out: Sequence[Placement]) -> list[int]:
    m = call.meta()
    return _shard_math.local_shape_and_offset(m.shape, call.mesh.shape,
                                              call.mesh.get_coordinate() or [], out)[0]


def _with_size(pos: int, out: list[Placement], call: OpCall) -> Any:
    """A local function that calls the op with the local output size in argument ``pos``.

    The size is computed now (from the key's shapes), so the function holds no tensor.
    """
    local = _local_shape(call, out)

    def fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = list(args)
        a[pos] = local
        if func in (aten.view.default, aten._unsafe_view.default) and not _viewable(a[0], local):
            # The global strides promised a view, but this rank's piece (from from_local) has gaps.
            return a[0].reshape(local)
        return func(*a, **kwargs)
    return fn


def _viewable(t: torch.Tensor, shape: list[int]) -> bool:
    if t.is_contiguous():
        return True
    try:
        t.view(shape)
    except RuntimeError:
        return False
    return True


@register(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def view_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    a, b = list(x.shape), list(call.meta().shape)
    groups = view_groups(a, b) if 0 not in a else []
    counts: dict[int, int] = {}
    for axis, p in enumerate(x.placements):
        if isinstance(p, Shard):
            counts[p.dim] = counts.get(p.dim, 1) * call.mesh.shape[axis]
    req: list[Placement] = []
    out: list[Placement] = []
    for p in x.placements:
        o = _view_target(p.dim, groups, a, b, counts[p.dim]) if isinstance(p, Shard) else -1
        if o is None:
            req.append(R)
            out.append(R)
        else:
            req.append(p)
            out.append(Shard(o) if isinstance(p, Shard) else p)
    return Plan([tuple(req)], tuple(out), _with_size(1, out, call))


def _moved(call: OpCall, move: Any,
           gather: set[int] | None = None) -> tuple[Placements, Placements]:
    """(required, output) placements when dim ``d`` becomes ``move(d)``; dims in
    ``gather`` are gathered."""
    req: list[Placement] = []
    out: list[Placement] = []
    for p in call.dts[0].placements:
        if isinstance(p, Shard) and (gather is not None and p.dim in gather or move(p.dim) is None):
            req.append(R)
            out.append(R)
        else:
            req.append(p)
            out.append(Shard(move(p.dim)) if isinstance(p, Shard) else p)
    return tuple(req), tuple(out)


@register(aten.t.default, aten.transpose.int, aten.permute.default)
def permute_rule(call: OpCall) -> Plan:
    nd = call.dts[0].dim()
    perm = list(range(nd))
    if call.func == aten.permute.default:
        perm = [d % nd for d in call.args[1]]
    elif nd >= 2:
        d0, d1 = (0, 1) if call.func == aten.t.default else (call.args[1] % nd, call.args[2] % nd)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    req, out = _moved(call, perm.index)
    return Plan([req], out)


@register(aten.unsqueeze.default)
def unsqueeze_rule(call: OpCall) -> Plan:
    at = call.args[1] % (call.dts[0].dim() + 1)
    req, out = _moved(call, lambda d: d + 1 if d >= at else d)
    return Plan([req], out)


@register(aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims)
def squeeze_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    nd = x.dim()
    dims = call.bound().get("dim", list(range(nd)))
    dims = [dims] if isinstance(dims, int) else list(dims)
    gone = sorted({d % nd for d in dims if x.shape[d % nd] == 1}) if nd else []
    req, out = _moved(call, lambda d: d - sum(1 for g in gone if g < d), set(gone))

    def fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        # Squeeze the dims that are size 1 globally, never a shard that happens to be size 1 here.
        return aten.squeeze.dims(args[0], gone) if gone else aten.alias.default(args[0])
    return Plan([req], out, fn)


@register(aten.expand.default)
def expand_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    b = list(call.meta().shape)
    lead = len(b) - x.dim()
    req, out = _moved(call, lambda d: d + lead if x.shape[d] == b[d + lead] else None)
    return Plan([req], out, _with_size(1, list(out), call))


@register(aten.select.int)
def select_rule(call: OpCall) -> Plan:
    dim = call.args[1] % max(call.dts[0].dim(), 1)      # 0-d: dim 0 or -1
    req, out = _moved(call, lambda d: d - 1 if d > dim else d, {dim})
    return Plan([req], out)


@register(aten.slice.Tensor)
def slice_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    bound = call.bound()
    dim = bound.get("dim", 0) % max(x.dim(), 1)
    start, end, step = bound.get("start"), bound.get("end"), bound.get("step", 1)
    whole = (start in (None, 0)) and (end is None or end >= x.shape[dim]) and step == 1
    req, out = _moved(call, lambda d: d, None if whole else {dim})
    return Plan([req], out)


@register(aten.split.Tensor, aten.split_with_sizes.default, aten.unbind.int)
def split_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    dim = call.bound().get("dim", 0) % max(x.dim(), 1)
    shift = call.func == aten.unbind.int
    req, out = _moved(call, lambda d: d - 1 if shift and d > dim else d, {dim})
    return Plan([req], out)


def _unify(call: OpCall, tensors: Sequence[Any], dim: int) -> Placements:
    """One placement per axis for all of ``tensors``: the first that is not Replicate, unless it
    shards the concatenation dim ``dim`` (then Replicate)."""
    target: list[Placement] = []
    for axis in range(call.mesh.ndim):
        chosen: Placement = R
        for t in tensors:
            p = t.placements[axis]
            if not isinstance(p, Replicate) and not (isinstance(p, Shard) and p.dim == dim):
                chosen = p
                break
        target.append(chosen)
    return tuple(target)


@register(aten.cat.default)
def cat_rule(call: OpCall) -> Plan:
    ts = [t for t in call.args[0] if t.dim() > 0 or t.numel() > 0]
    dim = call.bound().get("dim", 0) % ts[0].dim()
    target = _unify(call, ts, dim)
    shape = list(ts[0].shape)
    shape[dim] = sum(t.shape[dim] for t in ts)
    return Plan([target] * len(call.dts), target, shapes=tuple(shape))


@register(aten.stack.default)
def stack_rule(call: OpCall) -> Plan:
    ts = call.args[0]
    dim = call.bound().get("dim", 0) % (ts[0].dim() + 1)
    target = _unify(call, ts, -1)
    out = tuple(Shard(p.dim + 1 if p.dim >= dim else p.dim) if isinstance(p, Shard) else p
                for p in target)
    shape = list(ts[0].shape)
    shape.insert(dim, len(ts))
    return Plan([target] * len(call.dts), out, shapes=tuple(shape))


@register(aten.index_select.default)
def index_select_rule(call: OpCall) -> Plan:
    dim = call.args[1] % max(call.dts[0].dim(), 1)      # 0-d: dim 0 or -1
    req, out = _moved(call, lambda d: d, {dim})
    rep = (R,) * call.mesh.ndim
    return Plan([req] + [rep] * (len(call.dts) - 1), out)


@register(aten.view_as_complex.default)
def view_as_complex_rule(call: OpCall) -> Plan:
    """``[..., 2]`` reals -> ``[...]`` complex: shards of the other dims stay (the
    pair dim is never split)."""
    x = call.dts[0]
    last = x.dim() - 1
    req, out = _moved(call, lambda d: d, {last})
    return Plan([req], out, shapes=tuple(x.shape[:-1]))


@register(aten.view_as_real.default)
def view_as_real_rule(call: OpCall) -> Plan:
    """``[...]`` complex -> ``[..., 2]`` reals: shards stay."""
    x = call.dts[0]
    req, out = _moved(call, lambda d: d)
    return Plan([req], out, shapes=tuple(x.shape) + (2,))
