"""Scaled dot-product attention on DTensors sharded by batch or by heads.

``F.scaled_dot_product_attention`` on CPU reaches DTensor as
``_scaled_dot_product_flash_attention_for_cpu`` (and its backward).  Attention mixes
positions along the sequence and the head dim, never across batch entries or heads,
so per mesh axis: query ``S(0)`` (batch) or ``S(1)`` (heads) is kept and every other
tensor argument -- key, value, the saved output and log-sum-exp, gradients -- takes the
same shard; a mask takes it where it has that dim (a broadcast dim stays ``Replicate``);
any other layout of the query (sequence or head-dim shards, ``Partial``) is gathered
first.  With tensor parallelism the usual case needs none of this: attention runs on the
plain local heads that ``ColwiseParallel(use_local_output=True)`` hands over.
"""

from __future__ import annotations

import torch

from ringlet.dtensor._opcall import OpCall
from ringlet.dtensor._ops._common import broadcast_req
from ringlet.dtensor._plan import Plan, register
from ringlet.dtensor._spec import Placements
from ringlet.dtensor.placements import Placement, Replicate, Shard

__all__: list[str] = []

aten = torch.ops.aten
R = Replicate()
_MASKS = ("attn_mask",)


def _targets(q_pls: Placements) -> tuple[Placement, ...]:
    return tuple(p if isinstance(p, Shard) and p.dim in (0, 1) else R for p in q_pls)


def _plan_inputs(call: OpCall, query_slot: int) -> tuple[list[Placements], tuple[Placement, ...]]:
    q = call.dts[call.slot(query_slot) or 0]
    target = _targets(q.placements)
    masks = {call.slot(name) for name in _MASKS}
    inputs: list[Placements] = []
    for k, d in enumerate(call.dts):
        if k in masks:
            inputs.append(tuple(broadcast_req(t, tuple(d.shape), tuple(q.shape)) for t in target))
        else:
            inputs.append(target)
    return inputs, target


@register(aten._scaled_dot_product_flash_attention_for_cpu.default)
def sdpa_rule(call: OpCall) -> Plan:
    inputs, target = _plan_inputs(call, 0)
    q, v = call.dts[call.slot(0) or 0], call.dts[call.slot(2) or 2]
    shapes: list[tuple[int, ...] | None] = [tuple(q.shape[:-1]) + (v.shape[-1],),
                                            tuple(q.shape[:-1])]
    return Plan(inputs, [target, target], shapes=shapes)


@register(aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
def sdpa_backward_rule(call: OpCall) -> Plan:
    inputs, target = _plan_inputs(call, 1)
    shapes: list[tuple[int, ...] | None] = [tuple(call.dts[call.slot(i) or i].shape)
                                            for i in (1, 2, 3)]
    return Plan(inputs, [target] * 3, shapes=shapes)
