"""Factories like an input, scalar reads, comparisons, and ops that work along one dim.

* ``*_like`` keep the input's shards (a Partial input gives a Replicate result: ``ones_like``
  of a partial value is not partial); ``new_*`` of the input's own size do the same,
  any other size is Replicate.
* ``item()`` (``_local_scalar_dense``) reads a Replicate value (reducing / gathering first);
  ``equal`` compares shards and agrees across the mesh.
* Softmax, log-softmax, cumulative sums, sort and layer norm work along some dims: those
  must not be sharded (they are gathered), the others keep their shards.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.dtensor import _comm, _shard_math
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._ops._common import rep
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Partial, Replicate, Shard

__all__: list[str] = []

aten = torch.ops.aten
R = Replicate()


def _no_partial(pls: Placements) -> Placements:
    return tuple(R if isinstance(p, Partial) else p for p in pls)


@register(aten.empty_like.default, aten.zeros_like.default, aten.ones_like.default,
          aten.full_like.default, aten.rand_like.default, aten.randn_like.default,
          aten.randint_like.default,
          aten.randint_like.low_dtype)
def like_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    return Plan([x.placements] + [d.placements for d in call.dts[1:]], _no_partial(x.placements),
                shapes=tuple(x.shape))


@register(aten.new_empty.default, aten.new_zeros.default, aten.new_ones.default,
          aten.new_full.default, aten.new_empty_strided.default)
def new_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    size = [int(s) for s in call.args[1]]
    if size != list(x.shape):
        return Plan([x.placements], rep(call.mesh), shapes="local")
    out = _no_partial(x.placements)
    local = _shard_math.local_shape_and_offset(size, call.mesh.shape,
                                               call.mesh.get_coordinate() or [], out)[0]

    def fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        a = list(args)
        a[1] = local
        if func == aten.new_empty_strided.default:
            a[2] = list(_shard_math.contiguous_strides(local))
        return func(*a, **kwargs)
    return Plan([x.placements], out, fn, tuple(size))


@register(aten._local_scalar_dense.default, aten.is_nonzero.default)
def item_rule(call: OpCall) -> Plan:
    return Plan([rep(call.mesh)], None)


@register(aten.equal.default)
def equal_rule(call: OpCall) -> Plan:
    a, b = call.dts[0], call.dts[1]
    if a.shape != b.shape:
        return Plan([a.placements, b.placements], None, lambda f, args, kw: False)
    target = _no_partial(a.placements)
    mesh = call.mesh

    def fn(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        same = torch.tensor([1 if func(*args, **kwargs) else 0], dtype=torch.int64)
        for axis in range(mesh.ndim):
            if mesh.shape[axis] > 1:
                same = _comm.all_reduce(same, mesh, axis, Partial("min"))
        return bool(same.item())
    return Plan([target, target], None, fn)


def _along(call: OpCall, dims: set[int], shapes: Any = None) -> Plan:
    """Every DTensor argument takes the first one's layout with ``dims`` gathered and no Partial.

    Outputs have the first argument's shape unless ``shapes`` says otherwise.
    """
    first = call.dts[0]
    target = tuple(R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in dims) else p
                   for p in first.placements)
    inputs: list[Placements] = []
    for d in call.dts:
        if d.dim() == first.dim():
            inputs.append(target)
        else:                                   # weights and biases of a norm: Replicate
            inputs.append(rep(call.mesh))
    return Plan(inputs, target, shapes=tuple(first.shape) if shapes is None else shapes)


@register(aten._softmax.default, aten._log_softmax.default, aten._softmax_backward_data.default,
          aten._log_softmax_backward_data.default, aten.cumsum.default, aten.sort.default,
          aten.sort.stable, aten.topk.default, aten.cummax.default, aten.cummin.default)
def along_dim_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    nd = x.dim()
    dim = call.bound().get("dim", -1) % max(nd, 1)
    shape = list(x.shape)
    if call.func == aten.topk.default:
        shape[dim] = int(call.args[1])
    return _along(call, {dim} if nd else set(), tuple(shape))


@register(aten.native_layer_norm.default)
def layer_norm_rule(call: OpCall) -> Plan:
    x = call.dts[0]
    k = len(call.args[1])
    stats = tuple(x.shape[:x.dim() - k]) + (1,) * k
    return _along(call, set(range(x.dim() - k, x.dim())), [tuple(x.shape), stats, stats])


@register(aten.native_layer_norm_backward.default)
def layer_norm_backward_rule(call: OpCall) -> Plan:
    """grad_input follows the input's shards; weight and bias gradients are
    partial sums over them."""
    x = call.dts[call.slot(1) or 1]
    k = len(call.args[2])
    normed = set(range(x.dim() - k, x.dim()))
    target = tuple(R if isinstance(p, Partial) or (isinstance(p, Shard) and p.dim in normed) else p
                   for p in x.placements)
    param_grad = tuple(Partial("sum") if isinstance(p, Shard) else R for p in target)
    inputs: list[Placements] = []
    for d in call.dts:
        inputs.append(target if d.dim() == x.dim() else rep(call.mesh))
    outs: list[Placements] = [target, param_grad, param_grad]
    w, b = call.args[5], call.args[6]
    shapes = [tuple(x.shape), None if w is None else tuple(w.shape),
              None if b is None else tuple(b.shape)]
    return Plan(inputs, outs, shapes=shapes)

