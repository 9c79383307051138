"""Embedding lookups with a sharded table.

Per mesh axis, for ``embedding(weight [V, H], indices)``:

* weight ``S(0)`` (rows split), indices ``R``: each rank looks up the indices that fall
  in its rows (others read row 0 and are zeroed), giving ``P(sum)`` -- exactly one rank
  contributes each row;
* weight ``S(1)`` (columns split), indices ``R``: ``S(-1)`` of the output;
* weight ``R``, indices ``S(d)``: ``S(d)``;  both ``R``: ``R``.

The backward (``embedding_dense_backward``) keeps the same layouts: gradient ``S(-1)``
gives a column-split weight gradient; indices and gradient split on a batch dim give
``P(sum)``; replicated ones give a replicated weight gradient (also for a row-split
weight: the optimizer then takes its rows locally, no communication).
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._ops._common import choose
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor.placements import Partial, Placement, Replicate, Shard

__all__: list[str] = []

aten = torch.ops.aten
R = Replicate()
P = Partial("sum")


@register(aten.embedding.default)
def embedding_rule(call: OpCall) -> Plan:
    w, idx = call.dts[call.slot(0) or 0], call.dts[call.slot(1) or 1]
    last = idx.dim()
    strategies: list[tuple[Placement, ...]] = [(R, R, R), (Shard(0), R, P),
                                               (Shard(1), R, Shard(last))]
    strategies += [(R, Shard(d), Shard(d)) for d in range(idx.dim())]
    req, out = choose(call.mesh,
                      [(w.placements, tuple(w.shape)), (idx.placements, tuple(idx.shape))],
                      strategies)
    wreq = tuple(req[0])
    shape = tuple(idx.shape) + (w.shape[1],)
    if not any(isinstance(p, Shard) and p.dim == 0 for p in wreq):
        return Plan([wreq, tuple(req[1])], tuple(out), shapes=shape)
    coord = call.mesh.get_coordinate() or []
    mine, offset = _shard_math.local_shape_and_offset(w.shape, call.mesh.shape, coord, wreq)
    lo, rows = offset[0], mine[0]

    def masked(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        weight, indices = args[0], args[1]
        outside = (indices < lo) | (indices >= lo + rows)
        if rows == 0:        # an empty shard of the table: contributes nothing
            return weight.new_zeros(list(indices.shape) + [weight.shape[1]])
        local = torch.where(outside, torch.zeros_like(indices), indices - lo)
        res = func(weight, local)     # padding_idx only matters to the backward
        return res.masked_fill(outside.unsqueeze(-1), 0)
    return Plan([wreq, tuple(req[1])], tuple(out), masked, shape)


@register(aten.embedding_dense_backward.default)
def embedding_backward_rule(call: OpCall) -> Plan:
    grad, idx = call.dts[call.slot(0) or 0], call.dts[call.slot(1) or 1]
    last = grad.dim() - 1
    strategies: list[tuple[Placement, ...]] = [(R, R, R), (Shard(last), R, Shard(1)), (P, R, P)]
    if not call.bound().get("scale_grad_by_freq", False):     # frequencies need every index
        strategies += [(Shard(d), Shard(d), P) for d in range(idx.dim())]
    req, out = choose(call.mesh,
                      [(grad.placements, tuple(grad.shape)), (idx.placements, tuple(idx.shape))],
                      strategies)
    shape = (int(call.bound()["num_weights"]), grad.shape[-1])
    return Plan([tuple(r) for r in req], tuple(out), shapes=shape)
