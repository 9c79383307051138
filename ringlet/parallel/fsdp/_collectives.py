"""The flat collectives of one param group: one all-gather, one reduce-scatter (+ one all-reduce for
HSDP).

Each collective is split into a *start* (copy-in, issue, possibly ``async_op=True``) and a
*finish* (wait, copy-out) so that the group can prefetch: start the next group's all-gather
while this group computes, finish it in that group's pre-forward.  Layouts are in
``_shard_math`` ([Note: flat layouts]).

[Note: buffer reuse]
The gathered buffer of an all-gather and the input of a reduce-scatter live only until the
collective and its copy-out are done, and blocks of a model have equal sizes, so they come
from a :class:`BufferPool` shared by the groups under one root and go back to it afterwards.
A fresh multi-MiB CPU allocation is an ``mmap`` whose pages fault in on first touch (with
``MALLOC_MMAP_THRESHOLD_`` set, as in our benchmarks, every large one): measured here, a
7 MB copy into a fresh buffer costs 4-5x a copy into a reused one.  A buffer goes back to
the pool only after its Work completed, so no transport still reads or writes it.

On groups with a buffer heap (``shm``, ``auto`` on one host) the pool allocates the gathered
buffers and the reduce-scatter inputs with ``comm_buffer``: the all-gather then writes every
rank's shard straight into every output and the reduce-scatter reads the peers' inputs where
they are, with no copy through the transport's slots ([Note: in-place collectives] in
``ringlet/transport/arena_inplace.py``).  Free buffers are kept per group for that reason.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from ringlet.c10d.buffers import comm_buffer
from ringlet.c10d.collectives import all_gather_into_tensor, all_reduce, reduce_scatter_tensor
from ringlet.c10d.group import ProcessGroup
from ringlet.c10d.reduce_op import ReduceOp, _make_nccl_premul_sum
from ringlet.c10d.work import Work
from ringlet.parallel.fsdp._shard_math import GroupLayout, copy_in_grads, copy_out

__all__ = [
    "AllGather",
    "CommOptions",
    "ReduceScatter",
    "all_reduce_replicas",
    "finish_all_gather",
    "finish_reduce_scatter",
    "start_all_gather",
    "start_reduce_scatter",
]


_Key = tuple[torch.dtype, torch.device, int]


class BufferPool:
    """Free flat buffers per (dtype, device, group), at most ``max_free`` of each (see
    [Note: buffer reuse]).

    ``take`` hands out the smallest free buffer that is large enough (a prefix view of it), so
    a root's larger buffers also serve its blocks; ``give`` takes back such a view.  With a
    ``group``, new CPU buffers are that group's ``comm_buffer``s.
    """

    def __init__(self, max_free: int = 3) -> None:
        self.max_free = max_free
        self._free: dict[_Key, list[torch.Tensor]] = {}
        self._lent: dict[int, tuple[_Key, torch.Tensor]] = {}   # data_ptr -> (key, pooled buffer)

    def take(self, numel: int, dtype: torch.dtype, device: torch.device,
             group: ProcessGroup | None = None) -> torch.Tensor:
        key = (dtype, device, id(group) if group is not None else 0)
        free = self._free.get(key)
        best = None
        if free:
            # by index: == on tensors is elementwise
            fits = [i for i, t in enumerate(free) if t.numel() >= numel]
            if fits:
                best = free.pop(min(fits, key=lambda i: free[i].numel()))
        if best is None:
            on_cpu = torch.device(device).type == "cpu"
            best = (comm_buffer(numel, dtype, group=group).view(-1) if group is not None and on_cpu
                    else torch.empty(numel, dtype=dtype, device=device))
        if best.numel():
            self._lent[best.data_ptr()] = (key, best)
        return best if best.numel() == numel else best[:numel]

    def give(self, t: torch.Tensor) -> None:
        lent = self._lent.pop(t.data_ptr(), None)
        if lent is None:
            base = t if t._base is None else t._base
            key = (base.dtype, base.device, 0)
        else:
            key, base = lent
        free = self._free.setdefault(key, [])
        if any(x is base for x in free):
            return
        if len(free) < self.max_free:
            free.append(base)
            return
        smallest = min(range(len(free)), key=lambda i: free[i].numel())
        if base.numel() > free[smallest].numel():     # keep the larger ones
            free[smallest] = base

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self._free.values() for t in ts)

    def __deepcopy__(self, memo: dict[int, Any]) -> BufferPool:
        return BufferPool(self.max_free)     # scratch space: a copied model starts with its own


@dataclasses.dataclass
class CommOptions:
    """How one group communicates (the FSDPModule setters of the same names).

    ``all_gather_comm`` / ``reduce_scatter_comm``: user ``AllGather`` / ``ReduceScatter`` objects
    (``_comm_api.py``) that allocate the buffers and issue the collective; ``force_sum``: only SUM
    reductions, scaling separately; ``reduce_scatter_pg``: a group of its own for reduce-scatters
    (they then overlap all-gathers); ``post_forward_pg``: the smaller group that the parameters
    are resharded to after forward (``reshard_after_forward`` as an int).
    """

    all_gather_comm: Any = None
    reduce_scatter_comm: Any = None
    force_sum: bool = False
    reduce_scatter_pg: ProcessGroup | None = None
    post_forward_pg: ProcessGroup | None = None

    def __deepcopy__(self, memo: dict[int, Any]) -> CommOptions:
        return dataclasses.replace(self)     # process groups and user comm objects are shared


@dataclasses.dataclass
class AllGather:
    """An issued all-gather: ``gathered`` is filled once ``work`` completes (``work`` None:
    done)."""

    work: Work | None
    gathered: torch.Tensor
    source: torch.Tensor          # kept alive until the transport has read it
    pooled: bool = True           # ``gathered`` came from the pool (not from a custom comm)
    source_pooled: bool = False   # ``source`` is a pooled cast copy (mixed precision)


@dataclasses.dataclass
class ReduceScatter:
    """An issued reduce-scatter: ``output`` (shard layout) is valid once ``work`` completes."""

    work: Work | None
    source: torch.Tensor
    output: torch.Tensor
    with_grad: list[int]          # indices of the group's params that had a gradient
    post_scale: float | None = None   # force_sum: multiply the summed output by this
    pooled: bool = True


def start_all_gather(shard_buffer: torch.Tensor, dtype: torch.dtype, layout: GroupLayout,
                     pg: ProcessGroup, async_op: bool, pool: BufferPool, comm: Any = None,
                     device: torch.device | None = None) -> AllGather:
    """All-gather the shard buffers (cast to ``dtype`` for mixed precision) into a rank-major
    buffer.

    ``shard_buffer`` may also be a post-forward shard (a block of the rank-major buffer, with
    ``pg`` the smaller group that holds the other blocks): any source whose pieces, gathered over
    ``pg`` in group-rank order, make up the rank-major buffer.  ``device``: where to gather when
    the shards live elsewhere (offloaded to the CPU: [Note: FSDP devices] in ``_device.py``).
    """
    device = device or shard_buffer.device
    moved = shard_buffer.device != device
    cast = shard_buffer.dtype != dtype or moved
    source = (pool.take(shard_buffer.numel(), dtype, device).copy_(shard_buffer, non_blocking=moved)
              if cast else shard_buffer)
    if comm is not None:
        gathered = comm.allocate((layout.gathered_numel,), dtype=dtype, device=device)
        return AllGather(comm(gathered, source, pg, async_op=async_op), gathered, source,
                         False, cast)
    gathered = pool.take(layout.gathered_numel, dtype, device, group=pg)
    work = all_gather_into_tensor(gathered, source, group=pg, async_op=async_op)
    return AllGather(work, gathered, source, True, cast)


def wait_all_gather(ag: AllGather, pool: BufferPool, shard_buffer: torch.Tensor) -> None:
    if ag.work is not None:
        ag.work.wait()
        ag.work = None
    if ag.source_pooled:
        pool.give(ag.source)
        ag.source_pooled = False


def finish_all_gather(ag: AllGather, unsharded: torch.Tensor, layout: GroupLayout, pool: BufferPool,
                      shard_buffer: torch.Tensor,
                      keep: tuple[int, int] | None = None) -> torch.Tensor | None:
    """Wait for ``ag``, copy every parameter into its view of ``unsharded``, recycle the buffers.

    ``keep=(start, stop)``: also return a copy of those elements of the rank-major buffer (the
    post-forward shard, [Note: resharding to a smaller group] in ``_param_group``).
    """
    wait_all_gather(ag, pool, shard_buffer)
    copy_out(ag.gathered, unsharded, layout)
    kept = ag.gathered[keep[0]:keep[1]].clone() if keep is not None else None
    if ag.pooled:
        pool.give(ag.gathered)
    return kept


def _op(divide_factor: float | None, world: int, force_sum: bool) -> tuple[Any, float | None]:
    """(reduce op, factor to multiply the result by afterwards).

    Average by default; with a factor, every contribution is multiplied by 1/factor before
    summing; ``force_sum``: a plain SUM and the scaling afterwards.
    """
    scale = 1.0 / (divide_factor if divide_factor is not None else world)
    if force_sum:
        return ReduceOp.SUM, scale
    if divide_factor is None:
        return ReduceOp.AVG, None
    return _make_nccl_premul_sum(scale), None


def start_reduce_scatter(grads: Sequence[torch.Tensor | None], layout: GroupLayout,
                         dtype: torch.dtype,
                         pg: ProcessGroup, divide_factor: float | None, pool: BufferPool,
                         opts: CommOptions | None = None, always: bool = False,
                         device: torch.device | None = None) -> ReduceScatter | None:
    """Reduce-scatter the unsharded gradients ``grads`` (None: no gradient) asynchronously.

    Returns None when no parameter has a gradient (then nothing is issued; ranks agree,
    since every rank ran the same forward and backward) unless ``always`` (zeros are reduced:
    ``set_reduce_scatter_unused_params``).  ``device``: the group's compute device (default:
    the gradients'), where the input and output live.
    """
    with_grad = [i for i, g in enumerate(grads) if g is not None]
    if not with_grad and not always:
        return None
    opts = opts or CommOptions()
    device = device or next((g.device for g in grads if g is not None), torch.device("cpu"))
    op, post_scale = _op(divide_factor, pg.size(), opts.force_sum)
    output = torch.empty(layout.shard_numel, dtype=dtype, device=device)
    comm = opts.reduce_scatter_comm
    if comm is not None:
        source = comm.allocate((layout.gathered_numel,), dtype=dtype, device=device)
        copy_in_grads(source, grads, layout)
        work = comm(output, source, pg, op, async_op=True)
        return ReduceScatter(work, source, output, with_grad, post_scale, pooled=False)
    source = pool.take(layout.gathered_numel, dtype, device, group=pg)
    copy_in_grads(source, grads, layout)
    work = reduce_scatter_tensor(output, source, op=op, group=pg, async_op=True)
    return ReduceScatter(work, source, output, with_grad, post_scale)


def finish_reduce_scatter(rs: ReduceScatter, pool: BufferPool) -> torch.Tensor:
    if rs.work is not None:
        rs.work.wait()
        rs.work = None
    if rs.pooled:
        pool.give(rs.source)
    if rs.post_scale is not None:
        rs.output.mul_(rs.post_scale)
    return rs.output


def all_reduce_replicas(output: torch.Tensor, pg: ProcessGroup, divide_factor: float | None,
                        force_sum: bool = False) -> None:
    """HSDP's second step: all-reduce the reduce-scattered shard over the replicate axis."""
    if divide_factor is not None:
        all_reduce(output, op=ReduceOp.SUM, group=pg)
    elif force_sum:
        all_reduce(output, op=ReduceOp.SUM, group=pg)
        output.div_(pg.size())
    else:
        all_reduce(output, op=ReduceOp.AVG, group=pg)
