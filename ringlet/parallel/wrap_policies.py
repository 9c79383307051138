"""torch's auto-wrap policies (``torch.distributed.fsdp.wrap``): which submodules to wrap.

A policy is called as ``policy(module=m, recurse=..., nonwrapped_numel=n)``: with
``recurse=True`` it answers whether to look inside ``m`` (``n``: all of ``m``'s parameter
elements), with ``recurse=False`` whether to wrap ``m`` itself (``n``: its parameter elements
not already inside a wrapped submodule).  ringlet uses them in
``apply_activation_checkpointing(model, auto_wrap_policy=...)``; ringlet has no FSDP1 wrapper
to auto-wrap (``fully_shard`` is applied by hand, bottom-up).

Example::

    policy = ModuleWrapPolicy({TransformerBlock})
    apply_activation_checkpointing(model, auto_wrap_policy=policy)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import nn

__all__ = ["CustomPolicy", "ModuleWrapPolicy", "always_wrap_policy", "lambda_auto_wrap_policy",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy"]


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Wrap every module (and look inside every one)."""
    return True


def lambda_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                            lambda_fn: Callable[[nn.Module], bool]) -> bool:
    """Wrap the modules for which ``lambda_fn(module)`` is true; look inside every one."""
    return True if recurse else bool(lambda_fn(module))


def transformer_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                 transformer_layer_cls: Iterable[type[nn.Module]]) -> bool:
    """Wrap the instances of ``transformer_layer_cls`` (e.g. ``{Block}``, use with
    ``functools.partial``); look inside every module."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def size_based_auto_wrap_policy(module: nn.Module, recurse: bool, nonwrapped_numel: int,
                                min_num_params: int = int(1e8),
                                force_leaf_modules: set[type[nn.Module]] | None = None,
                                exclude_wrap_modules: set[type[nn.Module]] | None = None) -> bool:
    """Wrap a module once at least ``min_num_params`` of its parameter elements are not yet
    inside a wrapped submodule; never look inside ``force_leaf_modules`` (default
    ``{nn.MultiheadAttention}``), never wrap ``exclude_wrap_modules`` (default ``{nn.ModuleList,
    nn.ModuleDict}``)."""
    # the defaults are attributes of this function (set below), read at each call as in torch,
    # where callers may replace them (a function's type declares no such attributes: hence Any)
    defaults: Any = size_based_auto_wrap_policy
    leaves = tuple(defaults.FORCE_LEAF_MODULES if force_leaf_modules is None
                   else force_leaf_modules)
    excluded = tuple(defaults.EXCLUDE_WRAP_MODULES if exclude_wrap_modules is None
                     else exclude_wrap_modules)
    big = nonwrapped_numel >= min_num_params
    if recurse:
        return big and not isinstance(module, leaves)
    return big and not isinstance(module, excluded)


size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {  # type: ignore[attr-defined]
    nn.ModuleList, nn.ModuleDict}


class ModuleWrapPolicy:
    """Wrap the instances of ``module_classes``; look inside every module.

    Args:
        module_classes: module types, e.g. ``{TransformerBlock}``.
    """

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        classes = tuple(module_classes)
        if not all(isinstance(c, type) and issubclass(c, nn.Module) for c in classes):
            raise TypeError("ModuleWrapPolicy: module_classes: expected nn.Module subclasses, "
                            f"got {classes!r}")
        self._module_classes = classes

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({[c.__name__ for c in self._module_classes]})"


class CustomPolicy:
    """Wrap the modules for which ``lambda_fn(module)`` is truthy (torch lets it return a dict
    of wrapper arguments; any non-empty dict counts as true here); look inside every module."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        if not callable(lambda_fn):
            raise TypeError("CustomPolicy: lambda_fn: expected a callable, got "
                            f"{type(lambda_fn).__name__}")
        self._lambda_fn = lambda_fn

    def __call__(self, module: nn.Module, recurse: bool, *args: Any, **kwargs: Any) -> bool:
        return True if recurse else bool(self._lambda_fn(module))
