"""DTensor factories: ``ones``, ``zeros``, ``empty``, ``full``, ``rand``,
``randn`` (torch's signatures).

Each builds only this rank's piece, on the mesh's device, with contiguous global strides.
``rand`` and ``randn`` draw the *whole* tensor from the default generator and keep this
rank's piece, so a DTensor drawn after ``torch.manual_seed(s)`` holds the same values as
``torch.randn(size)`` after the same seed on one process, whatever the placements (at
the cost of drawing the full tensor on every rank).  A ``Partial`` axis holds the value on
coordinate 0 and zeros elsewhere (``sum``), so the global value is what was asked for.

On a rank outside the mesh a factory returns a DTensor of the global shape whose local
tensor is empty (torch's placeholder; [Note: ranks outside the mesh] in ``_outside.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringlet.dtensor import _shard_math
from ringlet.dtensor._api import DTensor, default_mesh
from ringlet.dtensor._spec import DTensorSpec, normalize_placements
from ringlet.dtensor.placements import Partial, Placement, Shard
from ringlet.mesh import DeviceMesh
from ringlet.mesh.device_mesh import compute_device

__all__ = ["empty", "full", "ones", "rand", "randn", "zeros"]


def _size(size: Sequence[Any], op: str) -> tuple[int, ...]:
    """``f(2, 3)``, ``f((2, 3))`` and ``f([2, 3])`` all mean shape ``(2, 3)``."""
    if len(size) == 1 and isinstance(size[0], Sequence | torch.Size):
        size = tuple(size[0])
    if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in size):
        raise TypeError(f"{op}: size: expected non-negative ints, got {tuple(size)!r}")
    return tuple(int(s) for s in size)


def _build(op: str, size: tuple[int, ...], make: Callable[[list[int]], torch.Tensor], whole: bool,
           device_mesh: DeviceMesh | None, placements: Sequence[Placement] | None,
           requires_grad: bool, layout: torch.layout) -> DTensor:
    if layout != torch.strided:
        raise ValueError(f"{op}: layout: expected torch.strided, got {layout}")
    mesh = device_mesh if device_mesh is not None else default_mesh()
    pls = normalize_placements(placements, mesh, len(size), op)
    coord = mesh.get_coordinate()
    spec = DTensorSpec(mesh, pls, size, _shard_math.contiguous_strides(size))
    if coord is None:                       # [Note: ranks outside the mesh] in ``_outside``
        if whole:
            make(list(size))                # keeps the default generator in step everywhere
        return DTensor(make([0]), spec, requires_grad=requires_grad)   # as torch: shape (0,)
    if whole:                               # draw everything, keep my piece (see module docstring)
        local = make(list(size))
        for axis, p in enumerate(pls):
            if isinstance(p, Shard):
                local = p.local_chunk(local, mesh.shape[axis], coord[axis])
        local = local.clone(memory_format=torch.contiguous_format) if local.dim() else local
    else:
        local = make(_shard_math.local_shape_and_offset(size, mesh.shape, coord, pls)[0])
    for axis, p in enumerate(pls):
        if isinstance(p, Partial):
            local = p.partition(local, coord[axis])
    return DTensor(local, spec, requires_grad=requires_grad)


def _make(op: str, fn: Callable[..., torch.Tensor], size: Sequence[Any], whole: bool,
          dtype: torch.dtype | None, layout: torch.layout, requires_grad: bool,
          device_mesh: DeviceMesh | None,
          placements: Sequence[Placement] | None, *fill: Any) -> DTensor:
    dev = compute_device(device_mesh if device_mesh is not None else default_mesh())
    return _build(op, _size(size, op), lambda s: fn(s, *fill, dtype=dtype, device=dev), whole,
                  device_mesh, placements, requires_grad, layout)


def ones(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
         requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of ones of global shape ``size`` laid out by ``placements`` on ``device_mesh``.

    Args:
        size: ints, or one sequence of ints (``ones(4, 8)`` or ``ones((4, 8))``).
        dtype, layout, requires_grad: as ``torch.ones`` (only ``torch.strided``).
        device_mesh: the mesh (default: a 1-d mesh of the whole world).
        placements: one per mesh axis (default: all ``Replicate``).

    Raises:
        ValueError / TypeError: bad size, placements or layout.

    Example::

        w = ones(8, 4, device_mesh=mesh, placements=[Shard(0)])     # 2 ranks: local [4, 4]
    """
    return _make("ones", torch.ones, size, False, dtype, layout, requires_grad, device_mesh,
                 placements)


def zeros(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor of zeros (arguments as :func:`ones`)."""
    return _make("zeros", torch.zeros, size, False, dtype, layout, requires_grad, device_mesh,
                 placements)


def empty(*size: Any, dtype: torch.dtype | None = None, layout: torch.layout = torch.strided,
          requires_grad: bool = False, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """An uninitialized DTensor (arguments as :func:`ones`)."""
    return _make("empty", torch.empty, size, False, dtype, layout, requires_grad, device_mesh,
                 placements)


def full(size: Sequence[int], fill_value: Any, *, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, requires_grad: bool = False,
         device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """A DTensor filled with ``fill_value`` (``size`` is one sequence, as in ``torch.full``)."""
    return _make("full", torch.full, (size,), False, dtype, layout, requires_grad, device_mesh,
                 placements, fill_value)


def rand(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
         layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
         placements: Sequence[Placement] | None = None) -> DTensor:
    """Uniform ``[0, 1)`` values, the same global tensor as ``torch.rand(size)`` would draw now
    (see the module docstring); arguments as :func:`ones`."""
    return _make("rand", torch.rand, size, True, dtype, layout, requires_grad, device_mesh,
                 placements)


def randn(*size: Any, requires_grad: bool = False, dtype: torch.dtype | None = None,
          layout: torch.layout = torch.strided, device_mesh: DeviceMesh | None = None,
          placements: Sequence[Placement] | None = None) -> DTensor:
    """Standard normal values, the same global tensor as ``torch.randn(size)`` would draw now
    (see the module docstring); arguments as :func:`ones`."""
    return _make("randn", torch.randn, size, True, dtype, layout, requires_grad, device_mesh,
                 placements)
