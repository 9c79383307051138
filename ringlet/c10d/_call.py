"""Issuing a validated operation: the ``group=`` argument, profiler labels, the queued re-proof.

Every collective and point-to-point function resolves its group with :func:`resolve`
and hands its transport call to :func:`launch` (collectives) or :func:`launch_p2p`.
Both are thin: what they add to :meth:`ProcessGroup.run` is

- the op's name and input tensors for its ``torch.profiler`` event, which
  :meth:`ProcessGroup.run` records as torch does (``gloo:all_reduce``: the group's backend
  name and the op; input shapes; an asynchronous span; [Note: profiler events]).  When no
  profiler runs the cost is one ``torch._C._autograd._profiler_enabled()`` call;
- for an op that will run later on a communication thread, a second proof of its
  tensors' bounds right before the transport touches them (see [Note: the
  validation gate] in ``checks``);
- pending coalesced ops (``_coalescing_manager``) are issued before any other op
  on their group, so that every rank issues the same sequence.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ringlet.c10d import checks
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.work import Work
from ringlet.c10d.world import get_rank, resolve_group
from ringlet.transport.base import OpContext

__all__ = ["flatten_tensors", "launch", "launch_p2p", "resolve"]

# Set by ringlet.c10d.coalescing while a _coalescing_manager block is open: flush(pg) issues
# the ops it holds for pg.  A list so that the hook costs one truthiness test when unused.
flush_hooks: list[Callable[[ProcessGroup], None]] = []


def resolve(group: GroupArg, op: str, holdable: bool = False,
            quiet: bool = False) -> ProcessGroup | None:
    """The group of a call (None: this rank is not a member), with the argument checked.

    A call on a group this rank is not in does nothing, and warns as torch does
    (``UserWarning: Running all_reduce on global rank 2 which does not belong to the given
    group.``) unless ``quiet`` (queries and context managers that are not operations).
    ``holdable``: the op may be held by an open coalescing block of its group (which then
    must not issue what it holds first)."""
    try:
        pg = resolve_group(group)
    except TypeError:
        raise checks.fail(TypeError, op, "group", "expected a ProcessGroup (from new_group), "
                          f"group.WORLD or None, got {type(group).__name__}") from None
    if pg is None:
        if not quiet:
            warnings.warn(f"Running {op} on global rank {get_rank()} which does not belong to "
                          "the given group.", UserWarning, stacklevel=3)
        return None
    if flush_hooks and not holdable:
        for hook in flush_hooks:
            hook(pg)
    return pg


def flatten_tensors(x: Any) -> list[torch.Tensor]:
    """The tensors of a (nested) list, in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    out: list[torch.Tensor] = []
    if isinstance(x, (list, tuple)):
        for item in x:
            out += flatten_tensors(item)
    return out


_profiling = torch._C._autograd._profiler_enabled


def launch(pg: ProcessGroup, name: str, fn: Callable[[], None], ctx: OpContext, result: Any,
           async_op: bool, guard: bool = True, inputs: Any = None) -> Work | None:
    """:meth:`ProcessGroup.run` with the profiler label and, when queued, the re-proof.

    ``inputs``: the tensors the profiler event records (default: ``result``)."""
    if async_op or pg._executor.pending > 0 or _profiling():
        fn = _reproving(fn, result, name)
    elif not pg._accel:
        pg.run_now(fn, ctx, result, guard)     # the latency path: inline, no Work
        return None
    return pg.run(fn, ctx, result, async_op, guard, label=name, inputs=inputs)


def launch_p2p(pg: ProcessGroup, name: str, fn: Callable[[Work], None], peer: int, direction: str,
               ctx: OpContext, result: list[torch.Tensor]) -> Work:
    """:meth:`ProcessGroup.run_p2p` (always queued) with the re-proof and the profiler label."""
    def proved(work: Work) -> None:
        checks.reprove(result, name)
        fn(work)
    # event: ctx.op, "send"/"recv" as torch
    return pg.run_p2p(proved, peer, direction, ctx, result)


def _reproving(fn: Callable[[], None], result: Any, name: str) -> Callable[[], None]:
    tensors = flatten_tensors(result)

    def proved() -> None:
        checks.reprove(tensors, name)
        fn()
    return proved
