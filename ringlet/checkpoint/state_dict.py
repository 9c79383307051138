"""Model and optimizer state dicts that look the same whatever parallelism made the model.

torch's ``torch.distributed.checkpoint.state_dict`` API: keys are clean FQNs (no ``module.``
from DDP), tensors keep the model's sharding (DTensors for fully_shard and TP) unless
``full_state_dict`` gathers them, and optimizer state is keyed by parameter FQN instead of
an integer id, so a checkpoint moves between DDP, fully_shard, TP and 2-d models and
between world sizes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.nn.modules.module import _IncompatibleKeys

from ringlet.checkpoint import _optim_sd
from ringlet.checkpoint._sd_utils import (
    broadcast_leaves,
    clean_fqn,
    global_rank,
    shard_like,
    to_full,
)

__all__ = [
    "StateDictOptions",
    "get_model_state_dict",
    "get_optimizer_state_dict",
    "get_state_dict",
    "set_model_state_dict",
    "set_optimizer_state_dict",
    "set_state_dict",
]


_UNSUPPORTED = "unsupported"


def _option(default: Any, read_by: str) -> Any:
    """A :class:`StateDictOptions` field: its default and the calls that read it."""
    return dataclasses.field(default=default, metadata={"read_by": read_by})


@dataclasses.dataclass(frozen=True)
class StateDictOptions:
    """How the state-dict functions build or read a state dict (torch's fields and defaults).

    Args:
        full_state_dict: gather sharded tensors into full tensors (get), or accept full
            tensors and shard them into the model (set).
        cpu_offload: move tensors to the CPU; with ``full_state_dict`` only rank 0 keeps
            them (the others get an empty dict), so no rank but one holds the whole model.
        ignore_frozen_params: leave out parameters with ``requires_grad=False``.
        keep_submodule_prefixes: accepted for compatibility (``submodules`` is not supported).
        strict: missing or unexpected keys are an error when setting.
        broadcast_from_rank0: (set, with ``full_state_dict``) only rank 0 passes a state dict;
            it is broadcast one tensor at a time and every rank keeps its shard.
        flatten_optimizer_state_dict: not supported (raises).

    Raises:
        ValueError: ``broadcast_from_rank0`` without ``full_state_dict``.
    """

    # torch's field order (positional construction stays compatible); each field says which
    # calls read it, and the unsupported ones are refused from that mark alone.
    full_state_dict: bool = _option(False, "get and set")
    cpu_offload: bool = _option(False, "get")
    ignore_frozen_params: bool = _option(False, "get")
    keep_submodule_prefixes: bool = _option(True, "accepted, unused")
    strict: bool = _option(True, "set")
    broadcast_from_rank0: bool = _option(False, "set")
    flatten_optimizer_state_dict: bool = _option(False, _UNSUPPORTED)
    dsd_fqn_modifiers: str = _option("_fqn_modifiers", "accepted, unused")

    def __post_init__(self) -> None:
        if self.broadcast_from_rank0 and not self.full_state_dict:
            raise ValueError("StateDictOptions: broadcast_from_rank0=True "
                             "expects full_state_dict=True")
        for f in dataclasses.fields(self):
            if f.metadata["read_by"] == _UNSUPPORTED and getattr(self, f.name) != f.default:
                raise NotImplementedError(f"StateDictOptions: {f.name} "
                                          "is not supported by ringlet")


def _options(options: StateDictOptions | None, submodules: Any = None) -> StateDictOptions:
    if submodules is not None:
        raise NotImplementedError("submodules= (deprecated in torch) is not supported; "
                                  "pass the submodule as model")
    if options is not None and not isinstance(options, StateDictOptions):
        raise TypeError(f"options: expected StateDictOptions, got {type(options).__name__}")
    return options or StateDictOptions()


def _model_entries(model: nn.Module, opts: StateDictOptions) -> dict[str, tuple[str, torch.Tensor]]:
    """clean FQN -> (the model's own key, the tensor) for every state dict entry."""
    frozen = ({id(p) for p in model.parameters() if not p.requires_grad}
              if opts.ignore_frozen_params else set())
    out = {}
    for key, value in model.state_dict(keep_vars=True).items():
        if id(value) in frozen:
            continue
        out[clean_fqn(model, key)] = (key, value)
    return out


def get_model_state_dict(model: nn.Module, *, submodules: Any = None,
                         options: StateDictOptions | None = None) -> dict[str, Any]:
    """The model's state dict with clean FQNs; sharded (DTensors) unless ``full_state_dict``.

    Example::

        sd = get_model_state_dict(ddp_model)          # keys without "module."
        full = get_model_state_dict(fsdp_model, options=StateDictOptions(full_state_dict=True,
                                                                         cpu_offload=True))
    """
    opts = _options(options, submodules)
    keep = not (opts.full_state_dict and opts.cpu_offload) or global_rank() == 0
    out = {}
    for fqn, (_, value) in _model_entries(model, opts).items():
        value = value.detach()
        if opts.full_state_dict:
            value = to_full(value, opts.cpu_offload, keep)
        elif opts.cpu_offload:
            value = value.cpu()
        if keep:
            out[fqn] = value
    return out


def set_model_state_dict(model: nn.Module, model_state_dict: dict[str, Any], *,
                         options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """Load ``model_state_dict`` (clean FQNs; sharded, or full with
    ``full_state_dict``) into ``model``.

    With ``full_state_dict``, a model built on the meta device takes copies of the loaded
    tensors as its own (``load_state_dict(..., assign=True)``), as torch's does.

    Returns:
        ``_IncompatibleKeys(missing_keys, unexpected_keys)`` like ``nn.Module.load_state_dict``.

    Raises:
        RuntimeError: with ``strict``, when keys are missing or unexpected (listed).
    """
    opts = _options(options)
    entries = _model_entries(model, opts)
    source = broadcast_leaves(model_state_dict) if opts.broadcast_from_rank0 else (
        ((k,), v) for k, v in (model_state_dict or {}).items())
    renamed: dict[str, Any] = {}
    unexpected = []
    for path, value in source:
        fqn = ".".join(str(p) for p in path)
        if fqn not in entries:
            unexpected.append(fqn)
            continue
        key, like = entries[fqn]
        renamed[key] = shard_like(like, value) if isinstance(value, torch.Tensor) else value
    missing = [fqn for fqn, (key, _) in entries.items() if key not in renamed]
    if opts.strict and (missing or unexpected):
        raise RuntimeError(f"set_model_state_dict: missing keys {missing}, "
                           f"unexpected keys {unexpected}")
    # A model built on the meta device has no storage to copy a full state dict into (copy_
    # would be a silent no-op): as torch does, the loaded tensors become the model's own
    # (assign), as copies, so that the model never aliases the caller's state dict.
    assign = opts.full_state_dict and any(
        v.is_meta for _, v in entries.values() if isinstance(v, torch.Tensor))
    if assign:
        renamed = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
                   for k, v in renamed.items()}
    with torch.no_grad():
        model.load_state_dict(renamed, strict=False, assign=assign)
    return _IncompatibleKeys(missing, unexpected)


def _optimizers(optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer],
                ) -> list[torch.optim.Optimizer]:
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    out = list(optimizers)
    if not all(isinstance(o, torch.optim.Optimizer) for o in out):
        raise TypeError("optimizers: expected a torch.optim.Optimizer or an iterable of them")
    return out


def get_optimizer_state_dict(model: nn.Module, optimizers: Any, *, submodules: Any = None,
                             options: StateDictOptions | None = None) -> dict[str, Any]:
    """The optimizers' state keyed by parameter FQN: ``{"state": {fqn: {...}},
    "param_groups": [...]}``.

    An optimizer that has not stepped yet gets its state created first (a step with zero
    gradients and learning rate 0, as torch does), so that ``load`` has tensors to fill.
    """
    opts = _options(options, submodules)
    return _optim_sd.get(model, _optimizers(optimizers), opts)


def set_optimizer_state_dict(model: nn.Module, optimizers: Any, optim_state_dict: dict[str, Any], *,
                             options: StateDictOptions | None = None) -> None:
    """Load an FQN-keyed optimizer state dict (sharded, or full with ``full_state_dict``)."""
    opts = _options(options)
    _optim_sd.set_(model, _optimizers(optimizers), optim_state_dict, opts)


def _init_optim_state(optim: torch.optim.Optimizer) -> None:
    """Create ``optim``'s state (Adam's ``exp_avg``, ``step``, ...) without moving a parameter.

    torch's private helper of this name, kept under it because published scripts import it
    (pytorch/examples' FSDP2 checkpointer builds a sharded optimizer state dict to fill from
    a full one).  As torch's: nothing happens when the optimizer has state already or a
    parameter holds a gradient (a step is coming that creates it); otherwise one step with
    zero gradients and learning rate 0, after which the gradients are ``None`` again.

    Example::

        _init_optim_state(optim)
        state = optim.state_dict()["state"]      # one entry per parameter, ready to fill
    """
    params = [p for group in optim.param_groups for p in group["params"]]
    if optim.state or any(p.grad is not None for p in params):
        return
    _optim_sd.init_state(optim)


def get_state_dict(model: nn.Module, optimizers: Any, *, submodules: Any = None,
                   options: StateDictOptions | None = None,
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(get_model_state_dict(model), get_optimizer_state_dict(model, optimizers))``.

    Example::

        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id="ckpt")
    """
    opts = _options(options, submodules)
    return (get_model_state_dict(model, options=opts),
            get_optimizer_state_dict(model, optimizers, options=opts))


def set_state_dict(model: nn.Module, optimizers: Any, *, model_state_dict: dict[str, Any],
                   optim_state_dict: dict[str, Any],
                   options: StateDictOptions | None = None) -> _IncompatibleKeys:
    """``set_model_state_dict`` then ``set_optimizer_state_dict``; returns the
    model's incompatible keys."""
    opts = _options(options)
    keys = set_model_state_dict(model, model_state_dict, options=opts)
    set_optimizer_state_dict(model, optimizers, optim_state_dict, options=opts)
    return keys
