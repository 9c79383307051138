"""One parameter managed by fully_shard: its sharded DTensor, its unsharded
view, where it is registered.

Residency (which of the two is registered on the modules) is decided by the param group;
this file only knows how to build, swap and reconcile one parameter's tensors.

[Note: aliasing]
The sharded parameter is ``nn.Parameter(DTensor)`` whose local tensor is a *view into the
group's shard buffer* (the unpadded part of this parameter's slot), so the optimizer's
in-place updates land where the next all-gather reads them, with no copy-in.  The
unsharded parameter is an ``nn.Parameter`` view into the group's unsharded buffer (for a
tensor-parallel parameter, a TP DTensor whose local tensor is that view, ``_tp.py``); the
group frees that buffer by resizing its storage to 0 and refills it in place (through an
alias with its own version counter, ``buffer.data``), so tensors autograd saved in forward
see valid data again in backward and their version checks still pass.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from ringlet.dtensor import DTensor
from ringlet.dtensor._api import make_dtensor, wrap_local
from ringlet.parallel.fsdp._mesh_info import MeshInfo
from ringlet.parallel.fsdp._shard_math import ParamSpec, shard_of
from ringlet.parallel.fsdp._tp import TPLayout

if TYPE_CHECKING:
    from ringlet.mesh import DeviceMesh

__all__ = ["FSDPParam"]


class FSDPParam:
    """One parameter of a group; ``index`` is its position in the group's layout."""

    def __init__(self, index: int, spec: ParamSpec, owners: list[tuple[nn.Module, str]],
                 fqns: list[str], requires_grad: bool, mesh_info: MeshInfo,
                 tp: TPLayout | None = None) -> None:
        self.index = index
        self.spec = spec
        # every (module, attribute) the parameter is registered as
        self.owners = owners
        # names relative to the fully_shard module (state dicts)
        self.fqns = fqns
        self.requires_grad = requires_grad
        self.mesh_info = mesh_info
        self.tp = tp                            # set for a tensor-parallel (DTensor) parameter
        self.home: nn.Module | None = None      # the fully_shard module its fqns are relative to
        self.sharded_param: nn.Parameter = None  # type: ignore[assignment]  # set by bind_sharded
        self.unsharded_param: nn.Parameter | None = None
        # Unsharded gradient kept (in the reduce dtype) while gradient sync is off.
        self.accumulated_grad: torch.Tensor | None = None

    def __repr__(self) -> str:
        return f"FSDPParam({self.fqns[0]}, {list(self.spec.shape)} S({self.spec.dim}))"

    def __deepcopy__(self, memo: dict[int, Any]) -> FSDPParam:
        """The sharded side only ([Note: copying a fully_shard module] in ``_api.py``).

        The unsharded parameter is a view of storage that may be freed (size 0): copying it
        would read freed memory, so the copy rebinds a fresh one at its first unshard.  A
        gradient that autograd accumulates on it while gradient sync is off moves to
        ``accumulated_grad`` in the copy; the sharded ``.grad`` is copied with the parameter.
        """
        new = FSDPParam.__new__(FSDPParam)
        memo[id(self)] = new
        for k, v in self.__dict__.items():
            if k != "unsharded_param":
                new.__dict__[k] = copy.deepcopy(v, memo)
        new.unsharded_param = None
        up = self.unsharded_param
        if new.accumulated_grad is None and up is not None and up.grad is not None:
            new.accumulated_grad = copy.deepcopy(self._local_grad(up.grad), memo)
        grad = self.sharded_param.grad
        if grad is not None and new.sharded_param.grad is None:
            new.sharded_param.grad = copy.deepcopy(grad, memo)
        return new

    # -- building the tensors ----------------------------------------------------------
    def local_view(self, shard_buffer: torch.Tensor) -> torch.Tensor:
        """This rank's unpadded shard as a view into ``shard_buffer`` (any flat
        buffer of the layout)."""
        rank = self.mesh_info.shard_rank
        start = self.spec.shard_offset
        piece = shard_buffer[start:start + self.spec.local_numel(rank)]
        return piece.view(self.spec.local_shape(rank))

    @property
    def global_shape(self) -> tuple[int, ...]:
        """The parameter's shape as the user sees it (a TP parameter's is its
        DTensor's global shape)."""
        return self.tp.global_shape if self.tp is not None else self.spec.shape

    @property
    def dtensor_mesh(self) -> DeviceMesh:
        return self.tp.spmd_mesh if self.tp is not None else self.mesh_info.mesh

    @property
    def dtensor_placements(self) -> tuple[Any, ...]:
        """Placements of the sharded DTensor (data-parallel ones, then any tensor-parallel ones)."""
        return (self.tp.spmd_placements if self.tp is not None
                else self.mesh_info.placements(self.spec.dim))

    def _global_stride(self) -> tuple[int, ...]:
        return self.tp.global_stride if self.tp is not None else self.spec.contiguous_stride()

    def to_dtensor(self, local: torch.Tensor) -> DTensor:
        # where the shard lives: offloaded shards stay on the CPU of a CUDA mesh
        return wrap_local(local, self.dtensor_mesh, self.dtensor_placements,
                          shape=torch.Size(self.global_shape), stride=self._global_stride())

    def grad_dtensor(self, local: torch.Tensor) -> DTensor:
        """A sharded gradient (hot path: no autograd node, no placement checks)."""
        return make_dtensor(local, self.dtensor_mesh, self.dtensor_placements, self.global_shape,
                            self._global_stride())

    def shard_of_full(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's (unpadded) shard, a view, of a full tensor of :attr:`global_shape`."""
        if self.tp is not None:
            return self.tp.sharded_local_of(full)
        return shard_of(full, self.spec, self.mesh_info.shard_rank)

    def bind_sharded(self, shard_buffer: torch.Tensor) -> None:
        """(Re)create the sharded parameter as a DTensor over this param's
        slot of ``shard_buffer``."""
        self.sharded_param = nn.Parameter(self.to_dtensor(self.local_view(shard_buffer)),
                                          requires_grad=self.requires_grad)

    def bind_unsharded(self, unsharded_buffer: torch.Tensor) -> None:
        start = self.spec.unsharded_offset
        view = unsharded_buffer[start:start + self.spec.numel].view(self.spec.shape)
        data = self.tp.unsharded_dtensor(view) if self.tp is not None else view
        self.unsharded_param = nn.Parameter(data, requires_grad=self.requires_grad)

    def register(self, tensor: torch.Tensor) -> None:
        """Set ``tensor`` as this parameter on every owning module (no
        nn.Module checks: hot path)."""
        for module, name in self.owners:
            module._parameters[name] = tensor  # type: ignore[assignment]

    def registered(self) -> Any:
        module, name = self.owners[0]
        return module._parameters.get(name)

    # -- reconciling with what the user did ------------------------------------------------
    def adopt(self, tensor: torch.Tensor, shard_buffer: torch.Tensor) -> None:
        """Copy a parameter the user set (a DTensor shard or a full tensor)
        into our slot and rebind.

        Raises:
            ValueError: the tensor's global shape differs from the managed parameter's.
        """
        local = self.local_view(shard_buffer)
        if tuple(tensor.shape) != self.global_shape:
            raise ValueError(f"fully_shard: {self.fqns[0]}: expected a tensor of shape "
                             f"{list(self.global_shape)}, got {list(tensor.shape)}")
        with torch.no_grad():
            if isinstance(tensor, DTensor):
                src = tensor.to_local()
                if tuple(src.shape) != tuple(local.shape):
                    raise ValueError(f"fully_shard: {self.fqns[0]}: expected a "
                                     f"local shard of shape {list(local.shape)} "
                                     f"({''.join(map(repr, self.dtensor_placements))}), "
                                     f"got {list(src.shape)}")
            else:
                src = self.shard_of_full(tensor)
            if src.device.type != "meta" and local.device.type != "meta":
                local.copy_(src)
        self.requires_grad = (bool(tensor.requires_grad) if isinstance(tensor, nn.Parameter)
                              else self.requires_grad)
        self.bind_sharded(shard_buffer)

    # -- gradients -------------------------------------------------------------------------
    def _local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        return self.tp.tp_local_grad(grad) if self.tp is not None else grad

    def take_unsharded_grad(self, reduce_dtype: torch.dtype) -> torch.Tensor | None:
        """The gradient to reduce (autograd's plus any accumulated one), detached from the param."""
        up = self.unsharded_param
        grad = up.grad if up is not None else None
        if up is not None:
            up.grad = None
        if grad is not None:
            grad = self._local_grad(grad)
        acc, self.accumulated_grad = self.accumulated_grad, None
        if acc is None:
            return grad
        if grad is not None:
            acc.add_(grad)
        return acc

    def stash_unsharded_grad(self, reduce_dtype: torch.dtype) -> None:
        """Gradient sync is off: keep the gradient unsharded, accumulating in ``reduce_dtype``."""
        up = self.unsharded_param
        if up is None or up.grad is None:
            return
        if self.accumulated_grad is None and up.grad.dtype == reduce_dtype:
            return              # autograd keeps accumulating into .grad itself
        grad = self._local_grad(up.grad)
        up.grad = None
        if self.accumulated_grad is None:
            self.accumulated_grad = grad.to(reduce_dtype)
        else:
            self.accumulated_grad.add_(grad)

    def has_unsharded_grad(self) -> bool:
        up = self.unsharded_param
        return (up is not None and up.grad is not None) or self.accumulated_grad is not None

    def accumulate_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Add this rank's reduced shard ``local_grad`` into the sharded
        parameter's ``.grad`` DTensor."""
        p = self.sharded_param
        if p.grad is None:
            p.grad = self.grad_dtensor(local_grad)
        else:
            cast(DTensor, p.grad).to_local().add_(local_grad)
