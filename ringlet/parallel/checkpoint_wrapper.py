"""Activation checkpointing and offloading as module wrappers (torch's ``checkpoint_wrapper``).

``checkpoint_wrapper(block)`` returns a module that runs ``block`` under
``torch.utils.checkpoint.checkpoint``: its activations are not kept for backward but recomputed
there, trading compute for memory.  ``offload_wrapper(block)`` keeps them, in CPU memory
(``torch.autograd.graph.save_on_cpu``).  ``apply_activation_checkpointing(model, check_fn=...)``
wraps, in place, every submodule that ``check_fn`` selects.

[Note: checkpoint wrappers are invisible in names]
A wrapper holds its module as the child ``_checkpoint_wrapped_module``, so the module tree gains a
level.  Checkpoints must not see it: ``state_dict()`` drops that level from every key and
``load_state_dict()`` puts it back (a state dict saved from the unwrapped model loads into the
wrapped one and back), and the wrapper's own ``named_parameters()`` drops it too.  Attributes the
wrapper does not have are looked up on the wrapped module (``wrapper.weight``).  Works with DDP and
``fully_shard`` (wrap first, then shard the wrapped blocks or the wrappers): in backward the
recomputation runs the block's forward again, which re-gathers fully_shard's parameters.
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.utils.checkpoint
from torch import nn

__all__ = ["ActivationWrapper", "CheckpointImpl", "CheckpointWrapper", "OffloadWrapper",
           "apply_activation_checkpointing", "checkpoint_wrapper", "offload_wrapper"]

WRAPPED = "_checkpoint_wrapped_module"
_LEVEL = WRAPPED + "."


class CheckpointImpl(enum.Enum):
    """Which ``torch.utils.checkpoint`` implementation a :class:`CheckpointWrapper` uses."""

    REENTRANT = enum.auto()
    NO_REENTRANT = enum.auto()


class ActivationWrapper(nn.Module):
    """Base of the wrappers: holds ``module``, hides the extra level from names (see
    [Note: checkpoint wrappers are invisible in names]) and forwards unknown attributes."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"{type(self).__name__}: module: expected an nn.Module, got "
                            f"{type(module).__name__}")
        setattr(self, WRAPPED, module)
        self.register_state_dict_post_hook(_drop_level)
        self.register_load_state_dict_pre_hook(_add_level)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"{type(self).__name__} is a base class: use "
                                  "CheckpointWrapper or OffloadWrapper")

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == WRAPPED:
                raise
            return getattr(getattr(self, WRAPPED), name)

    def __getitem__(self, index: Any) -> Any:
        return getattr(self, WRAPPED).__getitem__(index)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        for name, p in super().named_parameters(*args, **kwargs):
            yield name.replace(_LEVEL, ""), p


def _drop_level(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                local_metadata: Any) -> None:
    """``state_dict`` post-hook: ``<prefix>_checkpoint_wrapped_module.x`` -> ``<prefix>x``."""
    inner = prefix + _LEVEL
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner):]] = state_dict.pop(key)


def _add_level(module: nn.Module, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: ``<prefix>x`` -> ``<prefix>_checkpoint_wrapped_module.x``
    (keys that already have the level are left alone)."""
    inner = prefix + _LEVEL
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix):]] = state_dict.pop(key)


class CheckpointWrapper(ActivationWrapper):
    """Runs ``module`` under activation checkpointing (see :func:`checkpoint_wrapper`)."""

    def __init__(self, mod: nn.Module,
                 checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                 checkpoint_fn: Callable[..., Any] | None = None,
                 **checkpoint_fn_kwargs: Any) -> None:
        super().__init__(mod)
        if not isinstance(checkpoint_impl, CheckpointImpl):
            raise TypeError("CheckpointWrapper: checkpoint_impl: expected a CheckpointImpl, got "
                            f"{checkpoint_impl!r}")
        self.checkpoint_impl = checkpoint_impl
        if checkpoint_fn is None:
            checkpoint_fn = torch.utils.checkpoint.checkpoint
            checkpoint_fn_kwargs = {"use_reentrant": checkpoint_impl is CheckpointImpl.REENTRANT,
                                    **checkpoint_fn_kwargs}
        elif not callable(checkpoint_fn):
            raise TypeError("CheckpointWrapper: checkpoint_fn: expected a callable, got "
                            f"{type(checkpoint_fn).__name__}")
        self.checkpoint_fn = functools.partial(checkpoint_fn, **checkpoint_fn_kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        module = getattr(self, WRAPPED)
        if self.checkpoint_impl is not CheckpointImpl.REENTRANT or not kwargs:
            return self.checkpoint_fn(module, *args, **kwargs)
        # the reentrant implementation takes positional inputs only: pass the keyword
        # arguments' values positionally and rebuild them inside
        keys, n = tuple(kwargs), len(args)

        def run(*inputs: Any) -> Any:
            return module(*inputs[:n], **dict(zip(keys, inputs[n:])))
        return self.checkpoint_fn(run, *args, *kwargs.values())


class OffloadWrapper(ActivationWrapper):
    """Runs ``module`` with its saved activations kept in CPU memory (see
    :func:`offload_wrapper`)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with torch.autograd.graph.save_on_cpu(pin_memory=True):
            return getattr(self, WRAPPED)(*args, **kwargs)


def checkpoint_wrapper(module: nn.Module,
                       checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
                       checkpoint_fn: Callable[..., Any] | None = None,
                       **checkpoint_fn_kwargs: Any) -> nn.Module:
    """Wrap ``module`` so that every call recomputes its activations in backward.

    Args:
        module: the module to wrap.
        checkpoint_impl: ``CheckpointImpl.NO_REENTRANT`` (default, ``use_reentrant=False``) or
            ``REENTRANT``; ignored with ``checkpoint_fn``.  Keyword arguments of the module's
            forward work with both.
        checkpoint_fn: a checkpoint function to use instead of ``torch.utils.checkpoint.checkpoint``
            (called as ``checkpoint_fn(module, *args, **checkpoint_fn_kwargs, **kwargs)``).
        **checkpoint_fn_kwargs: passed to the checkpoint function (e.g. ``preserve_rng_state``).

    Returns:
        A :class:`CheckpointWrapper`; its state dict and ``named_parameters()`` have the wrapped
        module's names.

    Example::

        block = checkpoint_wrapper(TransformerBlock())
        y = block(x)            # activations of block are recomputed in backward
    """
    return CheckpointWrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def offload_wrapper(module: nn.Module) -> nn.Module:
    """Wrap ``module`` so that the activations it saves for backward live in CPU memory (pinned
    when CUDA is available) until backward needs them.

    Example::

        block = offload_wrapper(block)
    """
    return OffloadWrapper(module)


def apply_activation_checkpointing(
        model: nn.Module,
        checkpoint_wrapper_fn: Callable[[nn.Module], nn.Module] = checkpoint_wrapper,
        check_fn: Callable[[nn.Module], bool] = lambda _: True,
        auto_wrap_policy: Callable[..., bool] | None = None) -> None:
    """Wrap, in place, the submodules of ``model`` that are selected (never ``model`` itself).

    Args:
        model: the model to change.
        checkpoint_wrapper_fn: ``module -> wrapper``: :func:`checkpoint_wrapper` (default),
            :func:`offload_wrapper`, or e.g. ``functools.partial(checkpoint_wrapper,
            checkpoint_impl=CheckpointImpl.REENTRANT)``.
        check_fn: ``module -> bool``, whether to wrap it (e.g. ``lambda m: isinstance(m, Block)``).
        auto_wrap_policy: instead of ``check_fn``, a policy with torch's wrap-policy signature,
            called as ``auto_wrap_policy(module=m, recurse=False, nonwrapped_numel=n)`` where
            ``n`` counts the parameters of ``m`` not inside an already selected submodule.

    Submodules are visited as torch does: the policy is first asked (``recurse=True``) whether
    to look inside a module, then its children are visited, then it is asked (``recurse=False``)
    whether to wrap the module itself; a selected module inside another selected one is wrapped
    too (the outer wrapper then holds the inner one).

    Example::

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    """
    if not isinstance(model, nn.Module):
        raise TypeError("apply_activation_checkpointing: model: expected an nn.Module, got "
                        f"{type(model).__name__}")
    def select(m: nn.Module, numel: int, recurse: bool) -> bool:
        if auto_wrap_policy is not None:
            return bool(auto_wrap_policy(module=m, recurse=recurse, nonwrapped_numel=numel))
        return recurse or bool(check_fn(m))
    _visit(model, checkpoint_wrapper_fn, select, root=True)


def _visit(module: nn.Module, wrap: Callable[[nn.Module], nn.Module],
           select: Callable[[nn.Module, int, bool], bool], root: bool = False) -> tuple[Any, int]:
    """Torch's order: ask ``select(module, numel, recurse=True)`` whether to look inside
    ``module`` (no: leave it, wrapping nothing); if so visit its children, then ask
    ``select(module, numel not inside a wrapped child, recurse=False)`` whether to wrap it
    (never the root).  Returns the module (or its wrapper) and how many of its parameter
    elements ended up inside wrappers."""
    total = sum(p.numel() for p in module.parameters())
    if not select(module, total, True):
        return module, 0
    inside = 0
    for name, child in list(module.named_children()):
        new, n = _visit(child, wrap, select)
        if new is not child:
            setattr(module, name, new)
        inside += n
    if not root and select(module, total - inside, False):
        return wrap(module), total
    return module, inside
