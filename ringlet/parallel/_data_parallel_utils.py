"""DTensor parameters under a data-parallel wrapper: flatten to the local
tensor, rebuild the DTensor.

A data-parallel wrapper (DDP) works on plain tensors: it broadcasts, buckets and all-reduces
each rank's piece.  So a DTensor parameter (tensor parallelism on another mesh axis) is handed
to it as its *local* tensor together with the DTensor's spec (:func:`_flatten_tensor`), and the
DTensor is rebuilt around that same local tensor when the model needs it
(:func:`_unflatten_tensor`).  The rebuilt DTensor is a differentiable view: its gradient flows
back into the local tensor's ``.grad``, where the wrapper reduces it.

These are torch's private names (``torch.distributed.tensor.parallel._data_parallel_utils``),
mirrored at ``ringlet.distributed.tensor.parallel._data_parallel_utils`` for code that calls
them directly.

Example::

    local, spec = _flatten_tensor(dtensor_param)      # this rank's piece, and its layout
    dt = _unflatten_tensor(local, spec)               # a DTensor again; dt's grad -> local.grad
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.dtensor import DTensor
from ringlet.dtensor._spec import DTensorSpec

__all__ = ["_flatten_tensor", "_unflatten_tensor", "sync_grad_hook"]


def sync_grad_hook(grad: torch.Tensor, *, device_handle: Any = None,
                   compute_stream: Any = None) -> torch.Tensor:
    """torch waits here for a gradient still in flight; ringlet's collectives
    return finished tensors."""
    return grad


def _flatten_tensor(tensor: torch.Tensor) -> tuple[torch.Tensor, DTensorSpec | None]:
    """``(local tensor, spec)`` of a DTensor (the local tensor is made to require grad),
    else ``(tensor, None)``."""
    if isinstance(tensor, DTensor):
        local = tensor._local_tensor
        if local.is_leaf and local.is_floating_point():
            local.requires_grad_()
        return local, tensor._spec
    return tensor, None


def _unflatten_tensor(tensor: torch.Tensor, spec: DTensorSpec, *, device_handle: Any = None,
                      compute_stream: Any = None) -> DTensor:
    """The DTensor of layout ``spec`` whose local tensor is ``tensor``
    (differentiable, no communication).

    Raises:
        ValueError: ``tensor`` does not have the local shape ``spec`` gives this rank.
    """
    want = spec.local_shape()
    if list(tensor.shape) != want:
        raise ValueError(f"_unflatten_tensor: expected a local tensor of shape {want} "
                         f"for {list(spec.placements)} of global shape "
                         f"{list(spec.shape)}, got {list(tensor.shape)}")
    return DTensor.from_local(tensor, spec.mesh, spec.placements, run_check=False, shape=spec.shape,
                              stride=spec.stride)
