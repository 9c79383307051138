"""Device tensors on ringlet's CPU transports, staged through host memory.

``init_process_group("gloo")`` (ringlet's ``auto``) accepts CUDA tensors, as torch's gloo does:
each call copies its device tensors into host memory (pinned, so the copies are DMA transfers),
runs the CPU transport on the host copies, and copies the results back.  This is also how
several ranks share one GPU -- NCCL refuses two ranks on one device -- in tests and on small
machines.  ``selection.open_transport`` puts a :class:`HostStagedTransport` behind the ``cuda``
entry of a :class:`~ringlet.transport.split.DeviceSplitTransport` when CUDA is available, so CPU
tensors still go straight to the CPU transport.

Copies are blocking (``copy_`` without ``non_blocking``): when a call returns, the results are in
the device tensors and no copy is pending on any stream.  The ordering of a call after the
kernels that produced its inputs is the process-group layer's job ([Note: CUDA streams] in
``ringlet/c10d/_cuda.py``): it runs the call on a side stream that first waits for an event
recorded on the caller's stream.

Example::

    dist.init_process_group("gloo")                     # two ranks sharing cuda:0
    t = torch.ones(4, device="cuda")
    dist.all_reduce(t)                                  # shm all-reduce of a pinned host copy
"""

from __future__ import annotations

import torch

from ringlet.transport.base import OpContext, Ranks, ReduceArg, Transport

__all__ = ["HostStagedTransport"]


def _subset(ranks: Ranks) -> dict[str, Ranks]:
    return {} if ranks is None else {"ranks": ranks}


def _empty_host(t: torch.Tensor) -> torch.Tensor:
    """Host memory for ``t``'s bytes: pinned when ``t`` is a CUDA tensor."""
    return torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)


def _to_host(t: torch.Tensor) -> torch.Tensor:
    return _empty_host(t).copy_(t)


class HostStagedTransport(Transport):
    """``main`` (a CPU transport) serving device tensors through host copies.

    ``main`` is shared with the CPU side of the group and owned by it: closing or aborting this
    transport leaves ``main`` to its owner.  Every call stages every tensor it is given; the
    split in front of it sends only device tensors here.
    """

    def __init__(self, main: Transport, devices: tuple[str, ...] = ("cuda",)) -> None:
        self.main = main
        self.devices = tuple(devices)
        self.name = f"{main.name} staged"
        self.rank = getattr(main, "rank", 0)
        self.world_size = getattr(main, "world_size", 0)
        self.subsets = main.subsets

    def __repr__(self) -> str:
        return f"HostStagedTransport({list(self.devices)} through {self.main!r})"

    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        host = _to_host(buf)
        self.main.all_reduce(host, op, factor, ctx, **_subset(ranks))
        buf.copy_(host)

    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        host = _to_host(buf)
        self.main.reduce(host, op, factor, root, ctx, **_subset(ranks))
        buf.copy_(host)          # non-roots: their own values, unchanged

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        host = _to_host(buf)
        self.main.broadcast(host, root, ctx, **_subset(ranks))
        buf.copy_(host)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        host = _empty_host(out)
        self.main.all_gather(_to_host(inp), host, ctx, **_subset(ranks))
        out.copy_(host)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        host = _empty_host(out) if out is not None else None
        self.main.gather(_to_host(inp), host, root, ctx, **_subset(ranks))
        if out is not None and host is not None:
            out.copy_(host)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        host = _empty_host(out)
        src = _to_host(inp) if inp is not None else None
        self.main.scatter(src, host, root, ctx, **_subset(ranks))
        out.copy_(host)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        host = _empty_host(out)
        self.main.reduce_scatter(_to_host(inp), host, op, factor, ctx, **_subset(ranks))
        out.copy_(host)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        host = _empty_host(out)
        self.main.all_to_all(_to_host(inp), in_splits, host, out_splits, ctx, **_subset(ranks))
        out.copy_(host)

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        self.main.barrier(ctx, **_subset(ranks))

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        self.main.send(_to_host(buf), dst, tag, ctx)

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        host = _empty_host(buf)
        got = self.main.recv(host, src, tag, ctx)
        buf.copy_(host)
        return got

    # ``main`` belongs to the CPU side of the group (the split closes and aborts it).
    def abort(self, reason: str) -> None:
        """Nothing of its own to poison: ``main``'s owner aborts it."""

    def close(self) -> None:
        """Nothing of its own to release: ``main``'s owner closes it."""
