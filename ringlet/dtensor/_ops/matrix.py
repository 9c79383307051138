"""Matrix products: the layouts tensor parallelism is built from.

Per mesh axis, for ``a @ b`` (``a: [m, k]``, ``b: [k, n]``):

=========  =========  =======  =========================================
a          b          out      meaning
=========  =========  =======  =========================================
R          R          R        everything local
S(0)       R          S(0)     rows of ``a`` split (sequence / batch parallel)
R          S(1)       S(1)     columns of ``b`` split (column-wise parallel)
S(1)       S(0)       P(sum)   the inner dim split: partial sums (row-wise parallel)
P          R          P        a partial value times a replicated one stays partial
R          P          P
=========  =========  =======  =========================================

``bmm``/``baddbmm`` add the batch dim (S(0) x S(0) -> S(0)); ``addmm``'s bias follows the
output (Replicate for S(0), its own shard for S(1), partitioned for P); ``mv``/``dot``
are the vector cases.  Each axis takes the cheapest layout (``_common.choose``).
"""

from __future__ import annotations

import torch

from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._ops._common import broadcast_req, choose
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard

__all__ = ["mm_strategies"]

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")


def mm_strategies(batch: int) -> list[tuple[Placement, Placement, Placement]]:
    """(a, b, out) layouts of a product with ``batch`` leading batch dims (0 for ``mm``)."""
    m, k_a, k_b, n = batch, batch + 1, batch, batch + 1
    out: list[tuple[Placement, Placement, Placement]] = [(R, R, R)]
    out += [(Shard(d), Shard(d), Shard(d)) for d in range(batch)]
    out += [(Shard(m), R, Shard(m)), (R, Shard(n), Shard(n)), (Shard(k_a), Shard(k_b), P),
            (P, R, P), (R, P, P)]
    return out


def _product(call: OpCall, a: int, b: int, batch: int, bias: int | None = None) -> Plan:
    """Plan for ``a @ b`` (argument positions), plus an additive ``bias``
    argument that broadcasts."""
    slots = [call.slot(a), call.slot(b)] + ([call.slot(bias)] if bias is not None else [])
    if any(s is None for s in slots):
        raise AssertionError(f"{call.func}: expected DTensor operands")
    dts = [call.dts[s] for s in slots if s is not None]
    out_shape = list(dts[0].shape[:-1]) + [dts[1].shape[-1]]
    strategies: list[tuple[Placement, ...]] = list(mm_strategies(batch))
    if bias is not None:    # (a, b, bias, out): the bias as the output broadcast to its shape
        bshape = list(dts[2].shape)
        strategies = [s[:2] + (broadcast_req(s[2], bshape, out_shape), s[2]) for s in strategies]
    operands = [(d.placements, tuple(d.shape)) for d in dts]
    req, out = choose(call.mesh, operands, strategies)
    inputs = [d.placements for d in call.dts]
    for s, r in zip(slots, req):
        if s is not None:
            inputs[s] = tuple(r)
    return Plan(inputs, tuple(out), shapes=tuple(out_shape))


@register(aten.mm.default)
def mm_rule(call: OpCall) -> Plan:
    return _product(call, 0, 1, 0)


@register(aten.bmm.default)
def bmm_rule(call: OpCall) -> Plan:
    return _product(call, 0, 1, 1)


@register(aten.addmm.default)
def addmm_rule(call: OpCall) -> Plan:
    return _product(call, 1, 2, 0, bias=0)


@register(aten.baddbmm.default)
def baddbmm_rule(call: OpCall) -> Plan:
    return _product(call, 1, 2, 1, bias=0)


@register(aten.mv.default)
def mv_rule(call: OpCall) -> Plan:
    strategies: list[tuple[Placement, ...]] = [(R, R, R), (Shard(0), R, Shard(0)),
                                               (Shard(1), Shard(0), P), (P, R, P), (R, P, P)]
    return _pair(call, strategies)


@register(aten.dot.default)
def dot_rule(call: OpCall) -> Plan:
    strategies: list[tuple[Placement, ...]] = [(R, R, R), (Shard(0), Shard(0), P), (P, R, P),
                                               (R, P, P)]
    return _pair(call, strategies)


def _pair(call: OpCall, strategies: list[tuple[Placement, ...]]) -> Plan:
    operands = [(d.placements, tuple(d.shape)) for d in call.dts]
    req, out = choose(call.mesh, operands, strategies)
    shape = tuple(call.dts[0].shape[:-1])       # mv: [m]; dot: []
    return Plan([tuple(r) for r in req], tuple(out), shapes=shape)
