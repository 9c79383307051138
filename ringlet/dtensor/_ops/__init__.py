"""Sharding rules per op family; importing this package registers them in ``_plan.RULES``.

The dispatcher (``_decide``) imports it, so every rule is registered before the first op.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.dtensor._ops import (  # noqa: F401
    attention,
    embedding,
    matrix,
    pointwise,
    reduction,
    tensor_ops,
    view,
)

__all__ = ["family_rule"]

_cache: dict[Any, Any] = {}


def family_rule(func: Any) -> Any:
    """The rule of an op without a registered one: ``_foreach_*``, in-place ``_fused_*_``
    optimizer steps and ``pointwise``-tagged ops."""
    if func in _cache:
        return _cache[func]
    name: str = func.overloadpacket.__name__
    rule: Any = None
    if name.startswith("_foreach_"):
        base = name.removeprefix("_foreach_").rstrip("_")
        rule = (reduction.foreach_reduction_rule if base in ("norm", "max")
                else pointwise.foreach_rule)
    elif name.startswith("_fused_") and name.endswith("_"):
        # fused optimizer steps (Adam, AdamW, SGD, Adagrad): elementwise per parameter, like
        # the foreach ops; the step counts are 0-d plain tensors, used as they are
        rule = pointwise.foreach_rule
    elif torch.Tag.pointwise in func.tags:
        rule = pointwise.pointwise_rule
    _cache[func] = rule
    return rule
