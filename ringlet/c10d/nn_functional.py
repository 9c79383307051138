"""Collectives that autograd differentiates: ``torch.distributed.nn.functional``'s API.

Each public function checks its arguments, then runs one collective of ``collectives`` inside a
``torch.autograd.Function`` (``_nn_autograd``) whose backward runs the adjoint collective on the
gradients.  Published as ``ringlet.distributed.nn`` and ``ringlet.distributed.nn.functional``.

[Note: collectives in autograd]

- The adjoints: ``broadcast`` <-> ``reduce`` (sum to the source, zeros elsewhere),
  ``all_gather`` <-> ``reduce_scatter``, ``gather`` <-> ``scatter``, ``all_reduce`` -> itself,
  ``all_to_all`` -> itself with the roles swapped (``all_to_all_single``: the split sizes
  swapped).  A backward calls these functions again, not the bare collectives, so
  ``create_graph=True`` records the backward's collectives too (double backward works).
- A reduction is differentiated exactly when it is linear: ``SUM``, ``AVG`` (the gradient is
  scaled by ``1/world_size``) and ``PREMUL_SUM`` (by its factor).  ``MAX``, ``MIN``,
  ``PRODUCT`` and the bitwise ops run forward, and their backward refuses naming the op: their
  gradient is no reduction of the peers' gradients.  (torch re-applies the op to the gradients
  in ``all_reduce`` and ignores it in ``reduce``/``reduce_scatter``, which gives wrong
  gradients for every op but ``SUM``, and for ``AVG`` in ``all_reduce``.)
- Inputs are never written.  ``reduce_scatter``, ``all_to_all_single`` and ``_all_gather_base``
  write into the ``output`` the caller passes and return a view of it; ``all_to_all`` fills
  ``output_tensor_list`` and returns those very tensors, as torch does.
- Every rank must run the backward of the same collectives in the same order, as for the
  forward: a rank whose output does not reach its loss (or whose input does not require grad)
  skips the backward collective, and its peers wait until the group's deadline.
- The backward uses the group the forward used, whatever the default group is by then.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from ringlet.c10d import _call, checks
from ringlet.c10d import _nn_autograd as fn
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.reduce_op import ReduceOp
from ringlet.c10d.world import get_rank

__all__ = [
    "_all_gather_base",
    "all_gather",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "broadcast",
    "gather",
    "reduce",
    "reduce_scatter",
    "scatter",
]


def _group(group: GroupArg, op: str) -> ProcessGroup:
    """The group of a call; a non-member has no result to return, so it is refused."""
    pg = _call.resolve(group, op, quiet=True)
    if pg is None:
        raise checks.fail(ValueError, op, "group", "expected a group this rank belongs to, got "
                          f"one without global rank {get_rank()} (these collectives return "
                          "tensors, so a non-member has none to return)")
    return pg


def _tensor(t: Any, op: str, arg: str, pg: ProcessGroup, out: bool = False) -> None:
    checks.tensor(t, op, arg, pg.transport.devices, out=out)


def _tensors(ts: Any, op: str, arg: str, pg: ProcessGroup, out: bool = False,
             same_shape: bool = True) -> list[Any]:
    """A list of one tensor per rank, each proven by the gate (and all of one shape)."""
    if not isinstance(ts, (list, tuple)):
        raise checks.fail(TypeError, op, arg, f"expected a list of {pg.size()} tensors (one per "
                          f"rank), got {type(ts).__name__}")
    checks.tensor_list(ts, op, arg, pg.size(), pg.transport.devices, out=out)
    for i, t in enumerate(ts):
        if same_shape and t.shape != ts[0].shape:
            raise checks.fail(ValueError, op, f"{arg}[{i}]", f"expected shape "
                              f"{tuple(ts[0].shape)} (like {arg}[0]), got {tuple(t.shape)}")
    return list(ts)


def _op(op: Any, name: str, dtype: torch.dtype) -> fn.Reduction:
    red, factor = checks.reduce_op(op, name)
    checks.op_dtype(red, dtype, name)
    return fn.Reduction(op, red, factor, name)


def broadcast(tensor: torch.Tensor, src: int, group: GroupArg = None) -> torch.Tensor:
    """Return ``src``'s ``tensor`` on every rank; its gradient is summed into ``src``.

    Args:
        tensor: this rank's tensor (read on ``src``; elsewhere it gives the result's shape).
        src: global rank of the source.
        group: the process group (default: the world).

    Returns:
        A new tensor holding ``src``'s values.  Backward: ``src``'s input gets the sum of every
        rank's gradient, the other ranks' inputs get zeros.

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.

    Example::

        w = F.broadcast(local_w, src=0)      # gradients of w on every rank reach rank 0
    """
    pg = _group(group, "broadcast")
    _tensor(tensor, "broadcast", "tensor", pg)
    root = checks.peer(pg, src, None, "broadcast", "src")
    return fn.Broadcast.apply(pg, root, tensor)


def gather(tensor: torch.Tensor, dst: int = 0, group: GroupArg = None) -> tuple[torch.Tensor, ...]:
    """Gather every rank's ``tensor`` on ``dst``.

    Args:
        tensor: this rank's contribution (the same shape on every rank).
        dst: global rank that receives.
        group: the process group (default: the world).

    Returns:
        One tensor per rank, in rank order: the gathered values on ``dst``, zeros elsewhere.
        Backward: ``dst``'s gradients are scattered back (other ranks' gradients of the zeros
        are ignored).

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.
    """
    pg = _group(group, "gather")
    _tensor(tensor, "gather", "tensor", pg)
    root = checks.peer(pg, dst, None, "gather", "dst")
    return fn.Gather.apply(pg, root, tensor)


def scatter(tensors: list[torch.Tensor], src: int = 0, group: GroupArg = None) -> torch.Tensor:
    """Send ``tensors[r]`` from ``src`` to rank ``r``.

    Args:
        tensors: one tensor per rank, all of one shape, on every rank: read on ``src``, elsewhere
            they only give the result's shape and dtype (as in torch, receivers pass a list too).
        src: global rank of the source.
        group: the process group (default: the world).

    Returns:
        This rank's piece.  Backward: the pieces' gradients are gathered into ``src``'s
        ``tensors``; the other ranks' ``tensors`` get zeros.

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.
    """
    pg = _group(group, "scatter")
    ts = _tensors(tensors, "scatter", "tensors", pg)
    root = checks.peer(pg, src, None, "scatter", "src")
    return fn.Scatter.apply(pg, root, *ts)


def reduce(tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM,
           group: GroupArg = None) -> torch.Tensor:
    """Reduce every rank's ``tensor`` into ``dst``.

    Args:
        tensor: this rank's contribution (not modified).
        dst: global rank that receives the reduction.
        op: a ``ReduceOp``; backward needs ``SUM``, ``AVG`` or ``PREMUL_SUM``.
        group: the process group (default: the world).

    Returns:
        The reduction on ``dst``; elsewhere a copy of ``tensor`` (torch leaves it unspecified),
        whose gradient is ignored.  Backward: ``dst``'s gradient is broadcast to every rank
        (scaled by ``1/world_size`` for ``AVG``, by the factor for ``PREMUL_SUM``).

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent;
            ValueError in backward for an op that is not linear.
    """
    pg = _group(group, "reduce")
    _tensor(tensor, "reduce", "tensor", pg)
    root = checks.peer(pg, dst, None, "reduce", "dst")
    return fn.Reduce.apply(pg, root, _op(op, "reduce", tensor.dtype), tensor)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: GroupArg = None) -> torch.Tensor:
    """Reduce ``input_list[r]`` over the ranks into rank ``r``'s ``output``.

    Args:
        output: receives this rank's block (written in place).
        input_list: one tensor per rank, each with ``output``'s number of elements.
        op: a ``ReduceOp``; backward needs ``SUM``, ``AVG`` or ``PREMUL_SUM``.
        group: the process group (default: the world).

    Returns:
        A view of ``output``.  Backward: the gradients are all-gathered into ``input_list``'s
        (scaled as for :func:`reduce`).

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent;
            ValueError in backward for an op that is not linear.
    """
    pg = _group(group, "reduce_scatter")
    _tensor(output, "reduce_scatter", "output", pg, out=True)
    ins = _tensors(input_list, "reduce_scatter", "input_list", pg)
    return fn.ReduceScatter.apply(pg, _op(op, "reduce_scatter", output.dtype), output, *ins)


def all_gather(tensor: torch.Tensor, group: GroupArg = None) -> tuple[torch.Tensor, ...]:
    """Gather every rank's ``tensor`` on every rank.

    Args:
        tensor: this rank's contribution (the same shape on every rank).
        group: the process group (default: the world).

    Returns:
        One new tensor per rank, in rank order.  Backward: the gradients are reduce-scattered
        (summed over ranks), so rank ``r``'s input gets the sum of every rank's gradient of
        the ``r``-th output.

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.

    Example::

        feats = torch.cat(F.all_gather(local_feats))   # the whole batch, gradients flow back
    """
    pg = _group(group, "all_gather")
    _tensor(tensor, "all_gather", "tensor", pg)
    return fn.AllGather.apply(pg, tensor)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: GroupArg = None) -> tuple[torch.Tensor, ...]:
    """Send ``input_tensor_list[j]`` to rank ``j``; receive rank ``i``'s into
    ``output_tensor_list[i]``.

    Args:
        output_tensor_list: one tensor per rank, filled in place.
        input_tensor_list: one tensor per rank (not modified).
        group: the process group (default: the world).

    Returns:
        The tensors of ``output_tensor_list`` themselves.  Backward: the gradients travel back
        the way the data came.

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.
    """
    pg = _group(group, "all_to_all")
    outs = _tensors(output_tensor_list, "all_to_all", "output_tensor_list", pg, out=True,
                    same_shape=False)
    ins = _tensors(input_tensor_list, "all_to_all", "input_tensor_list", pg, same_shape=False)
    return fn.AllToAll.apply(pg, outs, *ins)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None,
                      group: GroupArg = None) -> torch.Tensor:
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``) and exchange the pieces
    into ``output`` (split by ``output_split_sizes``).

    Args:
        output: receives the pieces in rank order (written in place).
        input: this rank's rows (not modified).
        output_split_sizes, input_split_sizes: rows from / to each rank; None: even splits.
        group: the process group (default: the world).

    Returns:
        A view of ``output``.  Backward: an ``all_to_all_single`` of the gradient with the split
        sizes swapped.

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent.
    """
    pg = _group(group, "all_to_all_single")
    _tensor(output, "all_to_all_single", "output", pg, out=True)
    _tensor(input, "all_to_all_single", "input", pg)
    return fn.AllToAllSingle.apply(pg, (output_split_sizes, input_split_sizes), output, input)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM,
               group: GroupArg = None) -> torch.Tensor:
    """Reduce every rank's ``tensor``; every rank gets the result.

    Args:
        tensor: this rank's contribution (not modified).
        op: a ``ReduceOp``; backward needs ``SUM``, ``AVG`` or ``PREMUL_SUM``.
        group: the process group (default: the world).

    Returns:
        A new tensor, bit-identical on every rank.  Backward: the gradients are all-reduced
        with the same op (``SUM``: summed; ``AVG``: averaged).

    Raises:
        TypeError, ValueError: for an argument the collectives refuse, before anything is sent;
            ValueError in backward for ``MAX``, ``MIN``, ``PRODUCT`` or a bitwise op.

    Example::

        total = F.all_reduce(local_loss)           # every rank's loss, gradients flow back
    """
    pg = _group(group, "all_reduce")
    _tensor(tensor, "all_reduce", "tensor", pg)
    return fn.AllReduce.apply(pg, _op(op, "all_reduce", tensor.dtype), tensor)


def _all_gather_base(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: GroupArg = None) -> torch.Tensor:
    """Deprecated torch name: ``all_gather_into_tensor`` with gradients (torch's runs its
    backward on NCCL only; here on every transport).  Returns a view of ``output_tensor``."""
    warnings.warn("ringlet.distributed.nn.functional._all_gather_base is deprecated; use "
                  "all_gather", FutureWarning, stacklevel=2)
    pg = _group(group, "all_gather_into_tensor")
    _tensor(output_tensor, "all_gather_into_tensor", "output_tensor", pg, out=True)
    _tensor(input_tensor, "all_gather_into_tensor", "input_tensor", pg)
    return fn.AllGatherBase.apply(pg, output_tensor, input_tensor)
