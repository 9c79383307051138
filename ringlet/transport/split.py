"""Per-device transports: CPU tensors on one of ringlet's transports, CUDA tensors on torch's NCCL.

``init_process_group(backend="cpu:gloo,cuda:nccl")`` (torch's spelling; also
``"cpu:shm,cuda:nccl"``, ``"cpu:tcp,cuda:torch:nccl"``) gives a group whose CPU tensors go through
ringlet's own transport and whose CUDA tensors go through torch's NCCL engine (the
``torch_engine`` adapter).  Each call goes to the transport of its tensors' device.  The CUDA side
is built at the first call with a CUDA tensor, so that the same script runs unchanged on a machine
without a GPU (where no CUDA tensor can exist); its NCCL communicators are then created by NCCL
itself, lazily, as usual.

Example::

    dist.init_process_group("cpu:gloo,cuda:nccl")
    dist.all_reduce(torch.ones(4))                 # ringlet's shm / tcp / shm+tcp
    dist.all_reduce(torch.ones(4, device="cuda"))  # torch's NCCL
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from ringlet.transport.base import OpContext, Ranks, ReduceArg, Transport

__all__ = ["DeviceSplitTransport"]


def _subset(ranks: Ranks) -> dict[str, Ranks]:
    return {} if ranks is None else {"ranks": ranks}


class DeviceSplitTransport(Transport):
    """One transport per device type; ``lazy`` ones are built by their factory at first use."""

    def __init__(self, main: Transport, lazy: dict[str, Callable[[], Transport]],
                 name: str, stream_ordered: tuple[str, ...] = ()) -> None:
        self.main = main
        self.stream_ordered = tuple(stream_ordered)   # of the lazy ones (NCCL's "cuda")
        self._factories = dict(lazy)
        self._built: dict[str, Transport] = {d: main for d in main.devices}
        self._lock = threading.Lock()
        self._aborted: str | None = None
        self.devices = tuple(self._built) + tuple(d for d in lazy if d not in self._built)
        self.name = name
        self.subsets = main.subsets

    def __repr__(self) -> str:
        return f"DeviceSplitTransport({self.name}: {self.main!r} + {sorted(self._factories)})"

    def _for(self, t: torch.Tensor | None) -> Transport:
        kind = t.device.type if t is not None else "cpu"
        tr = self._built.get(kind)
        if tr is not None:
            return tr
        with self._lock:
            tr = self._built.get(kind)
            if tr is None:
                factory = self._factories.get(kind)
                if factory is None:
                    raise ValueError(f"this group serves {list(self.devices)} tensors, "
                                     f"got one on {kind}")
                tr = factory()
                if self._aborted is not None:
                    tr.abort(self._aborted)
                self._built[kind] = tr
        return tr

    # -- every call goes to the transport of its tensors' device ---------------------------------
    # (``ranks`` is passed on only when given: a registered transport may not take it.)
    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        self._for(buf).all_reduce(buf, op, factor, ctx, **_subset(ranks))

    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        self._for(buf).reduce(buf, op, factor, root, ctx, **_subset(ranks))

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        self._for(buf).broadcast(buf, root, ctx, **_subset(ranks))

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        self._for(inp).all_gather(inp, out, ctx, **_subset(ranks))

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        self._for(inp).gather(inp, out, root, ctx, **_subset(ranks))

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        self._for(out).scatter(inp, out, root, ctx, **_subset(ranks))

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        self._for(out).reduce_scatter(inp, out, op, factor, ctx, **_subset(ranks))

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        self._for(out).all_to_all(inp, in_splits, out, out_splits, ctx, **_subset(ranks))

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        self.main.barrier(ctx, **_subset(ranks))

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        self._for(buf).send(buf, dst, tag, ctx)

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        return self._for(buf).recv(buf, src, tag, ctx)

    # -- lifecycle -------------------------------------------------------------------------------
    def buffer(self, nbytes: int) -> torch.Tensor | None:
        return self.main.buffer(nbytes)

    @property
    def heap(self) -> object:
        """The CPU transport's buffer heap, if any ([Note: arena buffers])."""
        return getattr(self.main, "heap", None)

    def wait_stats(self) -> tuple[float, dict[int, float]]:
        stats = getattr(self.main, "wait_stats", None)     # a registered transport may lack it
        return stats() if stats is not None else (0.0, {})

    def abort(self, reason: str) -> None:
        with self._lock:
            self._aborted = reason
            built = list(dict.fromkeys(self._built.values()))
        for tr in built:
            tr.abort(reason)

    def close(self) -> None:
        with self._lock:
            built = list(dict.fromkeys(self._built.values()))
        for tr in built:
            tr.close()
