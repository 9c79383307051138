"""Optimizer state dicts keyed by parameter FQN (the ``state_dict`` API's optimizer half).

``torch.optim.Optimizer.state_dict()`` numbers parameters ``0, 1, ...`` in the order of
its param groups; those numbers mean nothing to another model layout.  Here they are
replaced by the parameters' clean FQNs (``{"state": {"fc.weight": {...}}, "param_groups":
[{..., "params": ["fc.weight", ...]}]}``), and mapped back when loading by matching the
current optimizer's parameters to those names.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from ringlet.checkpoint._flatten import tree_from_paths
from ringlet.checkpoint._sd_utils import (
    broadcast_leaves,
    global_rank,
    param_fqns,
    shard_like,
    to_full,
)
from ringlet.parallel.ddp import _tp

__all__ = ["get", "init_state", "set_"]


def _ordered_params(optim: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optim.param_groups for p in group["params"]]


def init_state(optim: torch.optim.Optimizer) -> None:
    """Create an optimizer's state without changing its parameters: one step with zero
    gradients and every learning rate set to 0 (gradients and rates restored after)."""
    if optim.state:
        return
    params = [p for p in _ordered_params(optim) if p.requires_grad]
    grads = [p.grad for p in params]
    lrs = [g.get("lr") for g in optim.param_groups]
    try:
        for p in params:
            p.grad = torch.zeros_like(p)
        for g in optim.param_groups:
            if "lr" in g:
                g["lr"] = torch.zeros_like(g["lr"]) if isinstance(g["lr"], torch.Tensor) else 0.0
        optim.step()
    finally:
        for p, grad in zip(params, grads, strict=True):
            p.grad = grad
        for g, lr in zip(optim.param_groups, lrs, strict=True):
            if lr is not None:
                g["lr"] = lr


def _names(model: nn.Module, optim: torch.optim.Optimizer) -> list[str]:
    fqns = param_fqns(model)
    out = []
    for p in _ordered_params(optim):
        view = _tp.dp_view(p)      # DDP over TP: the local piece of a DTensor parameter
        name = fqns.get(id(p), fqns.get(id(view)) if view is not None else None)
        if name is None:
            raise ValueError("optimizer holds a parameter of shape "
                             f"{list(p.shape)} that is not in the model")
        out.append(name)
    return out


def get(model: nn.Module, optimizers: list[torch.optim.Optimizer], opts: Any) -> dict[str, Any]:
    state: dict[str, Any] = {}
    groups: list[dict[str, Any]] = []
    keep = not (opts.full_state_dict and opts.cpu_offload) or global_rank() == 0
    for optim in optimizers:
        init_state(optim)
        names = _names(model, optim)
        osd = optim.state_dict()
        params = _ordered_params(optim)
        for idx, per_param in osd["state"].items():
            state[names[idx]] = {k: _convert(_tp.local_state_to_view(params[idx], v), opts, keep)
                                 for k, v in per_param.items()}
        for g in osd["param_groups"]:
            groups.append({**{k: v for k, v in g.items() if k != "params"},
                           "params": [names[i] for i in g["params"]]})
    return {"state": state, "param_groups": groups} if keep else {}


def _convert(value: Any, opts: Any, keep: bool) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    if opts.full_state_dict:
        return to_full(value, opts.cpu_offload, keep)
    return value.cpu() if opts.cpu_offload else value


def _received(optim_state_dict: Any, opts: Any) -> dict[str, Any]:
    """The state dict to load on this rank (rank 0's, streamed, with ``broadcast_from_rank0``)."""
    if not opts.broadcast_from_rank0:
        return optim_state_dict
    return tree_from_paths(list(broadcast_leaves(optim_state_dict if global_rank() == 0 else None)))


def set_(model: nn.Module, optimizers: list[torch.optim.Optimizer],
         optim_state_dict: dict[str, Any], opts: Any) -> None:
    osd = _received(optim_state_dict, opts)
    saved_state = osd.get("state", {})
    saved_groups = osd.get("param_groups", [])
    for optim in optimizers:
        names = _names(model, optim)
        params = _ordered_params(optim)
        state = {}
        for i, (name, p) in enumerate(zip(names, params, strict=True)):
            if name in saved_state:
                like = _tp.dp_view(p)
                like = p if like is None else like
                state[i] = {k: _tp.view_state_to_local(p, shard_like(like, v))
                            if isinstance(v, torch.Tensor) else copy.deepcopy(v)
                            for k, v in saved_state[name].items()}
        groups, start = [], 0
        for g in optim.param_groups:
            n = len(g["params"])
            mine = names[start:start + n]
            saved = next((sg for sg in saved_groups if mine and mine[0] in sg["params"]), None)
            if saved is None:
                raise ValueError(f"set_optimizer_state_dict: no saved param group holds {mine[:1]}")
            groups.append({**{k: v for k, v in saved.items() if k != "params"},
                           "params": list(range(start, start + n))})
            start += n
        optim.load_state_dict({"state": state, "param_groups": groups})

