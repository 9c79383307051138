"""``RingletProcessGroup``: torch's ``ProcessGroup`` interface, each call one call of ringlet's.

torch calls these methods from its Python API (``dist.all_reduce`` -> ``allreduce``), from C++
(DDP's reducer, functional collectives, FSDP2) and through ``_coalescing_manager``.  Each method
converts torch's arguments (per-process tensor lists, options objects, torch's ``ReduceOp``) and
runs ringlet's collective on the ringlet group this object holds, with ringlet's checks,
sequence numbers, timeouts and hang reports; no algorithm lives here.

Inline or queued: torch's Python API sets ``opts.asyncOp`` from the caller's ``async_op``.  A
call that will be waited for at once runs inline on the caller's thread (no thread hand-off:
the latency path); an asynchronous one is queued on ringlet's communication thread, so it
overlaps compute as torch's backends do (DDP's buckets, FSDP2's prefetches).
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as tdist

import ringlet.c10d as rc
from ringlet.c10d.reduce_op import ReduceOp
from ringlet.torch_backend._work import DoneWork, GroupedWork, QueuedWork

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["BACKEND_NAME", "RingletProcessGroup"]

BACKEND_NAME = "ringlet"
_T = TypeVar("_T")


# torch's RedOpType -> ringlet's RedOpType, for every op without a factor: a dict look-up where
# building a ReduceOp each call cost ~3 us, and a plain RedOpType takes c10d's fast path (the
# crossing's budget is a few us per call).
_PLAIN_OPS: dict[Any, Any] = {}
_TORCH_SUM = tdist.ReduceOp.SUM


def _red(opts: Any) -> Any:
    """ringlet's operator for torch's (``opts.reduceOp``): a RedOpType, or a ReduceOp carrying
    PREMUL_SUM's factor."""
    top = opts.reduceOp
    if top == _TORCH_SUM:                # the common case: ~0.6 us against ~1.5 us below
        return ReduceOp.SUM
    kind = top.op
    red = _PLAIN_OPS.get(kind)
    if red is not None:
        return red
    if int(kind) == int(ReduceOp.PREMUL_SUM):
        factor = top.factor
        if isinstance(factor, torch.Tensor):
            factor = factor.item()
        return ReduceOp(int(kind), float(factor))
    red = _PLAIN_OPS[kind] = ReduceOp.RedOpType(int(kind))
    return red


def _async(opts: Any) -> bool:
    return opts is None or bool(getattr(opts, "asyncOp", True))


_all_reduce = rc.all_reduce


def _one(tensors: Sequence[_T], method: str) -> _T:
    if len(tensors) != 1:
        raise ValueError(f"ringlet backend: {method}: expected one tensor per process (as "
                         f"torch's CPU backends take), got {len(tensors)}")
    return tensors[0]


class RingletProcessGroup(tdist.ProcessGroup):
    """A torch ``ProcessGroup`` whose every operation runs on a ringlet group (``ringlet_group``).

    Made by the backend's creator (:func:`ringlet.torch_backend.create`) for each group torch
    creates with backend ``"ringlet"``; users do not build it themselves.  ``ringlet_group`` is
    the ringlet :class:`~ringlet.c10d.group.ProcessGroup` underneath (its ``counts()``, its
    transport), for inspection.
    """

    def __init__(self, store: Any, ringlet_group: ProcessGroup, default: bool = False) -> None:
        super().__init__(ringlet_group.rank(), ringlet_group.size())
        self._store = store          # torch 2.13 routes only (rank, size) through its trampoline
        self.ringlet_group = ringlet_group
        self._gname = ""
        self._gdesc = ""
        self._coalescing: list[Any] | None = None
        self._default = default     # torch's default group: its end stops the hang watchdog

    # -- identity -------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._gname = name

    def getGroupName(self) -> str:
        return self._gname

    def setGroupDesc(self, desc: str) -> None:
        self._gdesc = desc

    def getGroupDesc(self) -> str:
        return self._gdesc

    def __repr__(self) -> str:
        return f"RingletProcessGroup({self.ringlet_group!r}, name {self._gname!r})"

    # -- running --------------------------------------------------------------------------
    def _run(self, call: Any, outputs: list[torch.Tensor], opts: Any) -> tdist._Work:
        """Run ``call(async_op)`` of ringlet's API; wrap its result as torch's Work."""
        g = self.ringlet_group
        w: tdist._Work
        if _async(opts) and g.size() > 1:
            w = QueuedWork(call(True), outputs)
        else:
            call(False)
            w = DoneWork(outputs)
        if self._coalescing is not None:
            self._coalescing.append(w)
        return w

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> tdist._Work:
        # _run written out: the most frequent call (dist.all_reduce, DDP's buckets)
        if opts is None:
            opts = tdist.AllreduceOptions()
        t, red, g = _one(tensors, "allreduce"), _red(opts), self.ringlet_group
        w: tdist._Work
        if opts.asyncOp and g._size > 1:
            w = QueuedWork(_all_reduce(t, red, g, True), [t])
        else:
            _all_reduce(t, red, g, False)
            w = DoneWork([t])
        if self._coalescing is not None:
            self._coalescing.append(w)
        return w

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> tdist._Work:
        opts = opts or tdist.AllreduceCoalescedOptions()
        red, ts = _red(opts), list(tensors)
        return self._run(lambda a: rc.all_reduce_coalesced(ts, red, self.ringlet_group, a), ts,
                         opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> tdist._Work:
        opts = opts or tdist.BroadcastOptions()
        t, root = _one(tensors, "broadcast"), int(opts.rootRank)
        return self._run(lambda a: rc.broadcast(t, group=self.ringlet_group, async_op=a,
                                                group_src=root), [t], opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> tdist._Work:
        opts = opts or tdist.ReduceOptions()
        t, red, root = _one(tensors, "reduce"), _red(opts), int(opts.rootRank)
        return self._run(lambda a: rc.reduce(t, op=red, group=self.ringlet_group, async_op=a,
                                             group_dst=root), [t], opts)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> tdist._Work:
        outs, inp = list(_one(output_tensors, "allgather")), _one(input_tensors, "allgather")
        return self._run(lambda a: rc.all_gather(outs, inp, self.ringlet_group, a), outs, opts)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts: Any = None) -> tdist._Work:
        return self._run(lambda a: rc.all_gather_into_tensor(output, input, self.ringlet_group, a),
                         [output], opts)

    all_gather_single = _allgather_base

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            input_list: list[torch.Tensor], opts: Any = None) -> tdist._Work:
        outs = [list(o) for o in output_lists]
        ins = list(input_list)
        flat = [t for o in outs for t in o]
        return self._run(lambda a: rc.all_gather_coalesced(outs, ins, self.ringlet_group, a),
                         flat, opts)

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> tdist._Work:
        return self._each(outputs, inputs, opts, "allgather_into_tensor_coalesced",
                          lambda o, i, a: rc.all_gather_into_tensor(o, i, self.ringlet_group, a))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(self, output_tensors: list[torch.Tensor],
                       input_tensors: list[list[torch.Tensor]], opts: Any = None) -> tdist._Work:
        opts = opts or tdist.ReduceScatterOptions()
        out = _one(output_tensors, "reduce_scatter")
        ins, red = list(_one(input_tensors, "reduce_scatter")), _red(opts)
        return self._run(lambda a: rc.reduce_scatter(out, ins, red, self.ringlet_group, a), [out],
                         opts)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> tdist._Work:
        opts = opts or tdist.ReduceScatterOptions()
        red = _red(opts)
        return self._run(lambda a: rc.reduce_scatter_tensor(output, input, red, self.ringlet_group,
                                                            a), [output], opts)

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor],
                                        opts: Any = None) -> tdist._Work:
        opts = opts or tdist.ReduceScatterOptions()
        red = _red(opts)
        return self._each(outputs, inputs, opts, "reduce_scatter_tensor_coalesced",
                          lambda o, i, a: rc.reduce_scatter_tensor(o, i, red, self.ringlet_group,
                                                                   a))

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def _each(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any,
              method: str, fn: Any) -> tdist._Work:
        """A coalesced op as one ringlet op per pair, issued in order (one Work for all)."""
        if len(outputs) != len(inputs):
            raise ValueError(f"ringlet backend: {method}: expected as many outputs as inputs, got "
                             f"{len(outputs)} and {len(inputs)}")
        pairs = list(zip(outputs, inputs, strict=True))

        def call(a: bool) -> Any:
            works = [fn(o, i, a) for o, i in pairs]
            return _AllOf(works) if a else None
        return self._run(call, list(outputs), opts)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int], input_split_sizes: list[int],
                      opts: Any = None) -> tdist._Work:
        osz, isz = list(output_split_sizes) or None, list(input_split_sizes) or None
        return self._run(lambda a: rc.all_to_all_single(output, input, osz, isz,
                                                        self.ringlet_group, a), [output], opts)

    all_to_all_single = alltoall_base     # torch 2.13's Python API calls it by this name

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> tdist._Work:
        outs, ins = list(output_tensors), list(input_tensors)
        return self._run(lambda a: rc.all_to_all(outs, ins, self.ringlet_group, a), outs, opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any = None) -> tdist._Work:
        opts = opts or tdist.GatherOptions()
        root, inp = int(opts.rootRank), _one(input_tensors, "gather")
        mine = self.ringlet_group.rank() == root
        outs = list(_one(output_tensors, "gather")) if mine else None
        return self._run(lambda a: rc.gather(inp, outs, group=self.ringlet_group, async_op=a,
                                             group_dst=root), outs or [], opts)

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any = None) -> tdist._Work:
        opts = opts or tdist.ScatterOptions()
        root, out = int(opts.rootRank), _one(output_tensors, "scatter")
        mine = self.ringlet_group.rank() == root
        ins = list(_one(input_tensors, "scatter")) if mine else None
        return self._run(lambda a: rc.scatter(out, ins, group=self.ringlet_group, async_op=a,
                                              group_src=root), [out], opts)

    def barrier(self, opts: Any = None) -> tdist._Work:
        return self._run(lambda a: rc.barrier(self.ringlet_group, a), [], opts)

    def monitored_barrier(self, timeout: timedelta | None = None,
                          wait_all_ranks: bool = False) -> None:
        rc.monitored_barrier(self.ringlet_group, timeout, wait_all_ranks)

    # point-to-point always runs on ringlet's per-peer threads: a blocking send issued inline
    # could wait for a receive its peer posts only after its own send (isend/irecv pairs).
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int) -> tdist._Work:
        t = _one(tensors, "send")
        return self._p2p(rc.isend(t, group=self.ringlet_group, tag=tag, group_dst=dstRank), [t])

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int) -> tdist._Work:
        t = _one(tensors, "recv")
        return self._p2p(rc.irecv(t, group=self.ringlet_group, tag=tag, group_src=srcRank), [t])

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> tdist._Work:
        t, g = _one(tensors, "recv_anysource"), self.ringlet_group
        return self._p2p(rc.irecv(t, group=g, tag=tag), [t], g.ranks)

    def _p2p(self, rwork: Any, outputs: list[torch.Tensor],
             ranks: list[int] | None = None) -> tdist._Work:
        w = QueuedWork(rwork, outputs, ranks)
        if self._coalescing is not None:
            self._coalescing.append(w)
        return w

    # -- coalescing blocks (torch's _coalescing_manager) ----------------------------------
    def start_coalescing(self, device: torch.device) -> None:
        if self._coalescing is not None:
            raise ValueError("ringlet backend: _start_coalescing: a coalescing block is already "
                             "open on this group")
        self._coalescing = []

    def end_coalescing(self, device: torch.device) -> tdist._Work:
        works, self._coalescing = self._coalescing or [], None
        return GroupedWork(works)

    _start_coalescing = start_coalescing
    _end_coalescing = end_coalescing

    # -- lifetime -------------------------------------------------------------------------
    def set_timeout(self, timeout: timedelta) -> None:
        self.ringlet_group.set_timeout(timeout)

    def abort(self) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        from ringlet.torch_backend._world import job

        job.remove(self.ringlet_group)
        if self._default:
            job.stop()
        self.ringlet_group.destroy()


class _AllOf:
    """ringlet works issued together, waited together (what :class:`QueuedWork` wraps)."""

    def __init__(self, works: list[Any]) -> None:
        self._works = [w for w in works if w is not None]

    def wait(self, timeout: Any = None) -> bool:
        for w in self._works:
            w.wait(timeout) if timeout is not None else w.wait()
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def exception(self) -> Any:
        return next((w.exception() for w in self._works if w.exception() is not None), None)

    def synchronize(self) -> None:
        for w in self._works:
            w.synchronize()

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])
