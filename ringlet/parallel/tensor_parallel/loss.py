"""``loss_parallel()``: cross-entropy over logits sharded on the class
(vocabulary) dim, never gathered.

[Note: parallel cross-entropy]
``F.cross_entropy`` reaches DTensor as ``_log_softmax`` then ``nll_loss_forward`` (or
``nll_loss2d_forward`` for inputs of 3 dims or more) and their backwards.  Inside
``loss_parallel()`` these take over when the log-probs are sharded on the class dim (dim 1,
or 0 for one sample) along exactly one mesh axis, the *TP axis*, which may be any axis of the
mesh; every other axis must be ``Shard`` of another dim (batch or sequence parallel) or
``Replicate``:

* ``_log_softmax``: local row max, all-reduce(max) along the TP axis; local sum of ``exp``,
  all-reduce(sum); the log-probs stay sharded.  Two all-reduces of one value per row.
* ``nll_loss_forward``: each rank picks the targets that fall in its class range, weights
  them, and the partial loss is all-reduced once along the TP axis.  The target is laid out
  as the logits without their class dim (``Replicate`` on the TP axis); a plain tensor target
  is taken as replicated, so it is refused when that layout shards it (a batch-sharded axis):
  pass a DTensor then.  Output: ``reduction="none"`` is laid out as the target; ``"sum"`` is
  ``Replicate`` along the TP axis and ``Partial(sum)`` along batch-sharded axes (each rank
  summed its own rows); ``"mean"`` needs the global count, so with a batch-sharded axis it is
  refused (``NotImplementedError``, as torch does): use ``"sum"`` and divide.
* ``nll_loss_backward``: ``-scale`` at each row's target, locally (no communication); the
  rows of that gradient sum to ``-scale``, which is noted on the gradient tensor.
* ``_log_softmax_backward_data``: ``g - softmax * rowsum(g)``.  ``rowsum(g)`` crosses the
  shards, but for a gradient that arrives straight from ``nll_loss_backward`` (same local
  tensor, same version: autograd did not add anything to it) the note has it, so no
  communication; any other gradient costs one all-reduce of one value per row.

Logits that are ``Replicate`` on every axis fall back to the ordinary rules (torch refuses
them).  Any other layout -- the class dim not sharded (e.g. only the batch is), sharded along
two axes, or ``Partial`` on an axis -- raises ``ValueError`` naming ``loss_parallel``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ringlet.dtensor import DTensor, Partial, Replicate, Shard
from ringlet.dtensor._api import make_dtensor
from ringlet.dtensor._decide import decide
from ringlet.dtensor._plan import OVERRIDES
from ringlet.dtensor._redistribute import redistribute_local
from ringlet.dtensor.experimental import implicit_replication

__all__ = ["loss_parallel"]

aten = torch.ops.aten
_ROW_SUM = "_ringlet_row_sum"     # (row sums, local tensor, its version) on an nll_loss gradient


@contextlib.contextmanager
def loss_parallel() -> Iterator[None]:
    """Compute ``F.cross_entropy`` on class-sharded DTensor logits without gathering them.

    Use it around the loss and its backward; the logits must be a DTensor sharded on the
    class dim (dim 1, or 0 for a single sample) along one mesh axis, e.g. the output of a
    ``ColwiseParallel(use_local_output=False)`` head flattened to ``[N, vocab]``, or
    ``[N, vocab, seq]`` (``nll_loss2d``).  Other mesh axes may shard another dim (a dp x tp
    mesh with the batch on dp) or replicate.  The target and class weights may be plain
    tensors, the same on every rank, unless the batch is sharded (then the target is a
    DTensor laid out as the logits without the class dim): inside the context plain tensors
    mixed with DTensors count as ``Replicate`` (``implicit_replication``).  Forward costs
    three all-reduces of one value per row, backward none ([Note: parallel cross-entropy]).

    Raises:
        ValueError: logits not sharded on the class dim along exactly one axis (e.g. only
            batch-sharded), ``Partial`` on an axis, or a plain target with batch-sharded
            logits.
        NotImplementedError: ``reduction="mean"`` with batch-sharded logits.

    Example::

        with loss_parallel():
            loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
            loss.backward()
    """
    token = OVERRIDES.set({**(OVERRIDES.get() or {}), **_HANDLERS})
    try:
        # targets, class weights and the masks cross_entropy derives from them are plain tensors,
        # the same on every rank: Replicate (what label smoothing's extra ops need)
        with implicit_replication():
            yield
    finally:
        OVERRIDES.reset(token)


def _class_axis(x: Any, dim: int, op: str) -> int | None:
    """The TP axis: the one mesh axis that shards dim ``dim`` of ``x``; ``None`` for logits
    replicated on every axis (the ordinary rules apply).

    Raises:
        ValueError: any other layout (see [Note: parallel cross-entropy]).
    """
    if not isinstance(x, DTensor) or x.dim() == 0:
        return None
    pls = tuple(x.placements)
    if all(isinstance(p, Replicate) for p in pls):
        return None
    dim %= x.dim()
    axes = [a for a, p in enumerate(pls) if isinstance(p, Shard) and p.dim == dim]
    if len(axes) != 1:
        raise ValueError(f"loss_parallel: {op}: expected the class dim {dim} of the input "
                         f"sharded along exactly one mesh axis, got placements {list(pls)} "
                         f"({len(axes)} such axes)")
    for a, p in enumerate(pls):
        if a != axes[0] and not isinstance(p, (Shard, Replicate)):
            raise ValueError(f"loss_parallel: {op}: expected Shard or Replicate on the mesh "
                             f"axes other than the class dim's ({axes[0]}), got {p!r} on axis "
                             f"{a} (placements {list(pls)})")
    return axes[0]


def _target_placements(x: DTensor, axis: int, cdim: int) -> tuple[Any, ...]:
    """The layout of the target (and of an unreduced loss): the logits' without the class
    dim, Replicate along the TP axis."""
    out: list[Any] = []
    for a, p in enumerate(x.placements):
        if a == axis or not isinstance(p, Shard):
            out.append(Replicate())
        else:
            out.append(Shard(p.dim - 1) if p.dim > cdim else p)
    return tuple(out)


def _reduce(t: torch.Tensor, x: DTensor, axis: int, op: str) -> torch.Tensor:
    """All-reduce ``t`` along ``axis`` of ``x``'s mesh (``op``: sum or max)."""
    n = x.device_mesh.ndim
    src = tuple(Partial(op) if a == axis else Replicate() for a in range(n))
    return redistribute_local(t, x.device_mesh, src, (Replicate(),) * n, tuple(t.shape))


def _log_softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, half_to_float = args[0], args[1], bool(args[2]) if len(args) > 2 else False
    axis = _class_axis(x, dim, "log_softmax")
    if axis is None:
        return decide(func, args, kwargs, overrides=False)
    local = x._local_tensor.float() if half_to_float else x._local_tensor
    if local.shape[dim] == 0:         # an empty shard of the classes contributes nothing
        top = local.new_full([*local.shape[:dim % local.dim()], 1,
                              *local.shape[dim % local.dim() + 1:]],
                             float("-inf"))
    else:
        top = local.amax(dim, keepdim=True)
    top = _reduce(top, x, axis, "max")
    shifted = local - top
    total = _reduce(shifted.exp().sum(dim, keepdim=True), x, axis, "sum")
    return DTensor(shifted - total.log(), x._spec, requires_grad=False)


def _targets(x: DTensor, axis: int, target: Any, weight: Any, ignore_index: int,
             cdim: int, op: str) -> tuple[Any, ...]:
    """(target local, in-my-range mask, index into my shard, per-row weight with ignored rows 0).

    Raises:
        ValueError: a plain tensor target where the target's layout is sharded.
    """
    want = _target_placements(x, axis, cdim)
    if isinstance(target, DTensor):
        if tuple(target.placements) != want:
            target = target.redistribute(x.device_mesh, want)
        t = target._local_tensor
    elif any(isinstance(p, Shard) for p in want):
        raise ValueError(f"loss_parallel: {op}: the input {x!r} is sharded along a batch axis, so "
                         f"the target must be a DTensor laid out as {list(want)} (a plain tensor "
                         "could be the whole target or this rank's rows); wrap it with "
                         "DTensor.from_local or distribute_tensor")
    else:
        t = target
    spec = x._spec
    lo, rows = spec.local_offset()[cdim], spec.local_shape()[cdim]
    inside = (t >= lo) & (t < lo + rows)
    index = torch.where(inside, t - lo, torch.zeros_like(t))
    valid = t != ignore_index
    if weight is None:
        w = valid.to(x.dtype)
    else:
        full = weight.full_tensor() if isinstance(weight, DTensor) else weight
        w = full[torch.where(valid, t, torch.zeros_like(t))] * valid
    return t, inside & valid, index, w


def _loss_placements(x: DTensor, axis: int, cdim: int, reduction: int,
                     op: str) -> tuple[Any, ...]:
    """Placements of the loss (see [Note: parallel cross-entropy])."""
    if reduction == 0:
        return _target_placements(x, axis, cdim)
    batch = [a for a, p in enumerate(x.placements) if a != axis and isinstance(p, Shard)]
    if reduction == 1 and batch:
        raise NotImplementedError(
            f"loss_parallel: {op}: reduction='mean' needs the global number of targets, and "
            f"the input {x!r} is sharded along batch axes {batch}; use reduction='sum' (or "
            "'none') and divide by the global count")
    return tuple(Partial() if a in batch else Replicate() for a in range(x.device_mesh.ndim))


def _nll_forward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, target, weight, reduction, ignore_index = args[:5]
    op = func.__name__.split(".")[0]
    cdim = 1 if x.dim() >= 2 else 0
    axis = _class_axis(x, cdim, op)
    if axis is None:
        return decide(func, args, kwargs, overrides=False)
    out_pls = _loss_placements(x, axis, cdim, reduction, op)
    t, mine, index, w = _targets(x, axis, target, weight, ignore_index, cdim, op)
    if bool((((t < 0) | (t >= x.shape[cdim])) & (t != ignore_index)).any()):
        raise IndexError(f"loss_parallel: {op}: expected targets in [0, {x.shape[cdim]}) or "
                         f"ignore_index {ignore_index}, got "
                         f"{t.tolist() if t.numel() <= 16 else 'values outside'}")
    local = x._local_tensor
    picked = local.gather(cdim, index.unsqueeze(cdim)).squeeze(cdim) if local.shape[cdim] else \
        torch.zeros(index.shape, dtype=local.dtype, device=local.device)
    contrib = -torch.where(mine, picked, torch.zeros_like(picked)) * w
    total_weight = w.sum()
    out = contrib if reduction == 0 else contrib.sum()
    out = _reduce(out, x, axis, "sum")
    if reduction == 1:
        out = out / total_weight
    shape = tuple(s for d, s in enumerate(x.shape) if d != cdim) if reduction == 0 else ()
    mesh = x.device_mesh
    return (make_dtensor(out, mesh, out_pls, shape),
            make_dtensor(total_weight, mesh, _loss_placements(x, axis, cdim, 2, op), ()))


def _row_scale(grad: Any, reduction: int, w: torch.Tensor, total_weight: Any) -> torch.Tensor:
    g = grad._local_tensor if isinstance(grad, DTensor) else grad
    if reduction == 1:
        tw = total_weight._local_tensor if isinstance(total_weight, DTensor) else total_weight
        return g / tw * w
    return g * w


def _nll_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad, x, target, weight, reduction, ignore_index, total_weight = args[:7]
    op = func.__name__.split(".")[0]
    cdim = 1 if x.dim() >= 2 else 0
    axis = _class_axis(x, cdim, op)
    if axis is None:
        return decide(func, args, kwargs, overrides=False)
    if isinstance(grad, DTensor):     # the loss's gradient, laid out as the loss (Partial read
        want = _target_placements(x, axis, cdim) if reduction == 0 else \
            (Replicate(),) * x.device_mesh.ndim     # as Replicate: each rank's part counts once)
        if tuple(grad.placements) != want:
            grad = grad.redistribute(x.device_mesh, want)
    _, mine, index, w = _targets(x, axis, target, weight, ignore_index, cdim, op)
    scale = _row_scale(grad, reduction, w, total_weight)
    local = x._local_tensor
    picked = torch.where(mine, -scale, torch.zeros_like(scale)).to(local.dtype)
    local_grad = torch.zeros_like(local).scatter_(cdim, index.unsqueeze(cdim),
                                                  picked.unsqueeze(cdim))
    out = DTensor(local_grad, x._spec, requires_grad=False)
    # Every row of the global gradient sums to -scale (its one target); remember it so that the
    # log-softmax backward needs no all-reduce, as long as this very tensor arrives unmodified.
    row_sum = (-scale).to(local.dtype).unsqueeze(cdim)
    setattr(out, _ROW_SUM, (row_sum, local_grad, local_grad._version))
    return out


def _known_row_sum(grad: Any) -> torch.Tensor | None:
    note = getattr(grad, _ROW_SUM, None)
    if note is None or grad._local_tensor is not note[1] or note[1]._version != note[2]:
        return None
    return note[0]


def _log_softmax_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad, output, dim = args[0], args[1], args[2]
    input_dtype = args[3] if len(args) > 3 else output.dtype
    axis = _class_axis(output, dim, "log_softmax_backward")
    if axis is None or not isinstance(grad, DTensor) or grad.placements != output.placements:
        return decide(func, args, kwargs, overrides=False)
    g = grad._local_tensor
    row_sum = _known_row_sum(grad)
    if row_sum is None:
        row_sum = _reduce(g.sum(dim, keepdim=True), output, axis, "sum")
    local = g - output._local_tensor.exp() * row_sum
    return DTensor(local.to(input_dtype), output._spec, requires_grad=False)


_HANDLERS = {
    aten._log_softmax.default: _log_softmax,
    aten._log_softmax_backward_data.default: _log_softmax_backward,
    aten.nll_loss_forward.default: _nll_forward,
    aten.nll_loss_backward.default: _nll_backward,
    aten.nll_loss2d_forward.default: _nll_forward,
    aten.nll_loss2d_backward.default: _nll_backward,
}
