"""Torch-engine adapter: torch's own gloo (CPU) and NCCL (CUDA) process groups as a transport.

The only module of ringlet that imports ``torch.distributed``.  It lets ringlet's API, argument
checks, sequence numbers, fingerprints (``RINGLET_DEBUG=DETAIL``), hang reports and strategies run
on torch's engines -- for GPU users (NCCL), or to compare engines on the same script.

Selected by the backend name (see ``ringlet.transport.selection``):

=================================  ===========================================================
``"torch:gloo"``                   torch's gloo for CPU tensors
``"torch:nccl"``                   torch's NCCL for CUDA tensors (needs CUDA)
``"cpu:torch:gloo,cuda:torch:nccl"``  both: each tensor goes to the engine of its device
``"gloo"``                         **not** this adapter: ringlet's own transports (``auto``), so a
                                   script moved from torch by text substitution runs on them
=================================  ===========================================================

The engines rendezvous through the group's ringlet store (wrapped as a
``torch.distributed.Store``) and gloo listens on the address the tcp transport would use
(``RINGLET_IFNAME`` or the one that reaches the store).  AVG and PREMUL_SUM are done as ringlet
does them (scale, sum, divide: the pre- and post-scale of [Note: reductions]), since gloo has
neither.  Results are the engine's: bit-identical to torch's, not necessarily to ringlet's
rank-order folds.  torch's errors become ringlet's (``CollectiveTimeoutError`` for its timeouts,
``DistBackendError`` otherwise; ``TypeError`` for a dtype or op the engine refuses).

CUDA tensors are stream-ordered, as with torch's NCCL ([Note: CUDA streams] in
``ringlet/c10d/_cuda.py``): a call queues the collective after the work on the current stream and
makes that stream wait for its end, without blocking the host.  The group's timeout is then
NCCL's own (its watchdog); a CPU engine's wait is bounded by the op's deadline.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as tdist

from ringlet.errors import CollectiveTimeoutError, DistBackendError
from ringlet.transport.base import OpContext, Ranks, ReduceArg, Transport, whole_group
from ringlet.transport.reduce import RedOpType, reduction
from ringlet.transport.tcp import choose_address

__all__ = ["TorchEngineTransport", "engines_for"]

_OPS: dict[RedOpType, Any] = {   # fold operator -> torch's ReduceOp (loosely typed in its stubs)
    RedOpType.SUM: tdist.ReduceOp.SUM, RedOpType.PRODUCT: tdist.ReduceOp.PRODUCT,
    RedOpType.MIN: tdist.ReduceOp.MIN, RedOpType.MAX: tdist.ReduceOp.MAX,
    RedOpType.BAND: tdist.ReduceOp.BAND, RedOpType.BOR: tdist.ReduceOp.BOR,
    RedOpType.BXOR: tdist.ReduceOp.BXOR,
}


def engines_for(spec: str) -> dict[str, str]:
    """``"torch:gloo,nccl"`` -> ``{"cpu": "gloo", "cuda": "nccl"}``; ``"torch:nccl"``: cuda only."""
    names = spec.removeprefix("torch:").split(",")
    out = {}
    for name in names:
        if name == "gloo":
            out["cpu"] = "gloo"
        elif name == "nccl":
            out["cuda"] = "nccl"
        else:
            raise ValueError(f"torch engine: expected gloo or nccl, got {name!r} in {spec!r}")
    return out


class _TorchStore(tdist.Store):
    """ringlet's store seen through torch's Store interface (for the engines' rendezvous)."""

    def __init__(self, store: Any, timeout: timedelta) -> None:
        super().__init__()
        self._store = store
        self._timeout = timeout

    def set(self, key: str, value: Any) -> None:
        self._store.set(key, bytes(value))

    def get(self, key: str) -> bytes:
        return bytes(self._store.get(key))

    def add(self, key: str, value: int) -> int:
        return int(self._store.add(key, value))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._store.compare_set(key, bytes(expected), bytes(desired)))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self._store.wait(list(keys), timeout or self._timeout)

    def check(self, keys: list[str]) -> bool:
        return bool(self._store.check(list(keys)))

    def delete_key(self, key: str) -> bool:
        return bool(self._store.delete_key(key))

    def num_keys(self) -> int:
        return int(self._store.num_keys())

    def set_timeout(self, timeout: timedelta) -> None:
        self._timeout = timeout


class TorchEngineTransport(Transport):
    """A ringlet transport over torch's process groups (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, pgs: dict[str, Any], spec: str,
                 stores: list[Any]) -> None:
        self.rank = rank
        self.world_size = world_size
        self.pgs = pgs            # device type -> torch backend object
        self.devices = tuple(pgs)
        self.stream_ordered = ("cuda",) if "cuda" in pgs else ()
        # The engines call back into these Python stores later (NCCL connects lazily, at the first
        # collective): torch's trampoline needs the Python objects alive: the transport keeps them.
        self._stores = stores
        self.name = spec
        self._engine = spec.removeprefix("torch:").replace(",", "+")

    @classmethod
    def create(cls, store: Any, rank: int, world_size: int, timeout: float, group: str,
               spec: str) -> TorchEngineTransport:
        """Build torch's engine(s) for ``spec``; every rank of the group calls this.

        Raises:
            ValueError: ``torch:nccl`` without CUDA (``torch.cuda.is_available()`` is False).
        """
        from ringlet.store import PrefixStore

        td = timedelta(seconds=timeout)
        pgs: dict[str, Any] = {}
        stores: list[_TorchStore] = []
        for device, engine in engines_for(spec).items():
            tstore = _TorchStore(PrefixStore(f"torch/{engine}", store), td)
            stores.append(tstore)
            if engine == "gloo":
                opts = tdist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
                opts._timeout = td
                device_opts = tdist.ProcessGroupGloo.create_device(hostname=choose_address(store))
                opts._devices = [device_opts]
                pgs[device] = tdist.ProcessGroupGloo(tstore, rank, world_size, opts)
            else:
                if not torch.cuda.is_available():
                    raise ValueError(f"group {group}: backend {spec!r} needs CUDA for torch's NCCL "
                                     "engine, but torch.cuda.is_available() is False on this host; "
                                     "use 'torch:gloo' or ringlet's own 'auto'")
                nopts = tdist.ProcessGroupNCCL.Options()
                nopts._timeout = td
                pgs[device] = tdist.ProcessGroupNCCL(tstore, rank, world_size, nopts)
        return cls(rank, world_size, pgs, spec, stores)

    def __repr__(self) -> str:
        return f"TorchEngineTransport(rank {self.rank}/{self.world_size}, {self.name})"

    # -- plumbing ----------------------------------------------------------------------------
    def _pg(self, t: torch.Tensor, ctx: OpContext) -> Any:
        pg = self.pgs.get(t.device.type)
        if pg is None:
            raise ValueError(f"{ctx.op}: this group's engine ({self._engine}) serves "
                             f"{sorted(self.pgs)} tensors, got a tensor on {t.device}")
        return pg

    def _wait(self, work: Any, ctx: OpContext, stream_ordered: bool = False) -> None:
        try:
            if stream_ordered:
                work.wait()      # the current stream waits; a timeout would block the host
            else:
                work.wait(timedelta(seconds=max(ctx.deadline - _now(), 0.001)))
        except RuntimeError as e:
            raise self._error(e, ctx) from None

    def _error(self, e: BaseException, ctx: OpContext) -> BaseException:
        text = str(e)
        low = text.lower()
        if "timed out" in low or "timeout" in low:
            return ctx.error(CollectiveTimeoutError,
                             f"torch's {self._engine} engine timed out: {text}")
        if "unsupported" in low or "not supported" in low or "invalid" in low:
            return TypeError(f"{ctx.op}: torch's {self._engine} engine refused this call: {text}")
        return ctx.error(DistBackendError, f"torch's {self._engine} engine failed: {text}")

    def _pg_all(self, t: torch.Tensor, ctx: OpContext, ranks: Ranks) -> Any:
        """The engine for ``t``'s device; the engines run collectives over the whole group only."""
        if ranks is not None:
            whole_group(self, ranks)
        return self._pg(t, ctx)

    def _run(self, ctx: OpContext, call: Any, t: torch.Tensor | None = None) -> Any:
        """Issue ``call()`` and wait for it: on the stream for a CUDA ``t``, on the host
        otherwise."""
        try:
            work = call()
        except RuntimeError as e:
            raise self._error(e, ctx) from None
        self._wait(work, ctx, t is not None and t.is_cuda)
        return work

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        pg = self._pg_all(buf, ctx, ranks)
        red = reduction(op, factor, buf.dtype, self.world_size)
        red.contribute(buf, buf)
        opts = tdist.AllreduceOptions()
        opts.reduceOp = _OPS[red.fold]
        self._run(ctx, lambda: pg.allreduce([buf], opts), buf)
        red.finish_(buf)

    def reduce(self, buf: torch.Tensor, op: ReduceArg, factor: float | None, root: int,
               ctx: OpContext, ranks: Ranks = None) -> None:
        pg = self._pg_all(buf, ctx, ranks)
        red = reduction(op, factor, buf.dtype, self.world_size)
        # gloo uses non-roots' buffers as scratch; ringlet leaves them unchanged: reduce a copy.
        src = torch.empty_like(buf)
        red.contribute(buf, src)
        opts = tdist.ReduceOptions()
        opts.reduceOp, opts.rootRank = _OPS[red.fold], root
        self._run(ctx, lambda: pg.reduce([src], opts), buf)
        if self.rank == root:
            buf.copy_(src)
            red.finish_(buf)

    def broadcast(self, buf: torch.Tensor, root: int, ctx: OpContext, ranks: Ranks = None) -> None:
        pg = self._pg_all(buf, ctx, ranks)
        opts = tdist.BroadcastOptions()
        opts.rootRank = root
        self._run(ctx, lambda: pg.broadcast([buf], opts), buf)

    def all_gather(self, inp: torch.Tensor, out: torch.Tensor, ctx: OpContext,
                   ranks: Ranks = None) -> None:
        pg = self._pg_all(inp, ctx, ranks)
        self._run(ctx, lambda: pg._allgather_base(out, inp), inp)

    def gather(self, inp: torch.Tensor, out: torch.Tensor | None, root: int, ctx: OpContext,
               ranks: Ranks = None) -> None:
        pg = self._pg_all(inp, ctx, ranks)
        opts = tdist.GatherOptions()
        opts.rootRank = root
        outs = [list(out.view(self.world_size, -1).unbind(0))] if out is not None else []
        self._run(ctx, lambda: pg.gather(outs, [inp], opts), inp)

    def scatter(self, inp: torch.Tensor | None, out: torch.Tensor, root: int, ctx: OpContext,
                ranks: Ranks = None) -> None:
        pg = self._pg_all(out, ctx, ranks)
        opts = tdist.ScatterOptions()
        opts.rootRank = root
        ins = [list(inp.view(self.world_size, -1).unbind(0))] if inp is not None else []
        self._run(ctx, lambda: pg.scatter([out], ins, opts), out)

    def reduce_scatter(self, inp: torch.Tensor, out: torch.Tensor, op: ReduceArg,
                       factor: float | None, ctx: OpContext, ranks: Ranks = None) -> None:
        pg = self._pg_all(out, ctx, ranks)
        red = reduction(op, factor, out.dtype, self.world_size)
        src = red.contribution(inp)
        opts = tdist.ReduceScatterOptions()
        opts.reduceOp = _OPS[red.fold]
        self._run(ctx, lambda: pg._reduce_scatter_base(out, src, opts), out)
        red.finish_(out)

    def all_to_all(self, inp: torch.Tensor, in_splits: list[int], out: torch.Tensor,
                   out_splits: list[int], ctx: OpContext, ranks: Ranks = None) -> None:
        pg = self._pg_all(inp, ctx, ranks)
        self._run(ctx, lambda: pg.alltoall_base(out, inp, list(out_splits), list(in_splits),
                                                tdist.AllToAllOptions()), inp)

    def barrier(self, ctx: OpContext, ranks: Ranks = None) -> None:
        if ranks is not None:
            whole_group(self, ranks)
        pg = self.pgs.get("cpu") or next(iter(self.pgs.values()))
        self._run(ctx, lambda: pg.barrier(tdist.BarrierOptions()))

    def send(self, buf: torch.Tensor, dst: int, tag: int, ctx: OpContext) -> None:
        pg = self._pg(buf, ctx)
        self._run(ctx, lambda: pg.send([buf], dst, tag), buf)

    def recv(self, buf: torch.Tensor, src: int | None, tag: int, ctx: OpContext) -> int:
        pg = self._pg(buf, ctx)
        if src is None:
            work = self._run(ctx, lambda: pg.recv_anysource([buf], tag), buf)
            return int(work.source_rank())
        self._run(ctx, lambda: pg.recv([buf], src, tag), buf)
        return src

    # -- lifecycle -----------------------------------------------------------------------------
    def abort(self, reason: str) -> None:
        for pg in self.pgs.values():
            try:
                pg.abort()
            except (RuntimeError, AttributeError):
                pass

    def close(self) -> None:
        for pg in self.pgs.values():
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError):
                pass
        self.pgs.clear()
        self._stores.clear()


def _now() -> float:
    import time

    return time.monotonic()
