"""The ``FSDPModule`` setters: how a module's group reduces gradients, reshards and communicates.

Kept apart from ``_api.py`` (residency, copying, the public entry points); ``FSDPModule``
inherits them.  Setters with ``recurse`` apply to every fully_shard module below too; the
others to this module's group only.  Communication settings that create process groups
(``set_reshard_after_forward`` with an int, ``set_separate_reduce_scatter_group``) are
collective: call them on every rank, in the same order.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

from ringlet.parallel.fsdp._comm_api import AllGather, ReduceScatter
from ringlet.parallel.fsdp._init import normalize_reshard_after_forward
from ringlet.parallel.fsdp._mesh_info import subgroups

if TYPE_CHECKING:
    from ringlet.parallel.fsdp._param_group import FSDPParamGroup
    from ringlet.parallel.fsdp._state import FSDPState

__all__ = ["FSDPControls", "apply_reshard_after_forward"]


def apply_reshard_after_forward(state: FSDPState, value: Any, where: str) -> None:
    """Set ``state``'s ``reshard_after_forward``; an int divisor creates its post-forward group."""
    g = state.group
    if g is None:         # no parameters of its own: nothing to reshard, any int means "reshard"
        if not (value is None or isinstance(value, (bool, int))):
            raise TypeError(f"{where}: reshard_after_forward: expected None, a "
                            f"bool or an int, got {value!r}")
        state.reshard_after_forward = (value if value is None or isinstance(value, bool)
                                       else value != 1)
        return
    raf = normalize_reshard_after_forward(value, g.mesh_info.shard_size, where)
    state.reshard_after_forward = raf
    proper = isinstance(raf, int) and not isinstance(raf, bool)
    g.comm.post_forward_pg = subgroups(g.mesh_info, raf, "post_forward") if proper else None  # type: ignore[arg-type]
    g._post_forward_shard = None


def _flag(value: Any, where: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{where}: expected a bool, got {value!r}")
    return value


class FSDPControls:
    """Setters of :class:`~ringlet.parallel.fsdp.FSDPModule` (see the module docstring)."""

    def _get_fsdp_state(self) -> FSDPState:
        return self.__dict__["_fsdp_state"]

    def _fsdp_modules(self, recurse: bool) -> Iterable[Any]:
        if not recurse:
            return [self]
        # FSDPControls is a base of FSDPModule alone: the same test, without importing _api back
        return [m for m in self.modules()  # type: ignore[attr-defined]
                if isinstance(m, FSDPControls)]

    def _groups(self, recurse: bool) -> list[FSDPParamGroup]:
        found = [g for m in self._fsdp_modules(recurse)
                 if (g := m._get_fsdp_state().group) is not None]
        return list({id(g): g for g in found}.values())     # grouped modules share one group

    # -- gradient reduction ----------------------------------------------------------------
    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *,
                                   recurse: bool = True) -> None:
        """Turn gradient reduction on/off (off: gradients accumulate unsharded; ``no_sync``)."""
        for g in self._groups(recurse):
            g.requires_gradient_sync = bool(requires_gradient_sync)

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: turn the replicate-axis all-reduce on/off (off:
        reduce-scattered grads accumulate)."""
        for g in self._groups(recurse):
            g.requires_all_reduce = bool(requires_all_reduce)

    def set_reshard_after_forward(self, reshard_after_forward: bool | int,
                                  recurse: bool = True) -> None:
        """Change ``reshard_after_forward`` (see :func:`fully_shard`) at run time
        (an int: collective)."""
        for m in self._fsdp_modules(recurse):
            apply_reshard_after_forward(m._get_fsdp_state(), reshard_after_forward,
                                        "set_reshard_after_forward")

    def set_reshard_after_backward(self, reshard_after_backward: bool, *,
                                   recurse: bool = True) -> None:
        """Whether to free the unsharded parameters after backward (False saves a re-gather)."""
        for g in self._groups(recurse):
            g.reshard_after_backward = bool(reshard_after_backward)

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide reduced gradients by ``factor`` instead of the data-parallel world size."""
        if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
            raise ValueError("set_gradient_divide_factor: factor: expected a "
                             f"positive number, got {factor!r}")
        for g in self._groups(False):
            g.divide_factor = float(factor)

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """Deprecated spelling of :meth:`set_gradient_divide_factor`."""
        warnings.warn("set_reduce_scatter_divide_factor is deprecated; use "
                      "set_gradient_divide_factor",
                      FutureWarning, stacklevel=2)
        self.set_gradient_divide_factor(factor)

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """Reduce with SUM only and scale separately (after the reduce-scatter / all-reduce)."""
        for g in self._groups(False):
            g.comm.force_sum = _flag(enable, "set_force_sum_reduction_for_comms")

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *,
                                         recurse: bool = True) -> None:
        """Give every parameter of a reduced group the averaged gradient, counting zeros for the
        ranks where it got none (the reduce-scatter always carries zeros for them, so the
        collectives match either way); off: such a parameter keeps ``.grad`` None on the ranks
        where it got no gradient, as in torch."""
        for g in self._groups(recurse):
            g.reduce_scatter_unused_params = _flag(reduce_scatter_unused_params,
                                                   "set_reduce_scatter_unused_params")

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *,
                                             recurse: bool = True) -> None:
        """How many reduce-scatter input buffers the buffer pool keeps (``>= 1``)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"set_reduce_scatter_max_input_buffers: expected an int, got "
                            f"{type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError("set_reduce_scatter_max_input_buffers: expected an int >= "
                             f"1, got {max_input_buffers}")
        for g in self._groups(recurse):
            g.pool.max_free = max(g.pool.max_free, max_input_buffers)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *,
                                          recurse: bool = True) -> None:
        """Run reduce-scatters on a process group of their own (collective), so that they overlap
        all-gathers instead of queueing behind them on the shard group."""
        on = _flag(enable, "set_separate_reduce_scatter_group")
        for g in self._groups(recurse):
            info = g.mesh_info
            g.comm.reduce_scatter_pg = (subgroups(info, info.shard_size, "reduce_scatter") if on
                                        else None)

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *,
                            stream: Any = None) -> None:
        """Call ``hook(output)`` on the reduced gradient shard (after the
        HSDP all-reduce, if any)."""
        if not callable(hook):
            raise TypeError("set_all_reduce_hook: hook: expected a callable, "
                            f"got {type(hook).__name__}")
        for g in self._groups(False):
            g.all_reduce_hook = hook

    # -- communication and residency -------------------------------------------------------
    def set_custom_all_gather(self, comm: AllGather) -> None:
        """Run this module's all-gathers with ``comm`` (``_comm_api.AllGather``)."""
        self._set_comm(comm, AllGather, "all_gather_comm", "set_custom_all_gather")

    def set_custom_reduce_scatter(self, comm: ReduceScatter) -> None:
        """Run this module's reduce-scatters with ``comm`` (``_comm_api.ReduceScatter``)."""
        self._set_comm(comm, ReduceScatter, "reduce_scatter_comm", "set_custom_reduce_scatter")

    def _set_comm(self, comm: Any, kind: type, attr: str, where: str) -> None:
        if not isinstance(comm, kind):
            raise TypeError(f"{where}: expected a {kind.__name__} "
                            "(ringlet.distributed.fsdp._fully_shard._fsdp_api), "
                            f"got {type(comm).__name__}")
        for g in self._groups(False):
            if g.allocate_from_process_group:
                raise ValueError(f"{where}: cannot be combined with "
                                 "set_allocate_memory_from_process_group_for_comm")
            setattr(g.comm, attr, comm)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """Accepted: ringlet's transports copy from ordinary memory, so there is
        no special allocator."""
        on = _flag(enable, "set_allocate_memory_from_process_group_for_comm")
        for g in self._groups(False):
            if on and (g.comm.all_gather_comm is not None
                       or g.comm.reduce_scatter_comm is not None):
                raise ValueError("set_allocate_memory_from_process_group_for_comm: cannot be "
                                 "combined with set_custom_all_gather / set_custom_reduce_scatter")
            g.allocate_from_process_group = on

    def set_symm_mem_for_comm(self, backend: str = "NCCL") -> None:
        """Symmetric-memory staging buffers are a CUDA/NCCL feature: refused by ringlet."""
        raise NotImplementedError(f"set_symm_mem_for_comm({backend!r}): symmetric memory is "
                                  "a CUDA/NCCL feature; ringlet's fully_shard communicates "
                                  "CPU tensors (leave it unset)")

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:
        """Whether backward needs this module's parameters (False for e.g. an embedding)."""
        for g in self._groups(False):
            g.unshard_in_backward = bool(unshard_in_backward)

    def _set_unshard_async_op(self, async_op: bool) -> None:
        """Accepted (recursive): on the CPU every unshard already runs on the group's thread."""
        for g in self._groups(True):
            g.unshard_async_op = bool(async_op)

    # -- prefetch and events -----------------------------------------------------------------
    def set_modules_to_forward_prefetch(self, modules: list[Any]) -> None:
        """Start these modules' all-gathers when this module's forward starts."""
        self._get_fsdp_state().forward_prefetch = _states(modules,
                                                          "set_modules_to_forward_prefetch")

    def set_modules_to_backward_prefetch(self, modules: list[Any]) -> None:
        """Start these modules' all-gathers when this module's backward starts."""
        self._get_fsdp_state().backward_prefetch = _states(modules,
                                                           "set_modules_to_backward_prefetch")

    def set_post_optim_event(self, event: Any) -> None:
        """Accepted for compatibility: on the CPU the optimizer step is done when forward starts."""
        ctx = self._get_fsdp_state().ctx
        if ctx is not None:
            ctx.post_optim_event = event

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """Accepted for compatibility: every backward waits for its reductions."""


def _states(modules: list[Any], where: str) -> list[FSDPState]:
    out = []
    for m in modules:
        if not isinstance(m, FSDPControls):    # i.e. an FSDPModule (its only subclass)
            raise TypeError(f"{where}: expected FSDPModules, got {type(m).__name__}")
        out.append(m._get_fsdp_state())
    return out
