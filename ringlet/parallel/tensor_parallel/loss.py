"""``loss_parallel()``: cross-entropy over logits sharded on the class
(vocabulary) dim, never gathered.

[Note: parallel cross-entropy]
``F.cross_entropy`` reaches DTensor as ``_log_softmax`` then ``nll_loss_forward`` (and
their backwards).  Inside ``loss_parallel()`` these four take over when the log-probs
are sharded on the class dim along one mesh axis (``Replicate`` elsewhere):

* ``_log_softmax``: local row max, all-reduce(max); local sum of ``exp``, all-reduce(sum);
  the log-probs stay sharded.  Two all-reduces of one value per row.
* ``nll_loss_forward``: each rank picks the targets that fall in its class range (the
  target is replicated), weights them, and the partial loss is all-reduced once.
* ``nll_loss_backward``: ``-scale`` at each row's target, locally (no communication); the
  rows of that gradient sum to ``-scale``, which is noted on the gradient tensor.
* ``_log_softmax_backward_data``: ``g - softmax * rowsum(g)``.  ``rowsum(g)`` crosses the
  shards, but for a gradient that arrives straight from ``nll_loss_backward`` (same local
  tensor, same version: autograd did not add anything to it) the note has it, so no
  communication; any other gradient costs one all-reduce of one value per row.

Anything else (unsharded class dim, ``nll_loss2d``) falls back to the ordinary rules.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ringlet.dtensor import DTensor, Partial, Replicate, Shard
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
    class dim (dim 1, or 0 for a single sample), e.g. the output of a
    ``ColwiseParallel(use_local_output=False)`` head flattened to ``[N, vocab]``.  The
    target and class weights may be plain tensors, the same on every rank: inside the
    context plain tensors mixed with DTensors count as ``Replicate``
    (``implicit_replication``).  Forward costs three
    all-reduces of one value per row, backward none ([Note: parallel cross-entropy]).

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


def _class_axis(x: Any, dim: int) -> int | None:
    """The mesh axis that shards dim ``dim`` of ``x`` when every other axis is
    Replicate, else None."""
    if not isinstance(x, DTensor) or x.dim() == 0:
        return None
    dim %= x.dim()
    axes = [a for a, p in enumerate(x.placements) if isinstance(p, Shard) and p.dim == dim]
    others = all(isinstance(p, Replicate) for a, p in enumerate(x.placements) if a not in axes)
    return axes[0] if len(axes) == 1 and others else None


def _reduce(t: torch.Tensor, x: DTensor, axis: int, op: str) -> torch.Tensor:
    """All-reduce ``t`` along ``axis`` of ``x``'s mesh (``op``: sum or max)."""
    n = x.device_mesh.ndim
    src = tuple(Partial(op) if a == axis else Replicate() for a in range(n))
    return redistribute_local(t, x.device_mesh, src, (Replicate(),) * n, tuple(t.shape))


def _log_softmax(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, dim, half_to_float = args[0], args[1], bool(args[2]) if len(args) > 2 else False
    axis = _class_axis(x, dim)
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


def _targets(x: DTensor, target: Any, weight: Any, ignore_index: int, cdim: int) -> tuple[Any, ...]:
    """(target local, in-my-range mask, index into my shard, per-row weight with ignored rows 0)."""
    t = target._local_tensor if isinstance(target, DTensor) else target
    if isinstance(target, DTensor) and not all(p.is_replicate() for p in target.placements):
        t = target.full_tensor()
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


def _nll_forward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    x, target, weight, reduction, ignore_index = args[:5]
    cdim = 1 if x.dim() == 2 else 0
    axis = _class_axis(x, cdim)
    if axis is None or x.dim() > 2:
        return decide(func, args, kwargs, overrides=False)
    t, mine, index, w = _targets(x, target, weight, ignore_index, cdim)
    if bool((((t < 0) | (t >= x.shape[cdim])) & (t != ignore_index)).any()):
        raise IndexError(f"loss_parallel: nll_loss: expected targets in [0, {x.shape[cdim]}) or "
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
    return _replicated(out, x), _replicated(total_weight, x)


def _replicated(t: torch.Tensor, like: DTensor) -> DTensor:
    from ringlet.dtensor._api import make_dtensor

    return make_dtensor(t, like.device_mesh, (Replicate(),) * like.device_mesh.ndim, tuple(t.shape))


def _row_scale(grad: Any, reduction: int, w: torch.Tensor, total_weight: Any) -> torch.Tensor:
    g = grad._local_tensor if isinstance(grad, DTensor) else grad
    if reduction == 1:
        tw = total_weight._local_tensor if isinstance(total_weight, DTensor) else total_weight
        return g / tw * w
    return g * w


def _nll_backward(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    grad, x, target, weight, reduction, ignore_index, total_weight = args[:7]
    cdim = 1 if x.dim() == 2 else 0
    axis = _class_axis(x, cdim)
    if axis is None or x.dim() > 2 or (isinstance(grad, DTensor) and not all(
            p.is_replicate() for p in grad.placements)):
        return decide(func, args, kwargs, overrides=False)
    _, mine, index, w = _targets(x, target, weight, ignore_index, cdim)
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
    axis = _class_axis(output, dim)
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
}
