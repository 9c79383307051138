"""DDP over a model whose parameters are DTensors: tensor parallelism inside,
data parallelism across.

On a 2-d mesh ``(dp, tp)`` a tensor-parallel model holds DTensor parameters sharded or
replicated along ``tp``; DDP along ``dp`` must average each rank's *piece* with the ranks that
hold the same piece.  :func:`_pre_dp_module_transform` makes that work without DDP knowing
about DTensors:

- every DTensor parameter is replaced, on every module that registers it, by an
  ``nn.Parameter`` of its local tensor (same storage) that remembers the DTensor's layout in
  ``_st_info``: DDP sees (verifies, broadcasts, buckets, all-reduces) plain local tensors;
- a forward pre-hook registers, in their place, DTensors rebuilt around those local
  parameters (:func:`~ringlet.parallel._data_parallel_utils._unflatten_tensor`), so the model
  computes with DTensors and their gradients land in the local parameters' ``.grad``;
- a forward hook registers, outside forward, the module's DTensor parameters again (the
  objects it had before the transform, sharing storage with the local parameters), so the
  module reads as the tensor-parallel model it is: ``named_parameters()`` gives DTensors of the
  global shape, and after each backward their ``.grad`` is the DTensor of the local gradient
  DDP reduced (same storage).  A ``.grad`` set or cleared on the DTensor parameter (an
  optimizer built over them, ``zero_grad``) reaches the local parameter at the next forward;
  the local parameters (the objects DDP and an optimizer built before the first forward hold)
  stay valid throughout (see below);
- ``state_dict()`` returns those entries as DTensors (sharing the local storage), and
  ``load_state_dict`` takes DTensors or full tensors for them, so checkpoints hold the 2-d
  layout.

What the module holds after forward, here and under torch: torch's transform registers the
rebuilt DTensors as plain attributes before forward, and its forward hook then finds no DTensor
parameter to localise: after the first forward the module's ``named_parameters()`` no longer
lists the tensor-parallel weights at all (``state_dict()`` loses them, an optimizer built then
silently skips them), while ``module.net1.weight`` reads as a DTensor of the global shape with
no gradient. ringlet keeps what a caller can see of that state -- attribute reads give DTensors
of the global shape -- and keeps them listed: they are the module's original DTensor parameters,
whose gradients mirror the local ones. A test comparing ``named_parameters()`` and their
gradients with a dense one-process model therefore compares every tensor-parallel weight, where
under torch it compares none.

:class:`DistributedDataParallel` applies the transform by itself when the module has DTensor
parameters (torch does it when ``device_mesh`` is a slice of a larger mesh), after checking
that every rank of its group holds the same piece of each (:func:`check_dp_orthogonal`).

The function names are torch's private ones (``torch.distributed.tensor.parallel.ddp``),
mirrored at ``ringlet.distributed.tensor.parallel.ddp``.

Example::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    parallelize_module(model, mesh["tp"], plan)                   # DTensor parameters on "tp"
    ddp = DistributedDataParallel(model, device_mesh=mesh["dp"])  # averages over "dp"
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ringlet.dtensor import DTensor, Replicate
from ringlet.dtensor._api import make_dtensor
from ringlet.parallel._data_parallel_utils import _flatten_tensor, _unflatten_tensor

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = [
    "_get_submodule_n_params",
    "_localize_dtensor",
    "_pre_dp_module_transform",
    "_reconstruct_dtensor",
    "_update_module_param",
    "check_dp_orthogonal",
    "dp_view",
    "has_dtensor_params",
    "local_state_to_view",
    "view_state_to_local",
]

_MARK = "_ringlet_dp_transformed"       # set on a module once _pre_dp_module_transform ran


def _get_submodule_n_params(module: nn.Module, path: str) -> tuple[nn.Module, str]:
    """``(owning submodule, attribute name)`` of the parameter at dotted ``path``."""
    parent, _, name = path.rpartition(".")
    return (module.get_submodule(parent) if parent else module), name


def _update_module_param(param_list: Iterable[tuple[nn.Module, str, torch.Tensor]]) -> None:
    """Register each ``(module, name, tensor)`` as that module's parameter ``name``.

    Any tensor may stand there (a rebuilt DTensor during forward), like fully_shard's swaps.

    Raises:
        AttributeError: ``module`` has no parameter ``name``.
    """
    for module, name, t in param_list:
        if name not in module._parameters:
            raise AttributeError(f"_update_module_param: expected {type(module).__name__} to have "
                                 f"a parameter {name!r}, got none")
        module._parameters[name] = t  # type: ignore[assignment]


def _registered(module: nn.Module) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """Every (owner, name, tensor) registration under ``module``, tied parameters once per owner."""
    return [(m, n, t) for m in module.modules() for n, t in m._parameters.items() if t is not None]


def _reconstruct_dtensor(module: nn.Module, _input: Any = None) -> None:
    """Forward pre-hook: register DTensors rebuilt around the local parameters (see
    the module docstring), after taking over a gradient set on the DTensor parameters."""
    built: dict[int, torch.Tensor] = {}
    updates = []
    for m, name, t in _registered(module):
        local = getattr(t, "_dp_local", t)         # a DTensor parameter or a rebuilt one
        spec = getattr(local, "_st_info", None)
        if spec is None:
            continue
        dt = built.get(id(local))
        if dt is None:
            _pull_grad(local)
            dt = built[id(local)] = _unflatten_tensor(local, spec)
            dt._dp_local = local  # type: ignore[attr-defined]
        updates.append((m, name, dt))
    _update_module_param(updates)


def _localize_dtensor(module: nn.Module, *_: Any,
                      ignored_params: set[nn.Parameter] | None = None) -> None:
    """Register local parameters in place of DTensor parameters (and of
    DTensors rebuilt for forward).

    A DTensor parameter becomes ``nn.Parameter(its local tensor)`` with ``_st_info`` = its spec
    (tied parameters stay tied); a rebuilt DTensor gives back the local parameter it wraps.
    """
    ignored = {id(p) for p in ignored_params or ()}
    made: dict[int, nn.Parameter] = {}
    updates = []
    for m, name, t in _registered(module):
        if id(t) in ignored:
            continue
        local = getattr(t, "_dp_local", None)
        if local is None and isinstance(t, DTensor):
            local = made.get(id(t))
            if local is None:
                local = made[id(t)] = _local_param(t)
        if local is not None:
            updates.append((m, name, local))
    _update_module_param(updates)


def _restore_dtensor_params(module: nn.Module, *_: Any) -> None:
    """Forward hook: register the DTensor parameters (views of the local ones) in place of the
    DTensors rebuilt for forward."""
    updates = []
    for m, name, t in _registered(module):
        view = getattr(getattr(t, "_dp_local", None), "_dp_view", None)
        if view is not None and view is not t:
            updates.append((m, name, view))
    _update_module_param(updates)


def _local_param(dt: DTensor) -> nn.Parameter:
    flat, spec = _flatten_tensor(dt)
    local = nn.Parameter(flat.detach(), requires_grad=dt.requires_grad)
    local._st_info = spec  # type: ignore[attr-defined]
    grad = dt.grad
    if isinstance(grad, DTensor):
        local.grad = grad.redistribute(grad.device_mesh, spec.placements).to_local().detach()  # type: ignore[union-attr]
    view = dt if isinstance(dt, nn.Parameter) else nn.Parameter(dt, requires_grad=dt.requires_grad)
    view._dp_local = local  # type: ignore[attr-defined]
    local._dp_view = view  # type: ignore[attr-defined]
    local._dp_grad_shown = None  # type: ignore[attr-defined]
    _show_grad(local)
    if local.requires_grad:
        local.register_post_accumulate_grad_hook(_after_accumulate)
    return local


def _show_grad(local: torch.Tensor) -> None:
    """Give the DTensor parameter ``local._dp_view`` the DTensor of ``local.grad`` (same
    storage), or no gradient."""
    g = local.grad
    spec = local._st_info  # type: ignore[attr-defined]
    shown = None if g is None else make_dtensor(g, spec.mesh, spec.placements, spec.shape,
                                                spec.stride)
    local._dp_view.grad = shown  # type: ignore[attr-defined]
    local._dp_grad_shown = shown  # type: ignore[attr-defined]


def _pull_grad(local: torch.Tensor) -> None:
    """A gradient set on (or cleared from) the DTensor parameter since it was last shown
    becomes the local parameter's."""
    view = getattr(local, "_dp_view", None)
    if view is None or view.grad is local._dp_grad_shown:  # type: ignore[attr-defined]
        return
    g = view.grad
    if g is None:
        local.grad = None
    else:
        spec = local._st_info  # type: ignore[attr-defined]
        if isinstance(g, DTensor):
            g = g.redistribute(spec.mesh, spec.placements).to_local()
        else:
            g = _local_piece(g, spec)
        local.grad = g.detach()
    local._dp_grad_shown = view.grad  # type: ignore[attr-defined]


def _after_accumulate(local: torch.Tensor) -> None:
    """Post-accumulate hook of a local parameter: show its gradient on the DTensor parameter
    once the backward is over, after DDP's own end-of-backward step (which may replace
    ``.grad``): a callback that queues the callback that shows it."""
    engine = torch.autograd.Variable._execution_engine  # type: ignore[attr-defined]
    engine.queue_callback(lambda: engine.queue_callback(lambda: _show_grad(local)))


def _pre_dp_module_transform(module: nn.Module) -> None:
    """Prepare a module with DTensor parameters for DDP (see the module docstring); idempotent.

    Example::

        _pre_dp_module_transform(tp_model)
        ddp = DistributedDataParallel(tp_model, process_group=mesh["dp"].get_group())
    """
    if getattr(module, _MARK, False):
        return
    _localize_dtensor(module, None, None)
    module.register_forward_pre_hook(_reconstruct_dtensor)
    module.register_forward_hook(_restore_dtensor_params)
    module.register_state_dict_post_hook(_state_dict_as_dtensors)
    module.register_load_state_dict_pre_hook(_load_into_locals)
    setattr(module, _MARK, True)


def _local_params_by_key(module: nn.Module, prefix: str) -> dict[str, tuple[Any, nn.Parameter]]:
    """State-dict key -> (the tensor registered there, its local parameter)."""
    out = {}
    for name, t in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
        local = getattr(t, "_dp_local", t)
        if getattr(local, "_st_info", None) is not None:
            out[name] = (t, local)
    return out


def _state_dict_as_dtensors(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                            local_metadata: Any) -> None:
    for key, (_, local) in _local_params_by_key(module, prefix).items():
        value = state_dict.get(key)
        if value is not None and not isinstance(value, DTensor):
            spec = local._st_info  # type: ignore[attr-defined]
            state_dict[key] = make_dtensor(value, spec.mesh, spec.placements, spec.shape,
                                           spec.stride)


def _load_into_locals(module: nn.Module, state_dict: dict[str, Any], prefix: str, *_: Any) -> None:
    """DTensor values (any placements) or full tensors -> this rank's local piece (copied by
    nn.Module), as a DTensor where a DTensor parameter is registered."""
    for key, (registered, local) in _local_params_by_key(module, prefix).items():
        value = state_dict.get(key)
        if not isinstance(value, torch.Tensor):
            continue
        spec = local._st_info  # type: ignore[attr-defined]
        if isinstance(value, DTensor):
            if value.device_mesh != spec.mesh or tuple(value.placements) != tuple(spec.placements):
                value = value.redistribute(spec.mesh, spec.placements)   # raises for another mesh
            piece = value.to_local()
        elif tuple(value.shape) == tuple(spec.shape) and (
                isinstance(registered, DTensor) or tuple(value.shape) != tuple(local.shape)):
            piece = _local_piece(value, spec)
        else:
            continue
        state_dict[key] = (make_dtensor(piece, spec.mesh, spec.placements, spec.shape, spec.stride)
                           if isinstance(registered, DTensor) else piece)


def _local_piece(full: torch.Tensor, spec: Any) -> torch.Tensor:
    """This rank's piece of a full tensor laid out by ``spec`` (no communication)."""
    dt = make_dtensor(full.detach(), spec.mesh, (Replicate(),) * spec.mesh.ndim, spec.shape)
    return dt.redistribute(spec.mesh, spec.placements).to_local()


def dp_view(p: torch.Tensor) -> Any:
    """The DTensor parameter a local parameter made by the transform stands for, else None."""
    return getattr(p, "_dp_view", None) if getattr(p, "_st_info", None) is not None else None


def local_state_to_view(p: torch.Tensor, value: Any) -> Any:
    """An optimizer-state value of local parameter ``p`` (``exp_avg``, ...) as a DTensor in the
    DTensor parameter's layout, so checkpoints hold every rank's piece; other values unchanged."""
    if (dp_view(p) is None or not isinstance(value, torch.Tensor) or isinstance(value, DTensor)
            or tuple(value.shape) != tuple(p.shape)):
        return value
    spec = p._st_info  # type: ignore[attr-defined]
    return make_dtensor(value, spec.mesh, spec.placements, spec.shape, spec.stride)


def view_state_to_local(p: torch.Tensor, value: Any) -> Any:
    """The inverse of :func:`local_state_to_view`: a DTensor value of the DTensor parameter's
    shape becomes ``p``'s local piece (redistributed first if laid out otherwise)."""
    view = dp_view(p)
    if view is None or not isinstance(value, DTensor) or tuple(value.shape) != tuple(view.shape):
        return value
    spec = p._st_info  # type: ignore[attr-defined]
    if tuple(value.placements) != tuple(spec.placements):
        value = value.redistribute(spec.mesh, spec.placements)
    return value.to_local()


def has_dtensor_params(module: nn.Module) -> bool:
    return any(isinstance(p, DTensor) for p in module.parameters())


def check_dp_orthogonal(module: nn.Module, pg: ProcessGroup,
                        where: str = "DistributedDataParallel") -> None:
    """Raise unless every rank of ``pg`` holds the same piece of each DTensor parameter.

    Data parallelism averages gradients across ``pg``; a parameter split (``Shard``) or partial
    along a mesh axis that contains other ranks of ``pg`` is not replicated across ``pg``.
    Every rank reaches the same verdict (it depends only on the mesh layouts).

    Raises:
        ValueError: naming the parameter, the mesh axis and its placement.
    """
    members = set(pg.ranks)
    for name, p in module.named_parameters():
        if not isinstance(p, DTensor):
            continue
        mesh = p.device_mesh
        coord = mesh.get_coordinate()
        if coord is None:
            raise ValueError(f"{where}: parameter {name!r} is a DTensor on {mesh!r}, which does "
                             f"not contain rank {mesh.get_rank()}")
        for axis, placement in enumerate(p.placements):
            if isinstance(placement, Replicate):
                continue
            line = mesh.mesh.movedim(axis, -1)[tuple(c for a, c in enumerate(coord)
                                                     if a != axis)].tolist()
            shared = sorted(members.intersection(line) - {mesh.get_rank()})
            if shared:
                axis_name = mesh.mesh_dim_names[axis] if mesh.mesh_dim_names else str(axis)
                raise ValueError(
                    f"{where}: parameter {name!r} is {p!r} on {mesh!r}: placed {placement!r} "
                    f"along mesh axis {axis_name!r}, which holds ranks {shared} of the "
                    f"data-parallel group {sorted(members)}; expected every rank of that group to "
                    "hold the same piece (Replicate along any axis it shares).  Use a 2-d mesh "
                    "and data parallelism over its other axis, e.g. "
                    "DistributedDataParallel(model, device_mesh=mesh['dp'])")
