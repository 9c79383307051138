"""What DDP reads from a forward's outputs: their tensors, and the autograd graph behind them.

[Note: DDP and autograd]
The reducer needs two moments of every synchronised backward pass:

- its *start*, to queue the end-of-backward callback.  The callback must be queued on the
  outermost graph task: ``Variable._execution_engine.queue_callback`` attaches it to the
  graph task running on this thread, and a reentrant activation checkpoint
  (``torch.utils.checkpoint(..., use_reentrant=True)``) runs a nested backward whose
  callbacks fire as soon as that checkpointed segment is done.  So DDP puts a pre-hook on the
  ``grad_fn`` of every output tensor: those nodes run first, on the outer task.
  (Parameter hooks queue it too, as a fallback for gradients that bypass the outputs.)
- the set of parameters the outputs depend on (``find_unused_parameters``): a walk from the
  outputs' ``grad_fn`` through ``next_functions`` to the ``AccumulateGrad`` nodes, whose
  ``variable`` is the parameter.  Parameters inside a reentrant checkpoint are hidden behind
  the checkpoint's node; they are found late (their hook fires anyway) -- see
  ``Reducer._on_grad_ready``.

Pre-hooks stay on nodes of this iteration's graph only, which is freed after backward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch

__all__ = ["hook_backward_start", "iter_tensors", "reachable_params"]


def iter_tensors(obj: Any, _depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor in a (nested) output: tensors, tuples, lists, dicts, dataclasses."""
    if _depth > 64:   # a self-referencing structure; DDP needs no tensors that deep
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            yield from iter_tensors(x, _depth + 1)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from iter_tensors(x, _depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from iter_tensors(getattr(obj, f.name, None), _depth + 1)


def _grad_fns(outputs: Any) -> list[Any]:
    fns, seen = [], set()
    for t in iter_tensors(outputs):
        fn = t.grad_fn
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            fns.append(fn)
    return fns


def reachable_params(outputs: Any, index: dict[int, int]) -> set[int]:
    """Indices (values of ``index``, keyed by ``id(param)``) of parameters the outputs depend on."""
    found: set[int] = set()
    stack = _grad_fns(outputs)
    seen = {id(fn) for fn in stack}
    while stack:
        fn = stack.pop()
        var = getattr(fn, "variable", None)     # AccumulateGrad nodes name their leaf
        if var is not None:
            i = index.get(id(var))
            if i is not None:
                found.add(i)
        for nxt, _ in fn.next_functions:
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return found


def hook_backward_start(outputs: Any, callback: Callable[[], None]) -> int:
    """Call ``callback()`` when backward reaches any output's ``grad_fn``;
    returns the nodes hooked."""
    fns = _grad_fns(outputs)

    def prehook(grad_outputs: Any) -> None:
        callback()

    for fn in fns:
        fn.register_prehook(prehook)
    return len(fns)
