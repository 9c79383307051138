"""State dicts and re-materialisation of fully_shard modules.

- ``state_dict()`` returns the sharded DTensors: a pre-hook reshards an idle group that was
  left unsharded (``reshard_after_forward=False`` after an eval forward).
- ``load_state_dict`` accepts DTensors (copied shard to shard) or full tensors: a pre-hook
  replaces each full tensor by this rank's shard of it, so nothing is communicated.  With
  ``assign=True`` nn.Module registers new Parameter objects; the post-hook copies them into
  the group's shard buffer and registers the group's own DTensors again (one object per tied
  parameter, local tensors aliasing the shard buffer, [Note: aliasing] in ``_param``).
- ``module._apply`` (``to_empty``, ``to(dtype)``, ``double()``): the managed parameters are
  hidden from nn.Module's own ``_apply`` and the conversion is applied to the flat shard
  buffer instead, after which the DTensors are rebuilt over the new buffer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ringlet.dtensor import DTensor
from ringlet.parallel.fsdp._param_group import FSDPParamGroup
from ringlet.parallel.fsdp._state import FSDPState, TrainingState

__all__ = ["apply_to_group", "register_state_dict_hooks"]


def register_state_dict_hooks(module: nn.Module, state: FSDPState) -> None:
    module.register_state_dict_pre_hook(lambda m, prefix, keep_vars: _pre_state_dict(state))
    module._register_load_state_dict_pre_hook(
        lambda m, sd, prefix, *rest: _pre_load(state, sd, prefix, m), with_module=True)
    module.register_load_state_dict_post_hook(lambda m, incompatible: _post_load(state))


def _pre_state_dict(state: FSDPState) -> None:
    if state.group is not None and state.training_state is TrainingState.IDLE:
        state.group.reshard()


def _pre_load(state: FSDPState, sd: dict[str, Any], prefix: str, module: nn.Module) -> None:
    group = state.group
    if group is None:
        return
    group.finish_reduce()
    group.reshard()
    for p in group.params:
        if p.home is not None and p.home is not module:
            continue            # grouped fully_shard([a, b]): b's hook handles b's parameters
        placements = tuple(p.dtensor_placements)
        for fqn in p.fqns:
            key = prefix + fqn
            value = sd.get(key)
            if not isinstance(value, torch.Tensor):
                continue
            if isinstance(value, DTensor):
                if tuple(value.placements) == placements and value.device_mesh == p.dtensor_mesh:
                    continue
                value = value.full_tensor()
            if tuple(value.shape) != p.global_shape:
                continue        # nn.Module reports the size mismatch with its own message
            sd[key] = p.to_dtensor(p.shard_of_full(value.detach()))


def _post_load(state: FSDPState) -> None:
    if state.group is not None:
        state.group._sync_registration()


def apply_to_group(module: nn.Module, group: FSDPParamGroup,
                   fn: Callable[[torch.Tensor], torch.Tensor],
                   super_apply: Callable[[], Any]) -> Any:
    """Run nn.Module's ``_apply`` with the managed parameters hidden, then
    convert the shard buffer."""
    group.finish_reduce()
    group.reshard()
    group._sync_registration()
    hidden = [(m, n) for p in group.params for m, n in p.owners]
    for m, n in hidden:     # None entries keep the dict's order and are skipped by _apply
        m._parameters[n] = None
    try:
        result = super_apply()
    finally:
        for p in group.params:
            p.register(p.sharded_param)
    group.apply_fn(fn)
    return result
