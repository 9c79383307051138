"""Tensor collectives with torch.distributed's signatures and semantics.

Each function checks its arguments through the one gate (``checks``; [Note: the
validation gate]) before anything is sent, stages non-contiguous or conjugate
tensors through contiguous buffers (results land in the user's strided view),
allocates the group's next sequence number and hands the transport call to
``_call.launch`` (which adds the profiler label and hands it to
:meth:`ProcessGroup.run`: inline, or on the group's communication thread).
``async_op=True`` returns a :class:`Work`; otherwise the call returns ``None``
once the results are in place.  A rank that is not a member of ``group`` returns
``None`` at once, as in torch.  The list-shaped collectives (``all_gather``,
``gather``, ``scatter``, ``all_to_all``, the coalesced ones) live in
``list_collectives`` and are re-exported here.
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from typing import Any

import torch

from ringlet.c10d import _call, checks, coalescing, debug, sparse
from ringlet.c10d.checks import Staged
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.list_collectives import (
    all_gather,
    all_gather_coalesced,
    all_reduce_coalesced,
    all_to_all,
    gather,
    reduce_scatter,
    reduce_scatter_into,
    scatter,
)
from ringlet.c10d.reduce_op import ReduceOp, check_complex
from ringlet.c10d.work import Work
from ringlet.errors import CollectiveTimeoutError

__all__ = [
    "_all_gather_base",
    "_reduce_scatter_base",
    "all_gather",
    "all_gather_coalesced",
    "all_gather_into_tensor",
    "all_reduce",
    "all_reduce_coalesced",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "broadcast",
    "gather",
    "monitored_barrier",
    "peer_rank",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "scatter",
]


def peer_rank(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, op: str,
              arg: str) -> int:
    """Group rank of a root/peer given either torch's global ``src``/``dst`` or
    ``group_src``/``group_dst``."""
    return checks.peer(pg, global_rank, group_rank, op, arg)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: GroupArg = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place on every rank.

    Raises:
        TypeError, ValueError: before anything is sent, for an argument the gate refuses.
    """
    pg = _call.resolve(group, "all_reduce", holdable=True)
    if pg is None:
        return None
    # gloo's sparse SUM (ringlet.c10d.sparse)
    if getattr(tensor, "layout", None) is torch.sparse_coo:
        return sparse.all_reduce(pg, tensor, op, async_op, all_gather_into_tensor, all_gather)
    t, flat = checks.dense(tensor, "all_reduce", "tensor", pg.transport.devices, out=True)
    red, factor = checks.reduce_op(op, "all_reduce")
    if red != ReduceOp.SUM:
        check_complex(red, t.dtype, "all_reduce")
        checks.op_dtype(red, t.dtype, "all_reduce")
    if _call.flush_hooks:
        held, w = coalescing.try_hold(pg, ("all_reduce", t.dtype, int(red), factor), (t,), async_op)
        if held:
            return w
    ctx = pg.context("all_reduce", t.dtype, t.numel(), -1, red)
    tr = pg.transport
    if flat:
        return _call.launch(pg, "all_reduce", lambda: tr.all_reduce(t, red, factor, ctx), ctx, [t],
                            async_op, t.requires_grad)
    st = Staged(t)

    def fn() -> None:
        tr.all_reduce(st.buf, red, factor, ctx)
        st.finish()
    return _call.launch(pg, "all_reduce", fn, ctx, [t], async_op)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM,
           group: GroupArg = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across the group into ``dst``'s ``tensor``."""
    pg = _call.resolve(group, "reduce")
    if pg is None:
        return None
    t = checks.tensor(tensor, "reduce", "tensor", pg.transport.devices, out=True)
    root = checks.peer(pg, dst, group_dst, "reduce", "dst")
    red, factor = checks.reduce_op(op, "reduce")
    checks.op_dtype(red, t.dtype, "reduce")
    ctx = pg.context("reduce", dtype=t.dtype, numel=t.numel(), redop=int(red), root=root)
    st = Staged(t)

    def fn() -> None:
        pg.transport.reduce(st.buf, red, factor, root, ctx)
        if root == pg.rank():
            st.finish()
    return _call.launch(pg, "reduce", fn, ctx, [t], async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: GroupArg = None,
              async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor``."""
    pg = _call.resolve(group, "broadcast")
    if pg is None:
        return None
    root = checks.peer(pg, src, group_src, "broadcast", "src")
    # Only receivers write; the source's tensor is only read (an expanded view may be sent).
    t, flat = checks.dense(tensor, "broadcast", "tensor", pg.transport.devices,
                           out=root != pg.rank())
    ctx = pg.context("broadcast", t.dtype, t.numel(), root)
    tr = pg.transport
    if flat:
        return _call.launch(pg, "broadcast", lambda: tr.broadcast(t, root, ctx), ctx, [t], async_op,
                            t.requires_grad)
    st = Staged(t)

    def fn() -> None:
        tr.broadcast(st.buf, root, ctx)
        if root != pg.rank():
            st.finish()
    return _call.launch(pg, "broadcast", fn, ctx, [t], async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (concatenated
    or stacked on dim 0)."""
    op = "all_gather_into_tensor"
    pg = _call.resolve(group, op, holdable=True)
    if pg is None:
        return None
    inp, in_plain = checks.dense(input_tensor, op, "input_tensor", pg.transport.devices)
    out, out_plain = checks.dense(output_tensor, op, "output_tensor", pg.transport.devices,
                                  out=True)
    checks.blocks(out, "output_tensor", inp, "input_tensor", pg.size(), op)
    if _call.flush_hooks:
        held, w = coalescing.try_hold(pg, (op, inp.dtype), (out, inp), async_op)
        if held:
            return w
    ctx = pg.context("all_gather", inp.dtype, inp.numel())
    src = inp if in_plain else checks.contiguous_input(inp)
    tr = pg.transport
    if out_plain:     # the latency path: no staging, no autograd guard unless grads are involved
        return _call.launch(pg, op, lambda: tr.all_gather(src, out, ctx), ctx, [out], async_op,
                            out.requires_grad or inp.requires_grad, inputs=[inp])
    st = Staged(out)

    def fn() -> None:
        tr.all_gather(src, st.buf, ctx)
        st.finish()
    return _call.launch(pg, op, fn, ctx, [out], async_op, inputs=[inp])


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Reduce ``input`` (``size`` blocks) across ranks; block ``r`` lands in
    rank ``r``'s ``output``."""
    name = "reduce_scatter_tensor"
    pg = _call.resolve(group, name, holdable=True)
    if pg is None:
        return None
    out, out_plain = checks.dense(output, name, "output", pg.transport.devices, out=True)
    inp, in_plain = checks.dense(input, name, "input", pg.transport.devices)
    checks.blocks(inp, "input", out, "output", pg.size(), name)
    red, factor = checks.reduce_op(op, name)
    checks.op_dtype(red, out.dtype, name)
    if _call.flush_hooks:
        held, w = coalescing.try_hold(pg, (name, out.dtype, int(red), factor), (out, inp), async_op)
        if held:
            return w
    return reduce_scatter_into(pg, name, out, inp, red, factor, async_op, (in_plain, out_plain))


def _all_gather_base(output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                     group: GroupArg = None,
                     async_op: bool = False) -> Work | None:
    """Deprecated name of :func:`all_gather_into_tensor` (still called by published code)."""
    warnings.warn("ringlet.distributed._all_gather_base is deprecated; use all_gather_into_tensor",
                  FutureWarning, stacklevel=2)
    return all_gather_into_tensor(output_tensor, input_tensor, group, async_op)


def _reduce_scatter_base(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                         group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Deprecated name of :func:`reduce_scatter_tensor` (still called by published code)."""
    warnings.warn("ringlet.distributed._reduce_scatter_base is "
                  "deprecated; use reduce_scatter_tensor",
                  FutureWarning, stacklevel=2)
    return reduce_scatter_tensor(output, input, op, group, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None,
                      input_split_sizes: list[int] | None = None, group: GroupArg = None,
                      async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``) and exchange the pieces."""
    name = "all_to_all_single"
    pg = _call.resolve(group, name)
    if pg is None:
        return None
    out = checks.tensor(output, name, "output", pg.transport.devices, out=True)
    inp = checks.tensor(input, name, "input", pg.transport.devices)
    if out.dtype != inp.dtype:
        raise checks.fail(TypeError, name, "output",
                          f"expected dtype {inp.dtype} (like input), got {out.dtype}")
    n = pg.size()
    in_rows = checks.split_sizes(input_split_sizes, n, _rows(inp), name, "input_split_sizes")
    out_rows = checks.split_sizes(output_split_sizes, n, _rows(out), name, "output_split_sizes")
    in_b = [r * _row_bytes(inp) for r in in_rows]
    out_b = [r * _row_bytes(out) for r in out_rows]
    ctx = pg.context("all_to_all", dtype=inp.dtype, numel=0)
    src = checks.contiguous_input(inp)
    st = Staged(out)

    def fn() -> None:
        pg.transport.all_to_all(_bytes(src), in_b, _bytes(st.buf), out_b, ctx)
        st.finish()
    return _call.launch(pg, name, fn, ctx, [out], async_op, inputs=[inp])


def _rows(t: torch.Tensor) -> int:
    return t.shape[0] if t.dim() else 1


def _row_bytes(t: torch.Tensor) -> int:
    rows = _rows(t)
    return (t.numel() // rows if rows else 0) * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _seconds(timeout: Any, op: str) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise checks.fail(TypeError, op, "timeout",
                          f"expected a datetime.timedelta, got {timeout!r}")
    if not seconds > 0:
        raise checks.fail(ValueError, op, "timeout",
                          f"expected a positive duration, got {timeout!r}")
    return seconds


def barrier(group: GroupArg = None, async_op: bool = False, device_ids: Any = None,
            timeout: timedelta | None = None) -> Work | None:
    """Block until every rank of the group has entered the barrier.

    Args:
        group: the process group (default: the world).
        async_op: return a :class:`Work` instead of waiting.
        device_ids: torch's list of one device index (chooses the GPU NCCL uses); checked and
            otherwise unused, since ringlet's barrier moves no tensor.
        timeout: this barrier's deadline (a ``timedelta``) instead of the group's.

    Raises:
        CollectiveTimeoutError: ranks did not arrive within the deadline (named in the error).

    Example::

        dist.barrier(timeout=timedelta(seconds=30))
    """
    pg = _call.resolve(group, "barrier")
    if pg is None:
        return None
    if device_ids is not None and (not isinstance(device_ids, (list, tuple))
                                   or any(checks._int(d) is None or d < 0 for d in device_ids)):
        raise checks.fail(TypeError, "barrier", "device_ids",
                          f"expected a list of device indices, got {device_ids!r}")
    seconds = _seconds(timeout, "barrier")
    ctx = pg.context("barrier")
    if seconds is not None:
        ctx.timeout = seconds
        ctx.deadline = ctx.started + seconds
    return _call.launch(pg, "barrier", lambda: pg.transport.barrier(ctx), ctx, [], async_op, False)


def monitored_barrier(group: GroupArg = None, timeout: Any = None,
                      wait_all_ranks: bool = False) -> None:
    """A barrier that, on timeout, raises naming every rank that did not arrive.

    The error starts with torch's text ("Rank 1 failed to pass monitoredBarrier in 2000 ms";
    ``wait_all_ranks=True``: "Ranks 1, 2 failed ..."), then ringlet's report, which names every
    missing rank whatever ``wait_all_ranks`` says.
    """
    pg = _call.resolve(group, "monitored_barrier")
    if pg is None:
        return
    zero = timeout == 0 or isinstance(timeout, timedelta) and not timeout  # torch: fail at once
    seconds = (0.0 if zero and not isinstance(timeout, bool)
               else _seconds(timeout, "monitored_barrier"))
    ctx = pg.context("monitored_barrier")
    if seconds is not None:
        ctx.timeout = seconds
        ctx.deadline = ctx.started + seconds
    try:
        _call.launch(pg, "monitored_barrier", lambda: pg.transport.barrier(ctx), ctx, [], False)
    except CollectiveTimeoutError as e:
        raise debug.monitored_barrier_error(pg, e, seconds, wait_all_ranks) from None
