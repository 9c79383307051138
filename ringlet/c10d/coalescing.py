"""``_coalescing_manager``: collectives issued inside the block travel together.

torch's context manager (still used by published code, e.g. to batch gradient
all-reduces) lets the backend fuse the ops of the block.  Here every
``all_reduce``, ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` issued on
the manager's group inside the block is checked at once (a bad argument raises at
the call, as outside the block) and held; at the end of the block the held ops are
issued as one flat collective per (kind, dtype, reduce op), in the order their
first op appeared, and the results are copied back into the users' tensors.  Any
other op on the group inside the block first issues what is held, so that the
ranks' sequences stay identical.

``async_ops=False``: results are in place when the block ends.  ``async_ops=True``:
the manager's ``works`` complete them; ``cm.wait()`` waits for all.  An op called
with ``async_op=True`` inside the block returns a Work that completes with its batch.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch

from ringlet.c10d import _call, checks
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.work import Work, _Completed
from ringlet.transport.reduce import RedOpType

__all__ = ["_CoalescingManager", "_coalescing_manager", "held_by", "try_hold"]

_open: contextvars.ContextVar[tuple[_Coalescer, ...]] = contextvars.ContextVar("ringlet_coalescing",
                                                                               default=())


class _CoalescingManager:
    """What ``with _coalescing_manager(...) as cm`` gives: the block's Works and ``wait()``."""

    def __init__(self) -> None:
        self.works: list[Work] = []

    def append(self, work: Work | None) -> None:
        if work is not None:
            self.works.append(work)

    def wait(self) -> None:
        for w in self.works:
            w.wait()


class _Deferred(Work):
    """The Work of an op held in a block: it follows its batch's Work once the block ends."""

    def __init__(self, op: str) -> None:
        super().__init__(op=op)
        self._target: Work | None = None

    def _bind(self, target: Work) -> None:
        self._target = target

    def wait(self, timeout: Any = None) -> bool:
        if self._target is None:
            raise RuntimeError(f"{self._op}: wait() inside its _coalescing_manager block: the op "
                               "is issued when the block ends; wait after it")
        return self._target.wait(timeout)

    def is_completed(self) -> bool:
        return self._target is not None and self._target.is_completed()

    def get_future(self) -> torch.futures.Future:
        if self._target is None:
            raise RuntimeError(f"{self._op}: get_future() inside its _coalescing_manager block")
        return self._target.get_future()


class _Coalescer:
    def __init__(self, pg: ProcessGroup, async_ops: bool) -> None:
        self.pg = pg
        self.async_ops = async_ops
        self.batches: dict[tuple[Any, ...], list[tuple[Any, ...]]] = {}
        self.deferred: dict[tuple[Any, ...], list[_Deferred]] = {}
        self.issuing = False

    def hold(self, key: tuple[Any, ...], item: tuple[Any, ...], async_op: bool) -> Work | None:
        self.batches.setdefault(key, []).append(item)
        if not async_op:
            return None
        d = _Deferred(f"{key[0]} (coalesced)")
        self.deferred.setdefault(key, []).append(d)
        return d

    def issue(self) -> list[Work]:
        """Issue every held batch (in first-appearance order); returns their Works."""
        if self.issuing or not self.batches:
            return []
        self.issuing = True
        works: list[Work] = []
        try:
            batches, self.batches = self.batches, {}
            deferred, self.deferred = self.deferred, {}
            for key, items in batches.items():
                w = _ISSUE[key[0]](self.pg, key, items, self.async_ops)
                done = w if w is not None else _Completed(op=key[0])
                for d in deferred.get(key, []):
                    d._bind(done)
                if w is not None:
                    works.append(w)
        finally:
            self.issuing = False
        return works


def held_by(pg: ProcessGroup) -> _Coalescer | None:
    """The open coalescer of ``pg`` that should hold an op now, if any."""
    for c in _open.get():
        if c.pg is pg and not c.issuing:
            return c
    return None


def try_hold(pg: ProcessGroup, key: tuple[Any, ...], item: tuple[Any, ...],
             async_op: bool) -> tuple[bool, Work | None]:
    """Hold a checked op in ``pg``'s open block: (True, its Work or None), or (False, None)."""
    c = held_by(pg)
    if c is None:
        return False, None
    return True, c.hold(key, item, async_op)


def _flush_before_other_ops(pg: ProcessGroup) -> None:
    for c in _open.get():
        if c.pg is pg and c.batches and not c.issuing:
            c.issue()


@contextlib.contextmanager
def _coalescing_manager(group: GroupArg = None, device: Any = None,
                        async_ops: bool = False) -> Iterator[_CoalescingManager]:
    """Coalesce the collectives issued on ``group`` inside the block (torch's private API).

    Args:
        group: the process group (default: the world).
        device: accepted for torch's signature; ringlet's transports need no staging device.
        async_ops: if True the block ends without waiting; ``cm.wait()`` completes the ops.

    Example::

        with dist._coalescing_manager(async_ops=True) as cm:
            for t in grads:
                dist.all_reduce(t)
        cm.wait()
    """
    cm = _CoalescingManager()
    pg = _call.resolve(group, "_coalescing_manager", quiet=True)
    if pg is None:
        yield cm
        return
    if any(c.pg is pg for c in _open.get()):
        raise checks.fail(ValueError, "_coalescing_manager", "group",
                          f"expected a group without an open coalescing block, got {pg!r}")
    c = _Coalescer(pg, bool(async_ops))
    token = _open.set((*_open.get(), c))
    if _flush_before_other_ops not in _call.flush_hooks:
        _call.flush_hooks.append(_flush_before_other_ops)
    try:
        yield cm
    finally:
        _open.reset(token)
    for w in c.issue():       # not reached when the block raised: nothing is issued then
        cm.append(w)
    if not async_ops:
        cm.wait()


# -- the batched ops ------------------------------------------------------------------------
def _issue_all_reduce(pg: ProcessGroup, key: tuple[Any, ...], items: list[tuple[Any, ...]],
                      async_op: bool) -> Work | None:
    _, dtype, red, factor = key
    ts = [it[0] for it in items]
    flat = torch.cat([checks.contiguous_input(t).reshape(-1) for t in ts])
    ctx = pg.context("all_reduce", dtype=dtype, numel=flat.numel(), redop=int(red))

    def fn() -> None:
        pg.transport.all_reduce(flat, RedOpType(red), factor, ctx)
        off = 0
        for t in ts:
            t.copy_(flat[off:off + t.numel()].view(t.shape))
            off += t.numel()
    return _call.launch(pg, "all_reduce_coalesced", fn, ctx, ts, async_op)


def _issue_all_gather(pg: ProcessGroup, key: tuple[Any, ...], items: list[tuple[Any, ...]],
                      async_op: bool) -> Work | None:
    n = pg.size()
    outs, ins = [it[0] for it in items], [it[1] for it in items]
    flat_in = torch.cat([checks.contiguous_input(t).reshape(-1) for t in ins])
    total = flat_in.numel()
    flat_out = torch.empty(n * total, dtype=flat_in.dtype, device=flat_in.device)
    ctx = pg.context("all_gather", dtype=flat_in.dtype, numel=total)

    def fn() -> None:
        pg.transport.all_gather(flat_in, flat_out, ctx)
        rows, off = flat_out.view(n, total), 0
        for o, i in zip(outs, ins):
            k = i.numel()
            o.copy_(rows[:, off:off + k].reshape(o.shape))
            off += k
    return _call.launch(pg, "all_gather_into_tensor_coalesced", fn, ctx, outs, async_op)


def _issue_reduce_scatter(pg: ProcessGroup, key: tuple[Any, ...], items: list[tuple[Any, ...]],
                          async_op: bool) -> Work | None:
    _, dtype, red, factor = key
    n = pg.size()
    outs, ins = [it[0] for it in items], [it[1] for it in items]
    # Block r of the flat input holds block r of every input, so one reduce-scatter serves all.
    flat_in = torch.cat([checks.contiguous_input(t).reshape(n, -1) for t in ins], dim=1).reshape(-1)
    flat_out = torch.empty(flat_in.numel() // n, dtype=dtype, device=flat_in.device)
    ctx = pg.context("reduce_scatter", dtype=dtype, numel=flat_out.numel(), redop=int(red))

    def fn() -> None:
        pg.transport.reduce_scatter(flat_in, flat_out, RedOpType(red), factor, ctx)
        off = 0
        for o in outs:
            o.copy_(flat_out[off:off + o.numel()].view(o.shape))
            off += o.numel()
    return _call.launch(pg, "reduce_scatter_tensor_coalesced", fn, ctx, outs, async_op)


_ISSUE = {"all_reduce": _issue_all_reduce, "all_gather_into_tensor": _issue_all_gather,
          "reduce_scatter_tensor": _issue_reduce_scatter}
