"""The public surface of fully_shard: ``fully_shard``, ``FSDPModule``,
``UnshardHandle``, forward methods.

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
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ringlet.parallel.fsdp import _device
from ringlet.parallel.fsdp._collectives import BufferPool
from ringlet.parallel.fsdp._controls import FSDPControls, apply_reshard_after_forward
from ringlet.parallel.fsdp._init import build_group
from ringlet.parallel.fsdp._mesh_info import resolve_mesh
from ringlet.parallel.fsdp._param_group import FSDPParamGroup
from ringlet.parallel.fsdp._state import COPY_SCOPE, FSDPState, TrainingState
from ringlet.parallel.fsdp._state_dict import apply_to_group, register_state_dict_hooks
from ringlet.parallel.fsdp.policies import MixedPrecisionPolicy, OffloadPolicy

if TYPE_CHECKING:
    from ringlet.mesh import DeviceMesh

__all__ = ["FSDPModule", "UnshardHandle", "fully_shard", "register_fsdp_forward_method",
           "share_comm_ctx"]

# One dynamically created subclass per user class, so that isinstance checks and type(m) are stable.
_FSDP_CLASSES: dict[type, type] = {}


_Sharded = TypeVar("_Sharded", nn.Module, list[nn.Module])


def fully_shard(module: _Sharded, *, mesh: DeviceMesh | None = None,
                reshard_after_forward: bool | int | None = None,
                shard_placement_fn: Callable[[nn.Parameter], Any] | None = None,
                mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),  # noqa: B008 - frozen
                offload_policy: OffloadPolicy = OffloadPolicy(),  # noqa: B008 - frozen
                ignored_params: set[nn.Parameter] | None = None) -> _Sharded:
    """Shard ``module``'s parameters over ``mesh`` (FSDP2); returns the same module, re-classed.

    The parameters of ``module`` not already managed by a ``fully_shard`` call on a submodule
    (call it bottom-up) become ``nn.Parameter(DTensor)`` sharded on dim 0 (``Shard(0)``; HSDP:
    ``(Replicate(), Shard(0))``) and form one group: all-gathered with one collective before
    ``module``'s forward, freed after it, re-gathered for backward, and their gradients
    reduce-scattered (averaged) with one collective into sharded ``.grad`` DTensors.

    Args:
        module: the module to shard; becomes an instance of ``FSDPModule`` and its own class.
            A list of modules forms one group ([Note: grouped modules] in ``_state.py``): e.g.
            ``fully_shard([norm, head])`` for a chunked loss that calls ``head`` per chunk.
        mesh: a 1-d DeviceMesh (FSDP) or 2-d (HSDP: replicate axis 0, shard axis 1), of
            device type ``"cpu"`` or ``"cuda"`` (computing on the current CUDA device; CPU
            parameters are copied there shard by shard, buffers moved); ``None``: a 1-d mesh
            over the default world (joining it first if needed), ``"cuda"`` if CUDA is
            available, else ``"cpu"`` (as torch: a CPU model moves to the GPU).
        reshard_after_forward: ``True`` frees the unsharded parameters after forward (re-gathered
            in backward); ``False`` keeps them; ``None`` (default): ``True`` except for the root;
            an int is a world size to reshard to after forward: 1 means False, the shard world
            size True, a divisor ``k`` in between keeps ``1/k`` of the parameters so that backward
            all-gathers over groups of ``k`` ranks only (creates those groups: collective).
        shard_placement_fn: ``param -> Shard(dim) | None`` to shard a parameter on another dim
            (that dim must divide evenly by the shard world size), e.g. ``Shard(1)``.
        mp_policy: :class:`MixedPrecisionPolicy`.
        offload_policy: :class:`OffloadPolicy` or :class:`CPUOffloadPolicy`: on a CUDA mesh
            the shards, their gradients and so the optimizer state stay in (pinned) CPU memory
            and are copied to the GPU for each all-gather; a no-op on a CPU mesh.
        ignored_params: parameters to leave alone (not sharded, gradients not reduced).

    Returns:
        ``module`` itself.

    Raises:
        ValueError: ``module`` was already passed to fully_shard, scalar parameters, mixed dtypes
            or devices in one group, a mesh device type other than "cpu"/"cuda", or a bad
            ``reshard_after_forward``.
        TypeError: arguments of the wrong type.

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
    modules = _check_modules(module)
    _check_policies(mp_policy, offload_policy)
    mesh_info = resolve_mesh(mesh)
    group = build_group(modules, mesh_info, mp_policy, shard_placement_fn,
                        set(ignored_params or ()), offload_policy)
    state = FSDPState(modules, group, mp_policy, None, _device.compute_device(mesh_info.mesh))
    apply_reshard_after_forward(state, reshard_after_forward, "fully_shard")
    for m in modules:
        m.__dict__["_fsdp_state"] = state
        register_state_dict_hooks(m, state)
        cls = type(m)
        if cls not in _FSDP_CLASSES:
            _FSDP_CLASSES[cls] = type(f"FSDP{cls.__name__}",
                                      (FSDPModule, cls), {"__module__": cls.__module__})
        m.__class__ = _FSDP_CLASSES[cls]
    return module


def _check_modules(module: Any) -> list[nn.Module]:
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard: module: expected a module or a non-empty list of "
                         "modules, got an empty list")
    for m in modules:
        if not isinstance(m, nn.Module):
            raise TypeError(f"fully_shard: module: expected an nn.Module, got {type(m).__name__}")
        if isinstance(m, FSDPModule):
            raise ValueError("fully_shard: module: expected a module not yet passed "  # noqa: TRY004
                             f"to fully_shard, got {type(m).__name__} (fully_shard "
                             "was already applied to it)")
    if len({id(m) for m in modules}) != len(modules):
        raise ValueError("fully_shard: module: expected distinct modules, got one listed twice")
    return modules


def _check_policies(mp_policy: Any, offload_policy: Any) -> None:
    if not isinstance(mp_policy, MixedPrecisionPolicy):
        raise TypeError("fully_shard: mp_policy: expected a MixedPrecisionPolicy, got "
                        f"{type(mp_policy).__name__}")
    if not isinstance(offload_policy, OffloadPolicy):
        raise TypeError(f"fully_shard: offload_policy: expected an OffloadPolicy, got "
                        f"{type(offload_policy).__name__}")


def share_comm_ctx(modules: list[Any]) -> None:
    """Let several fully_shard roots (pipeline stages) share one communication buffer pool.

    torch shares CUDA streams between the roots; ringlet's per-root state is its pool of
    gathered and reduce-scatter buffers, which the roots then reuse between them.

    Raises:
        ValueError: an element is not an :class:`FSDPModule`.
    """
    if not modules:
        return
    for m in modules:
        if not isinstance(m, FSDPModule):
            raise ValueError("share_comm_ctx: expected a list of FSDPModules, got "  # noqa: TRY004
                             f"{type(m).__name__}")
    pool = BufferPool()
    for m in modules:
        for sub in m._fsdp_modules(True):
            state = sub._get_fsdp_state()
            state.shared_pool = pool
            if state.group is not None:
                state.group.pool = pool


class UnshardHandle:
    """A handle to wait on :meth:`FSDPModule.unshard` (``async_op=True``)."""

    def __init__(self, group: FSDPParamGroup | None) -> None:
        self._group = group

    def wait(self) -> None:
        """Block until the all-gather finished and the unsharded parameters are registered."""
        if self._group is not None:
            self._group.wait_for_unshard()
            self._group = None


class FSDPModule(FSDPControls):
    """Mixin of every module passed to :func:`fully_shard` (``isinstance(m, FSDPModule)``).

    The setters (gradient reduction, resharding, communication, prefetch) are in
    ``_controls.FSDPControls``.
    """

    _fsdp_state: FSDPState

    if TYPE_CHECKING:   # what the methods use of the host class, an nn.Module
        def __setstate__(self, state: dict[str, Any]) -> None: ...

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

    def reset_iter_state(self) -> None:
        """Recover after forward/backward raised: reshard every group and
        return every state to idle.

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
                raise RuntimeError("deepcopy of a fully_shard module: expected "
                                   f"{s.name} to be idle (between iterations), got "
                                   f"training state {s.training_state.value}; copy it "
                                   "before forward or after backward")
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
