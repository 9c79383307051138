"""Collectives whose arguments are lists of tensors: ``all_gather``, ``gather``, ``scatter``,
``reduce_scatter``, ``all_to_all`` and the coalesced ones.

Same contract as ``collectives`` ([Note: the validation gate] in ``checks``): every
tensor of every list is checked -- type, layout, device, dtype against the list's
reference, storage bounds, overlap of outputs -- before the sequence number is
taken; the lists travel as one flat buffer and the results are copied back into
the users' tensors.
"""

from __future__ import annotations

from typing import Any

import torch

from ringlet.c10d import _call, checks
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.reduce_op import ReduceOp, check_complex
from ringlet.c10d.work import Work

__all__ = [
    "all_gather",
    "all_gather_coalesced",
    "all_reduce_coalesced",
    "all_to_all",
    "gather",
    "reduce_scatter",
    "reduce_scatter_into",
    "scatter",
]


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([checks.contiguous_input(t).reshape(-1) for t in ts])


def _unflatten(flat: torch.Tensor, outs: list[torch.Tensor], off: int = 0) -> None:
    for o in outs:
        o.copy_(flat[off:off + o.numel()].view(o.shape))
        off += o.numel()


def _same_numel(op: str, arg: str, ts: list[torch.Tensor], want: int, like: str) -> None:
    for i, t in enumerate(ts):
        if t.numel() != want:
            raise checks.fail(ValueError, op, f"{arg}[{i}]", f"expected {want} elements "
                              f"(like {like}), got {t.numel()}")


def all_reduce_coalesced(tensors: list[torch.Tensor], op: Any = ReduceOp.SUM,
                         group: GroupArg = None,
                         async_op: bool = False) -> Work | None:
    """All-reduce several tensors at once: one flat buffer per dtype (in order of first use)."""
    name = "all_reduce_coalesced"
    pg = _call.resolve(group, name)
    if pg is None:
        return None
    ts = checks.tensor_list(tensors, name, "tensors", None, pg.transport.devices, out=True)
    red, factor = checks.reduce_op(op, name)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in ts:
        by_dtype.setdefault(t.dtype, []).append(t)
    for dtype in by_dtype:
        check_complex(red, dtype, name)
        checks.op_dtype(red, dtype, name)
    parts = [(_flat(group_ts), group_ts) for group_ts in by_dtype.values()]
    ctxs = [pg.context("all_reduce", dtype=flat.dtype, numel=flat.numel(), redop=int(red))
            for flat, _ in parts]

    def fn() -> None:
        for (flat, group_ts), ctx in zip(parts, ctxs):
            pg.transport.all_reduce(flat, red, factor, ctx)
            _unflatten(flat, group_ts)
    return _call.launch(pg, name, fn, ctxs[-1], ts, async_op)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group: GroupArg = None,
               async_op: bool = False) -> Work | None:
    """Gather every rank's ``tensor`` into ``tensor_list[rank]``; sizes may differ per rank."""
    pg = _call.resolve(group, "all_gather")
    if pg is None:
        return None
    devices = pg.transport.devices
    inp = checks.tensor(tensor, "all_gather", "tensor", devices)
    outs = checks.tensor_list(tensor_list, "all_gather", "tensor_list", pg.size(), devices,
                              out=True, dtype=inp.dtype, like="tensor")
    me = pg.rank()
    if outs[me].numel() != inp.numel():
        raise checks.fail(ValueError, "all_gather", f"tensor_list[{me}]", f"expected {inp.numel()} "
                          f"elements (this rank's tensor), got {outs[me].numel()}")
    if any(o.numel() != inp.numel() for o in outs):
        return _uneven_all_gather(pg, outs, inp, async_op)
    ctx = pg.context("all_gather", dtype=inp.dtype, numel=inp.numel())
    src = checks.contiguous_input(inp)
    flat = torch.empty(pg.size() * inp.numel(), dtype=inp.dtype, device=inp.device)

    def fn() -> None:
        pg.transport.all_gather(src, flat, ctx)
        _unflatten(flat, outs)
    return _call.launch(pg, "all_gather", fn, ctx, outs, async_op, inputs=[inp])


def _uneven_all_gather(pg: ProcessGroup, outs: list[torch.Tensor], inp: torch.Tensor,
                       async_op: bool) -> Work | None:
    """Different sizes per rank: one broadcast per rank (every rank knows every size)."""
    works = []
    for r, o in enumerate(outs):
        if r == pg.rank():
            buf = checks.contiguous_input(inp).clone()
        else:
            buf = torch.empty(o.numel(), dtype=o.dtype, device=o.device)
        ctx = pg.context("broadcast", dtype=o.dtype, numel=o.numel(), root=r)

        def fn(buf: torch.Tensor = buf, o: torch.Tensor = o, ctx: Any = ctx, r: int = r) -> None:
            pg.transport.broadcast(buf, r, ctx)
            o.copy_(buf.view(o.shape))
        works.append(_call.launch(pg, "all_gather", fn, ctx, [o], async_op))
    return works[-1] if async_op else None


def all_gather_coalesced(output_tensor_lists: list[list[torch.Tensor]],
                         input_tensor_list: list[torch.Tensor], group: GroupArg = None,
                         async_op: bool = False) -> Work | None:
    """``all_gather`` of several tensors at once (one flat exchange)."""
    name = "all_gather_coalesced"
    pg = _call.resolve(group, name)
    if pg is None:
        return None
    devices = pg.transport.devices
    ins = checks.tensor_list(input_tensor_list, name, "input_tensor_list", None, devices)
    checks.same_dtype(name, ins[0].dtype, ins, "input_tensor_list", "input_tensor_list[0]")
    if not isinstance(output_tensor_lists, (list, tuple)) or len(output_tensor_lists) != pg.size():
        got = len(output_tensor_lists) if isinstance(output_tensor_lists, (list, tuple)) else \
            type(output_tensor_lists).__name__
        raise checks.fail(ValueError, name, "output_tensor_lists", f"expected {pg.size()} lists "
                          f"(one per rank), got {got}")
    outs = []
    for r, lst in enumerate(output_tensor_lists):
        o = checks.tensor_list(lst, name, f"output_tensor_lists[{r}]", len(ins), devices, out=True,
                               dtype=ins[0].dtype, like="input_tensor_list")
        for i, (a, b) in enumerate(zip(o, ins)):
            if a.numel() != b.numel():
                raise checks.fail(ValueError, name, f"output_tensor_lists[{r}][{i}]", "expected "
                                  f"{b.numel()} elements (like "
                                  f"input_tensor_list[{i}]), got {a.numel()}")
        outs.append(o)
    flat_in = _flat(ins)
    n = flat_in.numel()
    flat_out = torch.empty(pg.size() * n, dtype=flat_in.dtype, device=flat_in.device)
    ctx = pg.context("all_gather", dtype=flat_in.dtype, numel=n)

    def fn() -> None:
        pg.transport.all_gather(flat_in, flat_out, ctx)
        for r, o in enumerate(outs):
            _unflatten(flat_out, o, r * n)
    return _call.launch(pg, name, fn, ctx, outs, async_op, inputs=ins)


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op: Any = ReduceOp.SUM,
                   group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Reduce ``input_list[r]`` across ranks into rank ``r``'s ``output``."""
    pg = _call.resolve(group, "reduce_scatter")
    if pg is None:
        return None
    out = checks.tensor(output, "reduce_scatter", "output", pg.transport.devices, out=True)
    ins = checks.tensor_list(input_list, "reduce_scatter", "input_list", pg.size(),
                             pg.transport.devices, dtype=out.dtype, like="output")
    _same_numel("reduce_scatter", "input_list", ins, out.numel(), "output")
    red, factor = checks.reduce_op(op, "reduce_scatter")
    checks.op_dtype(red, out.dtype, "reduce_scatter")
    return reduce_scatter_into(pg, "reduce_scatter", out, _flat(ins), red, factor, async_op)


def reduce_scatter_into(pg: ProcessGroup, name: str, out: torch.Tensor, inp: torch.Tensor, red: Any,
                        factor: float | None, async_op: bool,
                        plain: tuple[bool, bool] | None = None) -> Work | None:
    """Issue a checked reduce-scatter of ``inp`` (``size`` blocks) into ``out``.

    ``plain``: whether ``inp`` and ``out`` may be used as they are, when the caller already
    knows (:func:`checks.dense`); else it is asked here."""
    ctx = pg.context("reduce_scatter", dtype=out.dtype, numel=out.numel(), redop=int(red))
    in_plain, out_plain = plain if plain is not None else (checks.plain(inp), checks.plain(out))
    src = inp if in_plain else checks.contiguous_input(inp)
    tr = pg.transport
    if out_plain:     # the latency path: no staging, no autograd guard unless grads are involved
        return _call.launch(pg, name, lambda: tr.reduce_scatter(src, out, red, factor, ctx), ctx,
                            [out], async_op, out.requires_grad or inp.requires_grad)
    st = checks.Staged(out)

    def fn() -> None:
        pg.transport.reduce_scatter(src, st.buf, red, factor, ctx)
        st.finish()
    return _call.launch(pg, name, fn, ctx, [out], async_op)


def all_to_all(output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor],
               group: GroupArg = None, async_op: bool = False) -> Work | None:
    """Send ``input_tensor_list[j]`` to rank ``j``; receive rank ``i``'s into
    ``output_tensor_list[i]``."""
    pg = _call.resolve(group, "all_to_all")
    if pg is None:
        return None
    n, devices = pg.size(), pg.transport.devices
    ins = checks.tensor_list(input_tensor_list, "all_to_all", "input_tensor_list", n, devices)
    checks.same_dtype("all_to_all", ins[0].dtype, ins, "input_tensor_list", "input_tensor_list[0]")
    outs = checks.tensor_list(output_tensor_list, "all_to_all", "output_tensor_list", n, devices,
                              out=True, dtype=ins[0].dtype, like="input_tensor_list[0]")
    flat_in = _flat(ins)
    flat_out = torch.empty(sum(o.numel() for o in outs), dtype=ins[0].dtype, device=ins[0].device)
    in_b = [t.numel() * t.element_size() for t in ins]
    out_b = [t.numel() * t.element_size() for t in outs]
    ctx = pg.context("all_to_all", dtype=ins[0].dtype, numel=0)

    def fn() -> None:
        pg.transport.all_to_all(flat_in.view(torch.uint8), in_b, flat_out.view(torch.uint8), out_b,
                                ctx)
        _unflatten(flat_out, outs)
    return _call.launch(pg, "all_to_all", fn, ctx, outs, async_op, inputs=ins)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None,
           dst: int | None = None, group: GroupArg = None, async_op: bool = False,
           group_dst: int | None = None) -> Work | None:
    """Gather every rank's ``tensor`` into ``gather_list`` on ``dst``."""
    pg = _call.resolve(group, "gather")
    if pg is None:
        return None
    inp = checks.tensor(tensor, "gather", "tensor", pg.transport.devices)
    root = checks.peer(pg, dst, group_dst, "gather", "dst")
    outs: list[torch.Tensor] | None = None
    if pg.rank() == root:
        outs = checks.tensor_list(gather_list, "gather", "gather_list", pg.size(),
                                  pg.transport.devices, out=True, dtype=inp.dtype, like="tensor")
        _same_numel("gather", "gather_list", outs, inp.numel(), "tensor")
    elif gather_list:
        raise checks.fail(ValueError, "gather", "gather_list",
                          "expected None on non-destination ranks, got a list")
    ctx = pg.context("gather", dtype=inp.dtype, numel=inp.numel(), root=root)
    src = checks.contiguous_input(inp)
    flat = (torch.empty(pg.size() * inp.numel(), dtype=inp.dtype, device=inp.device)
            if outs is not None else None)

    def fn() -> None:
        pg.transport.gather(src, flat, root, ctx)
        if outs is not None and flat is not None:
            _unflatten(flat, outs)
    return _call.launch(pg, "gather", fn, ctx, outs or [], async_op)


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None,
            src: int | None = None, group: GroupArg = None, async_op: bool = False,
            group_src: int | None = None) -> Work | None:
    """Send ``scatter_list[r]`` from ``src`` to rank ``r``'s ``tensor``."""
    pg = _call.resolve(group, "scatter")
    if pg is None:
        return None
    out = checks.tensor(tensor, "scatter", "tensor", pg.transport.devices, out=True)
    root = checks.peer(pg, src, group_src, "scatter", "src")
    flat = None
    if pg.rank() == root:
        ins = checks.tensor_list(scatter_list, "scatter", "scatter_list", pg.size(),
                                 pg.transport.devices, dtype=out.dtype, like="tensor")
        _same_numel("scatter", "scatter_list", ins, out.numel(), "tensor")
        flat = _flat(ins)
    elif scatter_list:
        raise checks.fail(ValueError, "scatter", "scatter_list",
                          "expected None on non-source ranks, got a list")
    ctx = pg.context("scatter", dtype=out.dtype, numel=out.numel(), root=root)
    st = checks.Staged(out)

    def fn() -> None:
        pg.transport.scatter(flat, st.buf, root, ctx)
        st.finish()
    return _call.launch(pg, "scatter", fn, ctx, [out], async_op)
