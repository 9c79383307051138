"""``distribute_module``: turn a module's parameters and buffers into DTensors, hook its I/O."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn

from ringlet._compile import compiler_disable
from ringlet.dtensor._api import DTensor, default_mesh, distribute_tensor
from ringlet.dtensor.placements import Replicate
from ringlet.mesh import DeviceMesh

__all__ = ["distribute_module"]


def distribute_module(module: nn.Module, device_mesh: DeviceMesh | None = None,
                      partition_fn: Callable[[str, nn.Module, DeviceMesh], None] | None = None,
                      input_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
                      output_fn: Callable[[nn.Module, Any, DeviceMesh], Any] | None = None,
                      ) -> nn.Module:
    """Distribute ``module``'s parameters and buffers over ``device_mesh`` (in place; returns it).

    Args:
        module: the module (every rank passes the same structure and shapes).
        device_mesh: the mesh (default: a 1-d mesh of the whole world).
        partition_fn: ``partition_fn(name, submodule, mesh)`` is called for every submodule
            (``module.named_modules()``) to replace its parameters with DTensors of the
            layout it wants; whatever it leaves as a plain tensor is then replicated.
            Default: replicate everything.  Replication takes rank 0's values.
        input_fn: ``input_fn(module, inputs, mesh)``, run before each forward (a forward
            pre-hook); its return value, if not None, replaces the inputs.
        output_fn: ``output_fn(module, outputs, mesh)``, run after each forward (a forward
            hook); its return value, if not None, replaces the outputs.

    Raises:
        RuntimeError: the module was distributed already.

    Example::

        def shard_rows(name, mod, mesh):
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(p, mesh, [Shard(0)])))

        model = distribute_module(model, mesh, shard_rows)
    """
    if getattr(module, "_distribute_module_applied", False):
        raise RuntimeError("distribute_module: expected a module not distributed yet, got "
                           f"{type(module).__name__} which already was")
    mesh = device_mesh if device_mesh is not None else default_mesh()
    for name, sub in module.named_modules():
        if partition_fn is not None:
            partition_fn(name, sub, mesh)
        _replicate_rest(sub, mesh)
    # The hooks move data between ranks: under torch.compile they run eagerly (graph breaks).
    if input_fn is not None:
        module.register_forward_pre_hook(
            compiler_disable(lambda mod, inputs: input_fn(mod, inputs, mesh)))
    if output_fn is not None:
        module.register_forward_hook(
            compiler_disable(lambda mod, inputs, outputs: output_fn(mod, outputs, mesh)))
    module._distribute_module_applied = True  # type: ignore[assignment]
    return module


def _replicate_rest(sub: nn.Module, mesh: DeviceMesh) -> None:
    """Replace the plain parameters and buffers of ``sub`` (not its children)
    with Replicate DTensors."""
    rep = [Replicate()] * mesh.ndim
    for name, p in list(sub._parameters.items()):
        if p is not None and not isinstance(p, DTensor):
            sub.register_parameter(name, nn.Parameter(distribute_tensor(p.data, mesh, rep),
                                                      requires_grad=p.requires_grad))
    for name, b in list(sub._buffers.items()):
        if b is not None and not isinstance(b, DTensor):
            persistent = name not in sub._non_persistent_buffers_set
            sub.register_buffer(name, distribute_tensor(b, mesh, rep), persistent=persistent)



