"""The public surface of fully_shard: ``fully_shard``, ``FSDPModule``, ``UnshardHandle``, forward methods.

[Note: copying a fully_shard module]
``copy.deepcopy`` of an FSDPModule (torch's FSDP2 refuses it) gives an independent module with
the same sharded parameters, sharded gradients and controls, on the same mesh (meshes and
process groups are shared, never copied).  First every fully_shard module under the copied
one must be idle; its reductions are finished and its groups resharded, so nothing in flight
and no unsharded storage is copied: the unsharded buffers may be freed (storage of size 0),
and reading them would touch freed memory.  The copy holds only the sharded state (``_param``,
``_param_group``), is nobody's root (its first forward makes it one, ``_state``) and starts
with an empty buffer pool.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ringlet.parallel.fsdp._init import build_group, normalize_reshard_after_forward
from ringlet.parallel.fsdp._mesh_info import resolve_mesh
from ringlet.parallel.fsdp._param_group import FSDPParamGroup
from ringlet.parallel.fsdp._state import COPY_SCOPE, FSDPState, TrainingState
from ringlet.parallel.fsdp._state_dict import apply_to_group, register_state_dict_hooks
from ringlet.parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method"]

# One dynamically created subclass per user class, so that isinstance checks and type(m) are stable.
_FSDP_CLASSES: dict[type, type] = {}


def fully_shard(module: nn.Module, *, mesh: Any = None, reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen
                offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen
                ignored_params: set[nn.Parameter] | None = None) -> nn.Module:
    """Shard ``module``'s parameters over ``mesh`` (FSDP2); returns the same module, re-classed.

    The parameters of ``module`` not already managed by a ``fully_shard`` call on a submodule
    (call it bottom-up) become ``nn.Parameter(DTensor)`` sharded on dim 0 (``Shard(0)``; HSDP:
    ``(Replicate(), Shard(0))``) and form one group: all-gathered with one collective before
    ``module``'s forward, freed after it, re-gathered for backward, and their gradients
    reduce-scattered (averaged) with one collective into sharded ``.grad`` DTensors.

    Args:
        module: the module to shard; becomes an instance of ``FSDPModule`` and its own class.
        mesh: a 1-d DeviceMesh (FSDP) or 2-d (HSDP: replicate axis 0, shard axis 1);
            ``None``: a 1-d mesh over the default world.
        reshard_after_forward: ``True`` frees the unsharded parameters after forward (re-gathered
            in backward); ``False`` keeps them; ``None`` (default): ``True`` except for the root;
            an int is a world size to reshard to: 1 means False, the shard world size True.
        shard_placement_fn: ``param -> Shard(dim) | None`` to shard a parameter on another dim
            (that dim must divide evenly by the shard world size).
        mp_policy: :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`OffloadPolicy` or :class:`CPUOffloadPolicy` (a no-op: parameters
            already live on the CPU).
        ignored_params: parameters to leave alone (not sharded, gradients not reduced).

    Returns:
        ``module`` itself.

    Raises:
        ValueError: ``module`` was already passed to fully_shard, scalar parameters, mixed dtypes
            in one group, or a bad ``reshard_after_forward``.
        TypeError: arguments of the wrong type.
        NotImplementedError: a list of modules, or an int ``reshard_after_forward`` strictly
            between 1 and the shard world size.

    Tensor parallelism: parameters that are already DTensors (on a mesh sliced from the same
    root as ``mesh``, e.g. ``mesh["tp"]`` while ``mesh`` is ``root["dp"]``) are sharded as their
    local tensors and become DTensors on the combined mesh, data-parallel placements first
    (``_tp.py``); the all-gathers run on ``mesh`` only.

    Example::

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters())
        model(x).sum().backward(); opt.step()
    """
    if isinstance(module, (list, tuple)):
        raise NotImplementedError("fully_shard: grouping a list of modules is not implemented in ringlet; "
                                  "call fully_shard on their common parent or on each module")
    if not isinstance(module, nn.Module):
        raise TypeError(f"fully_shard: module: expected an nn.Module, got {type(module).__name__}")
    if isinstance(module, FSDPModule):
        raise ValueError(f"fully_shard: module: expected a module not yet passed to fully_shard, got "  # noqa: TRY004
                         f"{type(module).__name__} (fully_shard was already applied to it)")
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError(f"fully_shard: mp_policy: expected a MixedPrecisionPolicy, got {type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy: expected an OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")
    mesh_info = resolve_mesh(mesh)
    raf = normalize_reshard_after_forward(reshard_after_forward, mesh_info.shard_size, "fully_shard")
    ignored = set(ignored_params or ())
    group = build_group(module, mesh_info, mp_policy, shard_placement_fn, ignored)
    state = FSDPState(module, group, mp_policy, raf)
    module.__dict__["_fsdp_state"] = state
    register_state_dict_hooks(module, state)
    cls = type(module)
    if cls not in _FSDP_CLASSES:
        _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), {"__module__": cls.__module__})
    module.__class__ = _FSDP_CLASSES[cls]
    return module


class UnshardHandle:
    """A handle to wait on :meth:`FSDPModule.unshard` (``async_op=True``)."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the all-gather finished and the unsharded parameters are registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule:
    """Mixin of every module passed to :func:`fully_shard` (``isinstance(m, FSDPModule)``)."""

    _fsdp_state: FSDPState

    def _get_fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def _fsdp_modules(self, recurse: bool) -> Iterable[FSDPModule]:
        if not recurse:
            return [self]
        return [m for m in self.modules() if isinstance(m, FSDPModule)]  # type: ignore[attr-defined]

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        return [g for m in self._fsdp_modules(recurse) if (g := m._get_fsdp_state().group) is not None]

    # -- residency -------------------------------------------------------------------------
    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """All-gather this module's parameters now (not recursive).

        Args:
            async_op: return an :class:`UnshardHandle` instead of waiting (the module's
                pre-forward waits for it if the user does not).
        """
        group = self._get_fsdp_state().group
        if group is not None:
            group.unshard(async_op=async_op)
        return UnshardHandle(group) if async_op else None

    def reshard(self) -> None:
        """Free the unsharded parameters and register the sharded ones (not recursive)."""
        group = self._get_fsdp_state().group
        if group is not None:
            group.reshard()

    # -- gradient reduction ----------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Turn gradient reduction on/off (off: gradients accumulate unsharded; ``no_sync``)."""
        for g in self._groups(recurse):
            g.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: turn the replicate-axis all-reduce on/off (off: reduce-scattered grads accumulate)."""
        for g in self._groups(recurse):
            g.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int, recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (see :func:`fully_shard`) at run time."""
        for m in self._fsdp_modules(recurse):
            s = m._get_fsdp_state()
            size = s.group.mesh_info.shard_size if s.group is not None else 1
            value = normalize_reshard_after_forward(reshard_after_forward, size, "set_reshard_after_forward")
            s.reshard_after_forward = value

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after backward (False saves a re-gather)."""
        for g in self._groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError(f"set_gradient_divide_factor: factor: expected a positive number, got {factor!r}")
        for g in self._groups(False):
            g.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated spelling of :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream: Any = None) -> None:
        """Call ``hook(output)`` on the reduced gradient shard (after the HSDP all-reduce, if any)."""
        if not callable(hook):
            raise TypeError(f"set_all_reduce_hook: hook: expected a callable, got {type(hook).__name__}")
        for g in self._groups(False):
            g.all_reduce_hook = hook

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters (False for e.g. an embedding)."""
        for g in self._groups(False):
            g.unshard_in_backward = bool(unshard_in_backward)

    # -- prefetch and events -----------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's forward starts."""
        self._get_fsdp_state().forward_prefetch = _states(modules, "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Start these modules' all-gathers when this module's backward starts."""
        self._get_fsdp_state().backward_prefetch = _states(modules, "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility: on the CPU the optimizer step is done when forward starts."""
        ctx = self._get_fsdp_state().ctx
        if ctx is not None:
            ctx.post_optim_event = event

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: every backward waits for its reductions."""

    def reset_iter_state(self) -> None:
        """Recover after forward/backward raised: reshard every group and return every state to idle.

        Raises:
            RuntimeError: called on a module that is not the root.
        """
        state = self._get_fsdp_state()
        if state.ctx is None:
            return
        if not state.is_root:
            raise RuntimeError(f"reset_iter_state: expected the root module, got {state.name}")
        state.ctx.reset()

    # -- nn.Module overrides ------------------------------------------------------------------
    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        """An independent copy with the same sharded state ([Note: copying a fully_shard module]).

        Raises:
            RuntimeError: a fully_shard module under this one is inside forward or backward.
        """
        states = [m._get_fsdp_state() for m in self._fsdp_modules(True)]
        for s in states:
            if s.training_state is not TrainingState.IDLE:
                raise RuntimeError(f"deepcopy of a fully_shard module: expected {s.name} to be idle (between "
                                   f"iterations), got training state {s.training_state.value}; copy it "
                                   f"before forward or after backward")
        for s in states:
            if s.ctx is not None:
                s.ctx.finish_reductions()
            if s.group is not None:
                s.group.finish_reduce()
                s.group.reshard()
        memo.setdefault(COPY_SCOPE, set()).update(id(s) for s in states)  # type: ignore[call-overload]
        cls = type(self)
        new = cls.__new__(cls)
        memo[id(self)] = new
        new.__setstate__(copy.deepcopy(self.__dict__, memo))
        return new

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        group = self._get_fsdp_state().group
        parent_apply = functools.partial(super()._apply, fn, recurse)  # type: ignore[misc]
        if group is None:
            return parent_apply()
        return apply_to_group(self, group, fn, parent_apply)  # type: ignore[arg-type]


def _states(modules: list[FSDPModule], where: str) -> list[FSDPState]:
    out = []
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise TypeError(f"{where}: expected FSDPModules, got {type(m).__name__}")
        out.append(m._get_fsdp_state())
    return out


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Make ``module.<method_name>`` unshard/reshard like ``forward`` (e.g. ``generate``).

    A no-op if ``module`` is not an :class:`FSDPModule`.

    Raises:
        AttributeError: ``module`` has no such method.
    """
    if not isinstance(module, FSDPModule):
        return
    orig = getattr(module, method_name)
    state = module._get_fsdp_state()

    @functools.wraps(orig)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        args, kwargs = state.pre_forward(args, kwargs)
        state.method_depth += 1        # forward() calls inside the method pass through the hooks
        try:
            out = orig(*args, **kwargs)
        finally:
            state.method_depth -= 1
        return state.post_forward(out)

    module.__dict__[method_name] = wrapped
