"""Tensor collectives with torch.distributed's signatures and semantics.

Each function checks its arguments (before anything is sent), stages
non-contiguous tensors through contiguous buffers (results land in the user's
strided view), allocates the group's next sequence number and hands the
transport call to :meth:`ProcessGroup.run`, which runs it inline or on the
group's communication thread.  ``async_op=True`` returns a :class:`Work`;
otherwise the call returns ``None`` once the results are in place.  A rank
that is not a member of ``group`` returns ``None`` at once, as in torch.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.c10d import checks
from ringlet.c10d.checks import Staged
from ringlet.c10d.group import ProcessGroup
from ringlet.c10d.reduce_op import ReduceOp, resolve_op
from ringlet.c10d.work import Work
from ringlet.c10d.world import resolve_group
from ringlet.transport.reduce import check_op_dtype

__all__ = [
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


def peer_rank(pg: ProcessGroup, global_rank: int | None, group_rank: int | None, op: str, arg: str) -> int:
    """Group rank of a root/peer given either torch's global ``src``/``dst`` or ``group_src``/``group_dst``."""
    if global_rank is not None and group_rank is not None:
        raise ValueError(f"{op}: give either {arg} or group_{arg}, not both")
    if group_rank is not None:
        return checks.root(group_rank, pg.size(), op, f"group_{arg}")
    if global_rank is None:
        global_rank = 0 if op in ("broadcast", "reduce", "gather", "scatter") else None
        if global_rank is None:
            raise ValueError(f"{op}: {arg}: expected a rank, got None")
    if not isinstance(global_rank, int) or global_rank not in pg.ranks:
        raise ValueError(f"{op}: {arg}: expected a global rank of the group {pg.ranks}, got {global_rank!r}")
    return pg.ranks.index(global_rank)


def all_reduce(tensor: torch.Tensor, op: Any = ReduceOp.SUM, group: Any = None,
               async_op: bool = False) -> Work | None:
    """Reduce ``tensor`` across the group in place on every rank."""
    pg = resolve_group(group)
    if pg is None:
        return None
    t = checks.tensor(tensor, "all_reduce", "tensor", pg.transport.devices)
    red, factor = resolve_op(op, "all_reduce")
    if red != ReduceOp.SUM:
        check_op_dtype(red, t.dtype, "all_reduce")
    ctx = pg.context("all_reduce", t.dtype, t.numel(), -1, red)
    tr = pg.transport
    if t.is_contiguous():
        return pg.run(lambda: tr.all_reduce(t, red, factor, ctx), ctx, [t], async_op, t.requires_grad)
    checks.writable(t, "all_reduce", "tensor")
    st = Staged(t)

    def fn() -> None:
        tr.all_reduce(st.buf, red, factor, ctx)
        st.finish()
    return pg.run(fn, ctx, [t], async_op)


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM, group: Any = None,
                         async_op: bool = False) -> Work | None:
    """All-reduce several tensors of one dtype as one flat buffer."""
    pg = resolve_group(group)
    if pg is None:
        return None
    ts = checks.tensor_list(tensors, "all_reduce_coalesced", "tensors", None, pg.transport.devices)
    checks.same_dtype("all_reduce_coalesced", ts[0].dtype, ts, "tensors")
    red, factor = resolve_op(op, "all_reduce_coalesced")
    check_op_dtype(red, ts[0].dtype, "all_reduce_coalesced")
    flat = torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)
    ctx = pg.context("all_reduce", dtype=flat.dtype, numel=flat.numel(), redop=int(red))

    def fn() -> None:
        pg.transport.all_reduce(flat, red, factor, ctx)
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view_as(t))
            off += t.numel()
    return pg.run(fn, ctx, ts, async_op)


def reduce(tensor: torch.Tensor, dst: int | None = None, op: Any = ReduceOp.SUM, group: Any = None,
           async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Reduce ``tensor`` across the group into ``dst``'s ``tensor``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    t = checks.tensor(tensor, "reduce", "tensor", pg.transport.devices)
    checks.writable(t, "reduce", "tensor")
    root = peer_rank(pg, dst, group_dst, "reduce", "dst")
    red, factor = resolve_op(op, "reduce")
    check_op_dtype(red, t.dtype, "reduce")
    ctx = pg.context("reduce", dtype=t.dtype, numel=t.numel(), redop=int(red), root=root)
    st = Staged(t)

    def fn() -> None:
        pg.transport.reduce(st.buf, red, factor, root, ctx)
        if root == pg.rank():
            st.finish()
    return pg.run(fn, ctx, [t], async_op)


def broadcast(tensor: torch.Tensor, src: int | None = None, group: Any = None, async_op: bool = False,
              group_src: int | None = None) -> Work | None:
    """Copy ``src``'s ``tensor`` into every rank's ``tensor``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    t = checks.tensor(tensor, "broadcast", "tensor", pg.transport.devices)
    root = peer_rank(pg, src, group_src, "broadcast", "src")
    ctx = pg.context("broadcast", t.dtype, t.numel(), root)
    tr = pg.transport
    if t.is_contiguous():
        return pg.run(lambda: tr.broadcast(t, root, ctx), ctx, [t], async_op, t.requires_grad)
    checks.writable(t, "broadcast", "tensor")
    st = Staged(t)

    def fn() -> None:
        tr.broadcast(st.buf, root, ctx)
        st.finish()
    return pg.run(fn, ctx, [t], async_op)


def all_gather_into_tensor(output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any = None,
                           async_op: bool = False) -> Work | None:
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (concatenated or stacked on dim 0)."""
    pg = resolve_group(group)
    if pg is None:
        return None
    op = "all_gather_into_tensor"
    inp = checks.tensor(input_tensor, op, "input_tensor", pg.transport.devices)
    out = checks.tensor(output_tensor, op, "output_tensor", pg.transport.devices)
    checks.writable(out, op, "output_tensor")
    checks.blocks(out, "output_tensor", inp, "input_tensor", pg.size(), op)
    ctx = pg.context("all_gather", dtype=inp.dtype, numel=inp.numel())
    src = inp.contiguous()
    st = Staged(out)

    def fn() -> None:
        pg.transport.all_gather(src, st.buf, ctx)
        st.finish()
    return pg.run(fn, ctx, [out], async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: Any = None,
               async_op: bool = False) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``; sizes may differ per rank."""
    pg = resolve_group(group)
    if pg is None:
        return None
    inp = checks.tensor(tensor, "all_gather", "tensor", pg.transport.devices)
    outs = checks.tensor_list(tensor_list, "all_gather", "tensor_list", pg.size(), pg.transport.devices)
    checks.same_dtype("all_gather", inp.dtype, outs, "tensor_list")
    for i, o in enumerate(outs):
        checks.writable(o, "all_gather", f"tensor_list[{i}]")
    me = pg.rank()
    if outs[me].numel() != inp.numel():
        raise ValueError(f"all_gather: tensor_list[{me}]: expected {inp.numel()} elements (this rank's "
                         f"tensor), got {outs[me].numel()}")
    if any(o.numel() != inp.numel() for o in outs):
        return _uneven_all_gather(pg, outs, inp, async_op)
    ctx = pg.context("all_gather", dtype=inp.dtype, numel=inp.numel())
    src = inp.contiguous()
    flat = torch.empty(pg.size() * inp.numel(), dtype=inp.dtype, device=inp.device)

    def fn() -> None:
        pg.transport.all_gather(src, flat, ctx)
        n = inp.numel()
        for r, o in enumerate(outs):
            o.copy_(flat[r * n:(r + 1) * n].view_as(o))
    return pg.run(fn, ctx, outs, async_op)


def _uneven_all_gather(pg: ProcessGroup, outs: list[torch.Tensor], inp: torch.Tensor,
                       async_op: bool) -> Work | None:
    """Different sizes per rank: one broadcast per rank (every rank knows every size)."""
    works = []
    for r, o in enumerate(outs):
        buf = inp.contiguous().clone() if r == pg.rank() else torch.empty(o.numel(), dtype=o.dtype, device=o.device)
        ctx = pg.context("broadcast", dtype=o.dtype, numel=o.numel(), root=r)

        def fn(buf: torch.Tensor = buf, o: torch.Tensor = o, ctx: Any = ctx, r: int = r) -> None:
            pg.transport.broadcast(buf, r, ctx)
            o.copy_(buf.view_as(o))
        works.append(pg.run(fn, ctx, [o], async_op))
    return works[-1] if async_op else None


def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]], input_tensor_list: list[torch.Tensor],
                         group: Any = None, async_op: bool = False) -> Work | None:
    """``all_gather`` of several tensors at once (one flat exchange)."""
    pg = resolve_group(group)
    if pg is None:
        return None
    ins = checks.tensor_list(input_tensor_list, "all_gather_coalesced", "input_tensor_list", None, pg.transport.devices)
    checks.same_dtype("all_gather_coalesced", ins[0].dtype, ins, "input_tensor_list")
    if len(output_tensor_lists) != pg.size():
        raise ValueError(f"all_gather_coalesced: output_tensor_lists: expected {pg.size()} lists, "
                         f"got {len(output_tensor_lists)}")
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    n = flat_in.numel()
    flat_out = torch.empty(pg.size() * n, dtype=flat_in.dtype, device=flat_in.device)
    ctx = pg.context("all_gather", dtype=flat_in.dtype, numel=n)

    def fn() -> None:
        pg.transport.all_gather(flat_in, flat_out, ctx)
        for r, outs in enumerate(output_tensor_lists):
            off = r * n
            for o in outs:
                o.copy_(flat_out[off:off + o.numel()].view_as(o))
                off += o.numel()
    return pg.run(fn, ctx, output_tensor_lists, async_op)


def reduce_scatter_tensor(output: torch.Tensor, input: torch.Tensor, op: Any = ReduceOp.SUM,
                          group: Any = None, async_op: bool = False) -> Work | None:
    """Reduce ``input`` (``size`` blocks) across ranks; block ``r`` lands in rank ``r``'s ``output``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    name = "reduce_scatter_tensor"
    out = checks.tensor(output, name, "output", pg.transport.devices)
    inp = checks.tensor(input, name, "input", pg.transport.devices)
    checks.writable(out, name, "output")
    checks.blocks(inp, "input", out, "output", pg.size(), name)
    red, factor = resolve_op(op, name)
    check_op_dtype(red, out.dtype, name)
    ctx = pg.context("reduce_scatter", dtype=out.dtype, numel=out.numel(), redop=int(red))
    src = inp.contiguous()
    st = Staged(out)

    def fn() -> None:
        pg.transport.reduce_scatter(src, st.buf, red, factor, ctx)
        st.finish()
    return pg.run(fn, ctx, [out], async_op)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: Any = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list[r]`` across ranks into rank ``r``'s ``output``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    out = checks.tensor(output, "reduce_scatter", "output", pg.transport.devices)
    ins = checks.tensor_list(input_list, "reduce_scatter", "input_list", pg.size(), pg.transport.devices)
    checks.same_dtype("reduce_scatter", out.dtype, ins, "input_list")
    for i, t in enumerate(ins):
        if t.numel() != out.numel():
            raise ValueError(f"reduce_scatter: input_list[{i}]: expected {out.numel()} elements (like output), "
                             f"got {t.numel()}")
    return reduce_scatter_tensor(out, torch.cat([t.reshape(-1) for t in ins]), op, group, async_op)


def all_to_all_single(output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                      group: Any = None, async_op: bool = False) -> Work | None:
    """Split ``input`` along dim 0 (evenly, or by ``input_split_sizes``) and exchange the pieces."""
    pg = resolve_group(group)
    if pg is None:
        return None
    name = "all_to_all_single"
    out = checks.tensor(output, name, "output", pg.transport.devices)
    inp = checks.tensor(input, name, "input", pg.transport.devices)
    checks.writable(out, name, "output")
    if out.dtype != inp.dtype:
        raise TypeError(f"{name}: output: expected dtype {inp.dtype} (like input), got {out.dtype}")
    in_rows = _splits(inp, input_split_sizes, pg.size(), name, "input_split_sizes")
    out_rows = _splits(out, output_split_sizes, pg.size(), name, "output_split_sizes")
    in_b = [r * _row_bytes(inp) for r in in_rows]
    out_b = [r * _row_bytes(out) for r in out_rows]
    ctx = pg.context("all_to_all", dtype=inp.dtype, numel=0)
    src = inp.contiguous()
    st = Staged(out)

    def fn() -> None:
        pg.transport.all_to_all(_bytes(src), in_b, _bytes(st.buf), out_b, ctx)
        st.finish()
    return pg.run(fn, ctx, [out], async_op)


def _row_bytes(t: torch.Tensor) -> int:
    rows = t.shape[0] if t.dim() else 1
    return (t.numel() // rows if rows else 0) * t.element_size()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _splits(t: torch.Tensor, sizes: list[int] | None, n: int, op: str, arg: str) -> list[int]:
    rows = t.shape[0] if t.dim() else 1
    if not sizes:
        if rows % n:
            raise ValueError(f"{op}: {arg} not given, so dim 0 ({rows}) must divide evenly by world size {n}")
        return [rows // n] * n
    if len(sizes) != n or any(int(s) < 0 for s in sizes) or sum(sizes) != rows:
        raise ValueError(f"{op}: {arg}: expected {n} non-negative sizes summing to dim 0 ({rows}), got {list(sizes)}")
    return [int(s) for s in sizes]


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: Any = None, async_op: bool = False) -> Work | None:
    """Send ``input_tensor_list[j]`` to rank ``j``; receive rank ``i``'s into ``output_tensor_list[i]``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    ins = checks.tensor_list(input_tensor_list, "all_to_all", "input_tensor_list", pg.size(), pg.transport.devices)
    outs = checks.tensor_list(output_tensor_list, "all_to_all", "output_tensor_list", pg.size(), pg.transport.devices)
    checks.same_dtype("all_to_all", ins[0].dtype, ins, "input_tensor_list")
    checks.same_dtype("all_to_all", ins[0].dtype, outs, "output_tensor_list")
    flat_in = torch.cat([t.reshape(-1) for t in ins])
    flat_out = torch.empty(sum(o.numel() for o in outs), dtype=ins[0].dtype, device=ins[0].device)
    in_b = [t.numel() * t.element_size() for t in ins]
    out_b = [t.numel() * t.element_size() for t in outs]
    ctx = pg.context("all_to_all", dtype=ins[0].dtype, numel=0)

    def fn() -> None:
        pg.transport.all_to_all(_bytes(flat_in), in_b, _bytes(flat_out), out_b, ctx)
        off = 0
        for o in outs:
            o.copy_(flat_out[off:off + o.numel()].view_as(o))
            off += o.numel()
    return pg.run(fn, ctx, outs, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group: Any = None, async_op: bool = False, group_dst: int | None = None) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    inp = checks.tensor(tensor, "gather", "tensor", pg.transport.devices)
    root = peer_rank(pg, dst, group_dst, "gather", "dst")
    outs: list[torch.Tensor] | None = None
    if pg.rank() == root:
        outs = checks.tensor_list(gather_list, "gather", "gather_list", pg.size(), pg.transport.devices)
        checks.same_dtype("gather", inp.dtype, outs, "gather_list")
        for i, o in enumerate(outs):
            if o.numel() != inp.numel():
                raise ValueError(f"gather: gather_list[{i}]: expected {inp.numel()} elements, got {o.numel()}")
    elif gather_list:
        raise ValueError("gather: gather_list: expected None on non-destination ranks, got a list")
    ctx = pg.context("gather", dtype=inp.dtype, numel=inp.numel(), root=root)
    src = inp.contiguous()
    flat = torch.empty(pg.size() * inp.numel(), dtype=inp.dtype, device=inp.device) if outs is not None else None

    def fn() -> None:
        pg.transport.gather(src, flat, root, ctx)
        if outs is not None and flat is not None:
            n = inp.numel()
            for r, o in enumerate(outs):
                o.copy_(flat[r * n:(r + 1) * n].view_as(o))
    return pg.run(fn, ctx, outs or [], async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group: Any = None, async_op: bool = False, group_src: int | None = None) -> Work | None:
    """Send ``scatter_list[r]`` from ``src`` to rank ``r``'s ``tensor``."""
    pg = resolve_group(group)
    if pg is None:
        return None
    out = checks.tensor(tensor, "scatter", "tensor", pg.transport.devices)
    checks.writable(out, "scatter", "tensor")
    root = peer_rank(pg, src, group_src, "scatter", "src")
    flat = None
    if pg.rank() == root:
        ins = checks.tensor_list(scatter_list, "scatter", "scatter_list", pg.size(), pg.transport.devices)
        checks.same_dtype("scatter", out.dtype, ins, "scatter_list")
        for i, t in enumerate(ins):
            if t.numel() != out.numel():
                raise ValueError(f"scatter: scatter_list[{i}]: expected {out.numel()} elements, got {t.numel()}")
        flat = torch.cat([t.reshape(-1) for t in ins])
    elif scatter_list:
        raise ValueError("scatter: scatter_list: expected None on non-source ranks, got a list")
    ctx = pg.context("scatter", dtype=out.dtype, numel=out.numel(), root=root)
    st = Staged(out)

    def fn() -> None:
        pg.transport.scatter(flat, st.buf, root, ctx)
        st.finish()
    return pg.run(fn, ctx, [out], async_op)


def barrier(group: Any = None, async_op: bool = False, device_ids: Any = None) -> Work | None:
    """Block until every rank of the group has entered the barrier."""
    pg = resolve_group(group)
    if pg is None:
        return None
    ctx = pg.context("barrier")
    return pg.run(lambda: pg.transport.barrier(ctx), ctx, [], async_op, False)


def monitored_barrier(group: Any = None, timeout: Any = None, wait_all_ranks: bool = False) -> None:
    """A barrier that, on timeout, raises naming every rank that did not arrive.

    Unlike torch's, every transport reports all missing ranks (``wait_all_ranks``
    is accepted for compatibility and always in effect).
    """
    pg = resolve_group(group)
    if pg is None:
        return
    ctx = pg.context("monitored_barrier")
    if timeout is not None:
        seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
        ctx.timeout = seconds
        ctx.deadline = ctx.started + seconds
    pg.run(lambda: pg.transport.barrier(ctx), ctx, [], False)
    return
