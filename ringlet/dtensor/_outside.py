"""DTensors on ranks outside their mesh: torch's placeholders, and nothing run or waited for.

[Note: ranks outside the mesh]
A mesh may hold some of the world's ranks (``DeviceMesh("cpu", [0, 3])`` on four), and
programs often run the same lines on every rank.  As in torch, a rank outside the mesh may
still build and use the mesh's DTensors:

- the factories (``zeros``, ``ones``, ``full``, ``empty``, ``rand``, ``randn``),
  ``distribute_tensor`` and ``DTensor.from_local`` give a DTensor of the full global shape
  whose local tensor is empty (shape ``(0,)``, the requested dtype, on the mesh's device);
- ``redistribute`` and ``full_tensor`` change the placements and move nothing (``full_tensor``
  returns the empty local tensor);
- an operator returns DTensors of the global shapes and placements the members get, each
  holding an empty local tensor (a 0-d result holds a zero), and ``None`` where the members
  get a Python value (``item()``); ``equal`` answers from the shapes alone (True when they
  match);
- none of these takes part in a collective: members never wait for an outsider, and an
  outsider never waits for anyone.

Differences from torch are in docs/differences.md.  ``rand``/``randn`` still draw the whole
tensor on an outsider, so the default generator stays in step on every rank of the world.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ringlet.dtensor._api import DTensor
from ringlet.dtensor._spec import DTensorSpec
from ringlet.mesh import DeviceMesh
from ringlet.mesh.device_mesh import compute_device

if TYPE_CHECKING:
    from ringlet.dtensor._opcall import OpCall
    from ringlet.dtensor._plan import Plan

__all__ = ["empty_local", "is_outside", "outside_result"]

aten = torch.ops.aten


def is_outside(mesh: DeviceMesh) -> bool:
    """Whether this rank holds no coordinate of ``mesh`` ([Note: ranks outside the mesh])."""
    return mesh.get_coordinate() is None


def empty_local(mesh: DeviceMesh, dtype: torch.dtype | None, *, requires_grad: bool = False,
                scalar: bool = False) -> torch.Tensor:
    """An outsider's local tensor: shape ``(0,)`` (``()`` holding 0 for a 0-d DTensor)."""
    dev = compute_device(mesh)
    if scalar:
        return torch.zeros((), dtype=dtype, device=dev, requires_grad=requires_grad)
    return torch.empty(0, dtype=dtype, device=dev, requires_grad=requires_grad)


def outside_result(call: OpCall, plan: Plan, written: Any) -> Any:
    """What an operator returns on a rank outside the mesh: nothing runs locally and no
    argument is moved ([Note: ranks outside the mesh]).

    ``written``: the arguments the op writes and returns (an in-place or ``out=`` op), or None.
    """
    if written is not None:
        return written
    if call.func is aten.equal.default:
        return call.dts[0].shape == call.dts[1].shape
    if plan.outputs is None:
        return None                        # a Python value only members can know
    try:
        metas = call.meta()
    except Exception as e:                 # data-dependent shapes (nonzero, unique, ...)
        raise NotImplementedError(
            f"{call.func}: rank {call.mesh.get_rank()} is not part of {call.mesh!r}, and the "
            f"global shape of the result of {call.describe()} depends on the members' values "
            "(run it on the mesh's ranks only)") from e
    leaves = list(metas) if isinstance(metas, list | tuple) else [metas]
    outputs = plan.outputs
    for i, m in enumerate(leaves):
        if not isinstance(m, torch.Tensor):
            leaves[i] = None
            continue
        pls = outputs if isinstance(outputs, tuple) else outputs[i]
        local = empty_local(call.mesh, m.dtype, scalar=m.dim() == 0)
        spec = DTensorSpec(call.mesh, tuple(pls), tuple(m.shape), tuple(m.stride()))
        leaves[i] = DTensor(local, spec, requires_grad=False)
    if isinstance(metas, list | tuple):
        return type(metas)(leaves) if type(metas) in (list, tuple) else tuple(leaves)
    return leaves[0]
