"""Shared pieces of the parallel styles: turning module inputs/outputs into DTensors of a layout,
and keeping a parameter's gradient in the parameter's own layout.

[Note: TP gradient layouts]
A parameter's gradient need not come out of backward in the parameter's layout: a
``Replicate`` norm weight under sequence parallelism gets a ``Partial`` gradient (every
rank summed its own rows), a row-split embedding table gets a ``Replicate`` one.  Left
like that, every optimizer op that reads the gradient would reduce it again.  So each
parameter a style creates gets a post-accumulate-grad hook that redistributes the
finished gradient once to the parameter's placements: ``P -> R`` is the one all-reduce
Megatron also spends on such weights, ``R -> S`` is local.  The hook runs after
accumulation, so gradient accumulation over micro-batches sums in whatever layout
autograd produced and converts once per accumulation step.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ringlet.dtensor import DTensor, Placement, Shard, distribute_tensor
from ringlet.mesh import DeviceMesh

__all__ = ["as_layout", "check_mesh", "distribute_param", "grad_to_param_layout", "to_output"]


def as_layout(x: Any, mesh: DeviceMesh, given: Placement | None, desired: Placement | None,
              global_shape: Sequence[int] | None = None) -> Any:
    """A module input as a DTensor laid out ``desired``.

    A plain tensor is this rank's piece laid out ``given`` (``from_local``, no communication;
    ``global_shape`` when shards may be uneven); a DTensor keeps its own layout.  Then it is
    redistributed to ``desired`` if it differs.  ``given is None``: ``x`` is returned as is.
    """
    if given is None:
        return x
    if not isinstance(x, DTensor):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"expected a torch.Tensor or DTensor input for layout {given!r}, "
                            f"got {type(x).__name__}")
        x = DTensor.from_local(x, mesh, (given,), shape=global_shape)
    if desired is not None and tuple(x.placements) != (_resolve(desired, x.dim()),):
        x = x.redistribute(mesh, (desired,))
    return x


def _resolve(p: Placement, ndim: int) -> Placement:
    """``Shard(-1)`` of a 3-d tensor is ``Shard(2)`` (placements compare resolved)."""
    return Shard(p.dim % ndim) if isinstance(p, Shard) and p.dim < 0 and ndim > 0 else p


def to_output(out: Any, mesh: DeviceMesh, layout: Placement, use_local: bool) -> Any:
    """A module output redistributed to ``layout`` (if a DTensor), then local if asked."""
    if not isinstance(out, DTensor):
        return out
    if tuple(out.placements) != (_resolve(layout, out.dim()),):
        out = out.redistribute(mesh, (layout,))
    return out.to_local() if use_local else out


def distribute_param(module: nn.Module, name: str, mesh: DeviceMesh, placement: Placement,
                     src_data_rank: int | None, *, from_local: bool = False) -> None:
    """Replace ``module.<name>`` by a DTensor Parameter laid out ``placement`` (with the
    gradient hook of [Note: TP gradient layouts]).

    ``from_local``: every rank already holds the whole value (no broadcast; what
    ``SequenceParallel`` does with norm weights, which all ranks initialize alike).
    """
    param = module._parameters[name]
    if param is None or isinstance(param, DTensor):
        return
    if from_local:
        dt = DTensor.from_local(param.detach(), mesh, (placement,), run_check=False)
    else:
        dt = distribute_tensor(param.detach(), mesh, (placement,), src_data_rank=src_data_rank)
    new = nn.Parameter(dt, requires_grad=param.requires_grad)
    if new.requires_grad:
        new.register_post_accumulate_grad_hook(grad_to_param_layout)
    module.register_parameter(name, new)


def grad_to_param_layout(param: torch.Tensor) -> None:
    """Post-accumulate-grad hook: the gradient in the parameter's placements ([Note:
    TP gradient layouts])."""
    grad = param.grad
    if (isinstance(grad, DTensor) and isinstance(param, DTensor)
            and grad.placements != param.placements):
        with torch.no_grad():
            param.grad = grad.redistribute(param.device_mesh, param.placements)


def check_mesh(mesh: object, op: str) -> DeviceMesh:
    """Tensor parallelism runs on a 1-d mesh (slice an n-d one: ``mesh["tp"]``)."""
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"{op}: device_mesh: expected a DeviceMesh, got {type(mesh).__name__}")
    if mesh.ndim != 1:
        raise ValueError(f"{op}: device_mesh: expected a 1-d mesh, got {mesh!r}; slice the "
                         "tensor-parallel axis first, e.g. mesh['tp']")
    return mesh
