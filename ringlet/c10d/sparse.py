"""``all_reduce`` of a sparse COO tensor with ``ReduceOp.SUM`` (what torch's gloo backend offers).

Every rank contributes its coalesced (indices, values); ranks exchange them with the dense
collectives (sizes first, so that ranks may hold different numbers of entries), each rank adds
the contributions in rank order -- so every rank ends with the same tensor -- and the result is
written into the caller's tensor in place.  Indices received from peers are checked against the
shape (``check_invariants``) before a sparse tensor is built from them: a peer's bad index is an
error, never an out-of-bounds write.

The dense collectives this needs are handed in by ``collectives.all_reduce`` (which dispatches
sparse tensors here), so this module never imports the functional API that builds on it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d.reduce_op import resolve_op
from ringlet.c10d.work import Work, _Completed
from ringlet.transport.reduce import RedOpType

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["all_reduce"]


def all_reduce(pg: ProcessGroup, tensor: torch.Tensor, op: Any, async_op: bool,
               gather_into: Callable[..., Any], gather_list: Callable[..., Any]) -> Work | None:
    """Sum the sparse COO ``tensor`` over ``pg`` in place (the collective runs synchronously;
    with ``async_op`` the returned Work is already complete).

    ``gather_into`` and ``gather_list`` are the dense ``all_gather_into_tensor`` and
    ``all_gather`` that exchange the layouts, indices and values.

    Raises:
        ValueError: an op other than SUM, a tensor on a device the group cannot serve, or ranks
            whose tensors differ in shape or sparse/dense dimensions.
    """
    red, _ = resolve_op(op, "all_reduce")
    if red != RedOpType.SUM:
        raise ValueError("all_reduce: tensor: a sparse COO tensor is reduced with ReduceOp.SUM "
                         f"only, got ReduceOp.{red.name}")
    if tensor.device.type not in pg.transport.devices:
        raise ValueError(f"all_reduce: tensor: expected a tensor on {list(pg.transport.devices)}, "
                         f"got one on {tensor.device}")
    try:   # a tensor built with invariant checks off may hold indices outside its shape
        torch._validate_sparse_coo_tensor_args(tensor._indices(), tensor._values(), tensor.shape)
    except RuntimeError as e:
        raise ValueError(f"all_reduce: tensor: expected a valid sparse COO tensor, got one whose "
                         f"indices do not fit its shape {list(tensor.shape)}: {e}") from None
    local = tensor.coalesce()
    _check_same_layout(pg, local, gather_into)
    indices = _gather_uneven(pg, local.indices().reshape(-1), gather_into, gather_list)
    values = _gather_uneven(pg, local.values().reshape(-1), gather_into, gather_list)
    dense_shape = tuple(local.shape[local.sparse_dim():])
    total = None
    for idx, val in zip(indices, values):
        part = torch.sparse_coo_tensor(idx.view(local.sparse_dim(), -1), val.view(-1, *dense_shape),
                                       local.shape, dtype=local.dtype, check_invariants=True)
        total = part if total is None else total + part
    if total is None:  # pragma: no cover - a group has at least one rank
        raise AssertionError("empty group")
    with torch.no_grad():
        tensor.copy_(total.coalesce())
    return _Completed([tensor], op="all_reduce (sparse)") if async_op else None


def _check_same_layout(pg: ProcessGroup, t: torch.Tensor, all_gather_into_tensor: Callable[..., Any]
                       ) -> None:
    """Every rank holds a tensor of the same shape, sparse and dense dimensions."""
    for what, mine in (("sparse_dim, dense_dim", [t.sparse_dim(), t.dense_dim()]),
                       ("shape", list(t.shape))):
        local = torch.tensor(mine, dtype=torch.int64)
        every = torch.empty(pg.size() * len(mine), dtype=torch.int64)
        all_gather_into_tensor(every, local, group=pg)
        for r, theirs in enumerate(every.view(pg.size(), -1).tolist()):
            if theirs != mine:
                raise ValueError("all_reduce: tensor: expected the same sparse layout on every "
                                 f"rank; {what}: this rank {mine}, rank {pg.ranks[r]} {theirs}")


def _gather_uneven(pg: ProcessGroup, flat: torch.Tensor, all_gather_into_tensor: Callable[..., Any],
                   all_gather: Callable[..., Any]) -> list[torch.Tensor]:
    """Every rank's ``flat`` (sizes may differ), in rank order."""
    sizes = torch.empty(pg.size(), dtype=torch.int64)
    all_gather_into_tensor(sizes, torch.tensor([flat.numel()], dtype=torch.int64), group=pg)
    outs = [torch.empty(int(n), dtype=flat.dtype) for n in sizes.tolist()]
    all_gather(outs, flat.contiguous(), group=pg)
    return outs
