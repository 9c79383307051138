"""fully_shard over tensor-parallel parameters: the 2-d (or 3-d, HSDP) layout
of each sharded parameter.

A parameter that is already a DTensor (tensor parallelism along a "tp" axis) is sharded by
fully_shard *as its local tensor*: the flat all-gather and reduce-scatter along the data-parallel
axes move pieces of the TP-local tensor, and an unshard gives back exactly that local tensor,
wrapped as the original TP DTensor for compute.  The sharded parameter the optimizer and the
state dict see is one DTensor on the mesh ``(dp axes..., tp axes...)`` (sliced from the common
root mesh) with the data-parallel placements followed by the TP ones:

- TP shards another dim than fully_shard (row-parallel ``Shard(1)``, ``Replicate``): plain
  placements, e.g. ``(Shard(0), Shard(1))``;
- TP shards the same dim (column-parallel ``Shard(0)``): fully_shard cuts *inside* each TP
  chunk, which ``_StridedShard(0, split_factor=tp size)`` on the dp axis says
  (``ringlet/dtensor/placements.py``), e.g. ``(_StridedShard(0, 2), Shard(0))``;
- HSDP adds ``Replicate()`` in front for the replicate axis.

This is the role of torch's ``_data_parallel_utils.py`` for FSDP (whose ``_flatten_tensor`` and
``_unflatten_tensor`` live in ``ringlet.parallel._data_parallel_utils``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING

import torch

from ringlet.dtensor import DTensor, Replicate, Shard
from ringlet.dtensor._shard_math import contiguous_strides, local_shape_and_offset
from ringlet.dtensor._spec import DTensorSpec, Placements
from ringlet.dtensor.placements import _StridedShard

if TYPE_CHECKING:
    from ringlet.mesh import DeviceMesh

__all__ = ["TPLayout", "tp_layout"]


@dataclasses.dataclass(frozen=True)
class TPLayout:
    """How one tensor-parallel parameter is laid out before and after fully_shard."""

    tp_spec: DTensorSpec          # the parameter as tensor parallelism made it (used for compute)
    spmd_mesh: DeviceMesh         # (fsdp axes..., tp axes...) of the common root mesh
    spmd_placements: Placements   # fsdp placements (maybe strided), then the TP ones

    @property
    def global_shape(self) -> tuple[int, ...]:
        return self.tp_spec.shape

    @property
    def global_stride(self) -> tuple[int, ...]:
        return contiguous_strides(self.tp_spec.shape)

    def sharded_local_of(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's sharded piece (a view) of the *global* tensor ``full`` (no communication)."""
        coord = self.spmd_mesh.get_coordinate()
        if coord is None:   # fully_shard runs on the mesh's ranks only
            raise AssertionError(f"rank outside {self.spmd_mesh!r} holds a fully_shard parameter")
        shape, offset = local_shape_and_offset(self.global_shape, self.spmd_mesh.shape, coord,
                                               self.spmd_placements)
        for d, (n, o) in enumerate(zip(shape, offset)):
            full = full.narrow(d, o, n)
        return full

    def unsharded_dtensor(self, local: torch.Tensor) -> DTensor:
        """The TP DTensor (no autograd history) around the all-gathered local tensor."""
        from ringlet.dtensor._api import make_dtensor

        s = self.tp_spec
        return make_dtensor(local, s.mesh, s.placements, s.shape, s.stride)

    def tp_local_grad(self, grad: torch.Tensor) -> torch.Tensor:
        """A gradient of the unsharded TP parameter as a local tensor in the
        parameter's TP layout."""
        if not isinstance(grad, DTensor):
            return grad
        want = self.tp_spec.placements
        if tuple(grad.placements) != tuple(want):
            # e.g. a Partial gradient of a Replicate param
            grad = grad.redistribute(grad.device_mesh, want)
        return grad._local_tensor


def _names(mesh: DeviceMesh, what: str, fqn: str) -> tuple[str, ...]:
    names = mesh.mesh_dim_names
    if not names:
        raise ValueError(f"fully_shard: {fqn}: expected {what} with named axes "
                         "(init_device_mesh(..., mesh_dim_names=...)) to combine data and tensor "
                         f"parallelism, got {mesh!r}")
    return tuple(names)


def tp_layout(param: DTensor, fsdp_mesh: DeviceMesh, fsdp_placements: Placements, shard_dim: int,
              fqn: str) -> TPLayout:
    """The 2-d layout of tensor-parallel ``param`` under fully_shard on ``fsdp_mesh``.

    Raises:
        ValueError: the meshes are not slices of one root mesh with named axes, the parameter is
            not Replicate along the fully_shard axes, or it is Partial along a TP axis.
    """
    tp_mesh = param.device_mesh
    fsdp_names, tp_names = (_names(fsdp_mesh, "a fully_shard mesh", fqn),
                            _names(tp_mesh, "a DTensor mesh", fqn))
    if fsdp_mesh._root is not tp_mesh._root:
        raise ValueError(f"fully_shard: {fqn}: expected the DTensor's mesh {tp_mesh!r} and "
                         f"fully_shard's mesh {fsdp_mesh!r} to be slices of one DeviceMesh, "
                         "got meshes of different roots")
    tp_axes = [a for a, n in enumerate(tp_names) if n not in fsdp_names]
    for a, n in enumerate(tp_names):
        p = param.placements[a]
        if n in fsdp_names and not isinstance(p, Replicate):
            raise ValueError(f"fully_shard: {fqn}: expected {param!r} to be Replicate along "
                             f"fully_shard's mesh axis {n!r}, got {p!r}")
        if a in tp_axes and not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"fully_shard: {fqn}: expected Shard or Replicate placements on the "
                             f"tensor-parallel axes, got {p!r} on {n!r}")
    tp_pls = tuple(param.placements[a] for a in tp_axes)
    split = math.prod(tp_mesh.shape[a] for a in tp_axes if param.placements[a].is_shard(shard_dim))
    dp_pls = tuple(_StridedShard(shard_dim, split) if isinstance(p, Shard) and split > 1 else p
                   for p in fsdp_placements)
    spmd = fsdp_mesh._root[fsdp_names + tuple(tp_names[a] for a in tp_axes)]
    return TPLayout(param._spec, spmd, dp_pls + tp_pls)
