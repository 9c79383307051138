"""torch's ``ProcessGroup`` method API, over ringlet's collectives.

Hand-written comm hooks and older code call collectives on the group object itself::

    fut = process_group.allreduce([bucket.buffer()]).get_future()
    pg.broadcast([t], opts)            # opts: BroadcastOptions(rootRank=..)
    pg.monitored_barrier(timedelta(seconds=5), wait_all_ranks=True)

Each method takes torch's argument forms -- a list holding one tensor per process (as torch's
CPU backends take) or the tensor itself, an options object or the plain root/op -- runs the
functional collective on this group asynchronously and returns its :class:`Work`.  Roots and
peers are ranks within the group, as in torch.
"""

from __future__ import annotations

from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d.options import (
    AllgatherOptions,
    AllreduceOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)
from ringlet.c10d.reduce_op import ReduceOp
from ringlet.transport.reduce import RedOpType

__all__ = ["TorchGroupMethods", "install_functional_api"]

# The methods run the functional collectives, which are built on ProcessGroup (this class's
# subclass): the package hands them in when it loads (ringlet/c10d/__init__.py), so this module
# never imports the layer above it.
_FUNCTIONAL: dict[str, ModuleType] = {}


def install_functional_api(collectives: ModuleType, p2p: ModuleType) -> None:
    """Give ProcessGroup's methods the functional collectives (``ringlet.c10d`` does, once)."""
    _FUNCTIONAL.update(collectives=collectives, p2p=p2p)


def _api(part: str = "collectives") -> ModuleType:
    try:
        return _FUNCTIONAL[part]
    except KeyError:
        raise RuntimeError(f"ProcessGroup methods: expected ringlet.c10d's {part} to be installed "
                           "by the package, got none (import ringlet.c10d first)") from None


def _one(tensors: Any, method: str, arg: str) -> torch.Tensor:
    """The single tensor of a one-tensor-per-process argument (a tensor or a list of one)."""
    if isinstance(tensors, torch.Tensor):
        return tensors
    listed = isinstance(tensors, (list, tuple))
    if listed and len(tensors) == 1 and isinstance(tensors[0], torch.Tensor):
        return tensors[0]
    got = f"a list of {len(tensors)}" if listed else type(tensors).__name__
    raise ValueError(f"ProcessGroup.{method}: {arg}: expected a tensor or a list of one tensor "
                     f"(one per process), got {got}")


def _this_process(tensors: Any, method: str, arg: str, strict: bool = True) -> Any:
    """torch's per-process tensor lists: a flat list, or a list holding this process's list.

    ``strict``: a nested argument must hold exactly one list (gather and scatter take the first).
    """
    if tensors and isinstance(tensors[0], (list, tuple)):
        if strict and len(tensors) != 1:
            raise ValueError(f"ProcessGroup.{method}: {arg}: expected one list (one per process), "
                             f"got {len(tensors)}")
        return tensors[0]
    return tensors


def _op(opts: Any, op: Any, default: Any = ReduceOp.SUM) -> Any:
    if isinstance(opts, (ReduceOp, RedOpType)):
        return opts
    if op is not None:
        return op
    return getattr(opts, "reduceOp", default) if opts is not None else default


def _root(opts: Any, root: Any) -> int:
    if isinstance(opts, int) and not isinstance(opts, bool):
        return opts
    if root is not None:
        return int(root)
    return int(getattr(opts, "rootRank", 0)) if opts is not None else 0


class TorchGroupMethods:
    """Mixin of :class:`~ringlet.c10d.group.ProcessGroup`: torch's methods (see module
    docstring)."""

    if TYPE_CHECKING:   # what the methods use of their host, ProcessGroup
        backend: str

        def rank(self) -> int: ...

        def destroy(self) -> None: ...

    def allreduce(self, tensors: Any, opts: AllreduceOptions | Any = None, op: Any = None) -> Any:
        t = _one(tensors, "allreduce", "tensors")
        return _api().all_reduce(t, _op(opts, op), group=self, async_op=True)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        return _api().all_reduce_coalesced(list(tensors), _op(opts, None), group=self,
                                           async_op=True)

    def broadcast(self, tensors: Any, opts: BroadcastOptions | int | None = None,
                  root: Any = None) -> Any:
        t = _one(tensors, "broadcast", "tensors")
        return _api().broadcast(t, group=self, async_op=True, group_src=_root(opts, root))

    def reduce(self, tensors: Any, opts: ReduceOptions | int | None = None, op: Any = None,
               root: Any = None) -> Any:
        t = _one(tensors, "reduce", "tensors")
        return _api().reduce(t, op=_op(opts if not isinstance(opts, int) else None, op), group=self,
                             async_op=True, group_dst=_root(opts, root))

    def allgather(self, output_tensors: Any, input_tensors: Any,
                  opts: AllgatherOptions | None = None) -> Any:
        outs = _this_process(output_tensors, "allgather", "output_tensors")
        inp = _one(input_tensors, "allgather", "input_tensors")
        return _api().all_gather(list(outs), inp, group=self, async_op=True)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        return _api().all_gather_into_tensor(output, input, group=self, async_op=True)

    def reduce_scatter(self, output_tensors: Any, input_tensors: Any,
                       opts: ReduceScatterOptions | Any = None, op: Any = None) -> Any:
        out = _one(output_tensors, "reduce_scatter", "output_tensors")
        ins = _this_process(input_tensors, "reduce_scatter", "input_tensors")
        return _api().reduce_scatter(out, list(ins), _op(opts, op), group=self, async_op=True)

    def _reduce_scatter_base(self, output: torch.Tensor, input: torch.Tensor,
                             opts: Any = None) -> Any:
        return _api().reduce_scatter_tensor(output, input, _op(opts, None), group=self,
                                            async_op=True)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor,
                      output_split_sizes: list[int],
                      input_split_sizes: list[int], opts: Any = None) -> Any:
        return _api().all_to_all_single(output, input, output_split_sizes or None,
                                        input_split_sizes or None, group=self, async_op=True)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> Any:
        return _api().all_to_all(list(output_tensors), list(input_tensors), group=self,
                                 async_op=True)

    def gather(self, output_tensors: Any, input_tensors: Any,
               opts: GatherOptions | int | None = None, root: Any = None) -> Any:
        inp = _one(input_tensors, "gather", "input_tensors")
        outs = _this_process(output_tensors, "gather", "output_tensors", strict=False)
        dst = _root(opts, root)
        gather_list = list(outs) if self.rank() == dst else None
        return _api().gather(inp, gather_list, group=self, async_op=True, group_dst=dst)

    def scatter(self, output_tensors: Any, input_tensors: Any,
                opts: ScatterOptions | int | None = None, root: Any = None) -> Any:
        out = _one(output_tensors, "scatter", "output_tensors")
        ins = _this_process(input_tensors, "scatter", "input_tensors", strict=False)
        src = _root(opts, root)
        return _api().scatter(out, list(ins) if self.rank() == src else None, group=self,
                              async_op=True, group_src=src)

    def barrier(self, opts: Any = None) -> Any:
        return _api().barrier(group=self, async_op=True)

    def monitored_barrier(self, timeout: timedelta | float | None = None,
                          wait_all_ranks: bool = False) -> None:
        _api().monitored_barrier(group=self, timeout=timeout, wait_all_ranks=wait_all_ranks)

    def send(self, tensors: Any, dstRank: int, tag: int = 0) -> Any:
        return _api("p2p").isend(_one(tensors, "send", "tensors"), group=self, tag=tag,
                                 group_dst=dstRank)

    def recv(self, tensors: Any, srcRank: int, tag: int = 0) -> Any:
        return _api("p2p").irecv(_one(tensors, "recv", "tensors"), group=self, tag=tag,
                                 group_src=srcRank)

    def recv_anysource(self, tensors: Any, tag: int = 0) -> Any:
        return _api("p2p").irecv(_one(tensors, "recv_anysource", "tensors"), group=self, tag=tag)

    def set_timeout(self, timeout: timedelta | float) -> None:
        """Deadline of this group's later operations."""
        seconds = timeout.total_seconds() if isinstance(timeout, timedelta) else float(timeout)
        if seconds <= 0:
            raise ValueError("ProcessGroup.set_timeout: expected a positive duration, got "
                             f"{timeout!r}")
        self.timeout = seconds

    def shutdown(self) -> None:
        """torch's name for a bounded teardown of this group (``destroy``)."""
        self.destroy()

    bound_device: Any = None     # init_process_group(device_id=...) (set on every group)

    @property
    def bound_device_id(self) -> Any:
        """The device given as ``device_id`` to ``init_process_group`` (None if none)."""
        return self.bound_device

    def _get_backend_name(self) -> str:
        return self.backend
