"""The reducer: autograd hooks that pack gradients into buckets and all-reduce them in backward.

One :class:`Reducer` per DDP module.  Each parameter that requires a gradient gets a
``register_post_accumulate_grad_hook``; when the hook fires, the gradient goes into its bucket
(``_bucket_state.py``: copied into a slot of a flat buffer, already there with
``gradient_as_bucket_view``, or -- a one-parameter bucket -- reduced in place on ``.grad``),
and once every member of a bucket is in, the bucket's all-reduce (each rank's gradient times
1/world size, summed) is issued with ``async_op=True``: it runs on the group's communication
thread while backward carries on.  Buckets are launched strictly in bucket order (a later
bucket that is ready first waits for the earlier ones), so every rank issues the same
collectives in the same order.  At the end of backward (an autograd final callback; see
[Note: DDP and autograd] in ``_graph.py``) the reducer launches whatever is left (zeros for
gradients that never came), waits for every bucket, learns which ranks produced which
gradients (one all-gather of a byte per parameter: the used-map) and writes the results into
``.grad``.

[Note: gradients accumulated under no_sync]
Hooks also fire during ``no_sync`` backward passes; the reducer ignores their gradients (they
accumulate in ``.grad``) but remembers that the parameter was used.  In the synchronised
backward, a parameter whose hook does not fire there contributes its accumulated ``.grad``,
and it counts as used in the used-map, so ranks that never touched it adopt the average too.
Without this, a parameter used only in a ``no_sync`` micro-batch, or only on some ranks, would
keep a rank-local gradient and the ranks would silently diverge (torch's reducer all-reduces
the accumulated gradients the same way).

State per iteration (``Phase``): IDLE -> PREPARED (a synchronising forward ran) -> REDUCING
(backward started; the final callback is queued) -> IDLE (finalized).
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import (
    ReduceOp,
    _make_nccl_premul_sum,
    all_gather_into_tensor,
    all_reduce,
    broadcast,
)
from ringlet.c10d.buffers import comm_buffer, is_comm_buffer
from ringlet.errors import DistError
from ringlet.parallel.ddp import _graph
from ringlet.parallel.ddp._bucket_state import Bucket, BucketMemory, Layout
from ringlet.parallel.ddp._buckets import complete_order
from ringlet.parallel.ddp._cuda import aux_device
from ringlet.parallel.ddp._grad_bucket import GradBucket

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["Phase", "Reducer", "ReductionStats", "traced"]

# Used-map values (one byte per parameter and rank, all-gathered at the end of backward).
_NOT_USED, _USED, _JOINED = 0, 1, 2


def traced(label: str) -> contextlib.AbstractContextManager[Any]:
    """A ``record_function`` label when a profiler is running; otherwise free (it costs ~20 us).
    Nothing while torch.compile traces (it would drop the label with a warning)."""
    if not torch.compiler.is_compiling() and torch.autograd._profiler_enabled():
        return torch.profiler.record_function(label)
    return contextlib.nullcontext()


@dataclasses.dataclass(frozen=True)
class ReductionStats:
    """How the last synchronised backward's reduction went (``Reducer.last_stats``).

    ``bytes_done_in_backward``: bytes of buckets whose reduction had already finished when
    backward ended (communication hidden behind backward); ``finalize_s``: seconds spent at the
    end of backward (launching the rest, waiting, writing ``.grad``).
    """

    iteration: int
    buckets: int
    bytes: int
    bytes_done_in_backward: int
    finalize_s: float


class Phase(enum.Enum):
    IDLE = "idle"            # no synchronised backward expected (no_sync, no_grad, after finalize)
    PREPARED = "prepared"    # a synchronising forward ran; the next backward reduces
    REDUCING = "reducing"    # backward has started; the end-of-backward callback is queued


class Reducer:
    """Gradient bucketing and reduction for the parameters ``params`` (see the module docstring)."""

    def __init__(self, params: list[torch.Tensor], names: list[str], pg: ProcessGroup, *,
                 cap_bytes: int,
                 gradient_as_bucket_view: bool, find_unused_parameters: bool, static_graph: bool,
                 skip_all_reduce_unused_params: bool = False, caps: list[int] | None = None,
                 device: torch.device | None = None) -> None:
        self.params = params
        self.names = names
        self.pg = pg
        on_cpu = device is None or device.type == "cpu"
        # A GPU module's buckets live on its device; its bookkeeping tensors (used-map, bucket
        # order) where the group serves them (ddp/_cuda.py).
        self.layout = Layout(params, cap_bytes, gradient_as_bucket_view, caps,
                             _bucket_memory(pg) if on_cpu else None, None if on_cpu else device)
        self._aux = None if on_cpu else aux_device(pg, device)
        self.find_unused = find_unused_parameters
        self.static_graph = static_graph
        self.skip_unused = skip_all_reduce_unused_params
        self.phase = Phase.IDLE
        self.reductions = 0                   # finished synchronised backward passes
        self.comm_hook: tuple[Any, Any] | None = None
        self.join_work: Any = None            # Join's "still active" all-reduce of this iteration
        # Inside Join with divide_by_initial_world_size=False: SUM, the end divides (this iteration)
        self.join_sums = False
        self._index = {id(p): i for i, p in enumerate(params)}
        n = len(params)
        self._fired = [False] * n             # hook fired (gradient in the bucket) this iteration
        self._premarked = [False] * n         # known unused before backward; slot zeroed
        self._calls = [0] * n                 # hook calls this iteration (static graph)
        # A gradient arrived since the last synchronised reduction, no_sync micro-batches
        # included ([Note: gradients accumulated under no_sync]).
        self._used_since_sync = [False] * n
        self._expected_calls: list[int] | None = None   # static graph, learned in iteration 1
        # find_unused: union over this iteration's forwards
        self._reachable: set[int] | None = None
        self._next = 0                        # next bucket to launch
        # Buckets are rebuilt once, in the order gradients arrived in the first synchronised
        # backward (as torch does; not with find_unused_parameters, whose order may vary).
        self._record = not find_unused_parameters or static_graph
        self._recording = self._record
        self.observed: list[int] = []
        self.rebuilt = False
        self.last_stats: ReductionStats | None = None
        # Host times (perf_counter_ns) of the last synchronised backward, for DDP's logging data:
        # backward start, first bucket launch, end of autograd (finalize start), finalize end.
        self.times: dict[str, int] = {}
        self.on_finalized: Any = None        # callback(reducer) after a successful finalize
        self.on_error: Any = None            # callback(message) before DDP raises an error
        self.used_last: list[bool] = []      # parameters that had a gradient in the last reduction
        self._premul: Any = None             # the PREMUL_SUM(1/world) op, see _reduce_op
        self._handles = [functools.partial(self._on_grad_ready, i) for i in range(n)]
        self._hooks = [p.register_post_accumulate_grad_hook(h)
                       for p, h in zip(params, self._handles)]

    # -- forward side --------------------------------------------------------------------------
    def check_finished(self, reset: bool = True) -> None:
        """Raise if the previous synchronised backward started but never finalized (and forget
        it)."""
        if self.phase is Phase.REDUCING:
            if reset:
                self._reset()
            msg = ("Expected to have finished reduction in the prior iteration before starting a "
                   f"new one. DistributedDataParallel (rank {self.pg.rank()}): expected the "
                   f"gradient reduction of iteration {self.reductions + 1} to finish before a new "
                   "forward, but its backward did not complete (it raised, or was run with "
                   "torch.autograd.grad instead of backward())")
            if self.on_error is not None:
                self.on_error(msg)
            raise RuntimeError(msg)

    def skip_backward(self) -> None:
        """A training forward that will not synchronise (``no_sync``): forget a stale prepared
        state.

        (A synchronising forward whose backward never ran -- e.g. evaluation with grad enabled --
        must not make the next ``no_sync`` backward reduce.)
        """
        if self.phase is Phase.PREPARED:
            self._reset()

    def prepare_for_backward(self, outputs: Any, join_work: Any,
                             divide_by_initial_world_size: bool = True) -> None:
        """After a synchronising forward: expect hooks, find unused parameters, hook backward
        start."""
        if self.phase is Phase.IDLE:
            self.join_work = join_work
            self.join_sums = join_work is not None and not divide_by_initial_world_size
        self.phase = Phase.PREPARED
        if self.find_unused and not (self.static_graph and self._expected_calls is not None):
            found = _graph.reachable_params(outputs, self._index)
            self._reachable = found if self._reachable is None else self._reachable | found
        _graph.hook_backward_start(outputs, self._on_backward_start)

    # -- backward side ---------------------------------------------------------------------------
    def _on_backward_start(self) -> None:
        if self.phase is not Phase.PREPARED:
            return
        self.phase = Phase.REDUCING
        self.times = {"backward_start": time.perf_counter_ns()}
        torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        for i in self._known_unused():
            self._mark_unused(i)
        if not self._deferred():
            self._launch_ready()

    def _known_unused(self) -> list[int]:
        if self._expected_calls is not None:
            return [i for i, c in enumerate(self._expected_calls) if c == 0]
        if self.find_unused and self._reachable is not None:
            return [i for i in range(len(self.params)) if i not in self._reachable]
        return []

    def _deferred(self) -> bool:
        # static_graph's first iteration reduces everything at the end of backward: it learns how
        # often each parameter's hook fires (reentrant checkpointing may reuse a parameter).
        return self.static_graph and self._expected_calls is None

    def _on_grad_ready(self, i: int, param: torch.Tensor) -> None:
        if param.grad is not None:
            self._used_since_sync[i] = True
        if self.phase is Phase.IDLE:
            return                                   # no_sync, or the module used directly
        if self.phase is Phase.PREPARED:
            self._on_backward_start()
        self._calls[i] += 1
        if self._expected_calls is not None and self._calls[i] < self._expected_calls[i]:
            return                                   # more uses of this parameter to come
        bucket = self.layout.bucket_of(i)
        if self._fired[i] or self._premarked[i]:
            self._ready_again(i, bucket)
            return
        self._fired[i] = True
        if self._recording:
            self.observed.append(i)
        self.layout.copy_in(i, param)
        if bucket.arrive() and not self._deferred():
            self._launch_ready()

    def _mark_unused(self, i: int) -> None:
        """Parameter ``i`` gets no gradient in this backward: its slot takes what ``.grad``
        holds ([Note: slots of unused parameters]) and it counts as in."""
        self._premarked[i] = True
        self.layout.contribute_held(i)
        self.layout.bucket_of(i).mark_unused()

    def _ready_again(self, i: int, bucket: Bucket) -> None:
        """A gradient arrived for a parameter already counted (reused, or thought unused)."""
        if bucket.launched and not self._deferred():
            raise RuntimeError(
                f"DistributedDataParallel (rank {self.pg.rank()}): parameter '{self.names[i]}' "
                f"received a gradient after its bucket {bucket.index} was already all-reduced in "
                f"iteration {self.reductions + 1} (expected one gradient per parameter per "
                "backward).  This happens when a parameter is used in several reentrant "
                "checkpoints or otherwise outside the graph seen by DDP; pass static_graph=True if "
                "the graph is the same every iteration, or use torch.utils.checkpoint(..., "
                "use_reentrant=False)")
        self._fired[i] = True
        self.layout.copy_in(i, self.params[i])

    # -- launching -----------------------------------------------------------------------------
    def _launch_ready(self) -> None:
        buckets = self.layout.buckets
        while self._next < len(buckets) and buckets[self._next].ready:
            self._launch(buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        bucket.launched = True
        self.times.setdefault("first_launch", time.perf_counter_ns())
        if self.skip_unused and all(self._premarked[i] and not self._fired[i]
                                    and not self._used_since_sync[i]
                                    for i in bucket.plan.indices):
            return                                   # unused on every rank (the user promised)
        buf = bucket.buffer
        if buf is None:
            raise AssertionError(f"DDP: bucket {bucket.index} launched without a buffer")
        if self.comm_hook is not None:
            state, hook = self.comm_hook
            gb = GradBucket(bucket.index, buf, [self.params[i] for i in bucket.plan.indices],
                            list(bucket.plan.offsets), bucket.index == len(self.layout.buckets) - 1)
            fut = hook(state, gb)
            # torch.futures.Future, or what .then() returns
            if not isinstance(fut, torch._C.Future):
                raise TypeError(f"DistributedDataParallel: expected the comm hook to return a "
                                f"torch.futures.Future, got {type(fut).__name__}")
            bucket.handle = fut
            return
        with traced(f"DDP.all_reduce bucket {bucket.index}"):
            bucket.handle = all_reduce(buf, op=self._reduce_op(self.join_sums), group=self.pg,
                                       async_op=True)

    def _reduce_op(self, join_sums: bool) -> Any:
        """Each rank's gradient times 1/world_size, summed (torch divides before its SUM too).

        PREMUL_SUM scales while copying into the transport, saving AVG's extra pass over the
        result.  Inside Join with ``divide_by_initial_world_size=False`` the divisor (ranks still
        active) is known only later: SUM, and the end of backward divides.  A joined rank's
        zeros must use the same op (debug mode compares ops across ranks).
        """
        if join_sums:
            return ReduceOp.SUM
        if self._premul is None:                     # one object, built once (it is immutable)
            self._premul = _make_nccl_premul_sum(1.0 / self.pg.size())
        return self._premul

    def enable_static_graph(self) -> None:
        """Treat the graph as static from now on (``DDP._set_static_graph``, before the first
        iteration): learn each parameter's hook count in the first reduction, rebuild once."""
        self.static_graph = True
        self._record = True
        self._recording = self.reductions == 0

    # -- bucket rebuild --------------------------------------------------------------------------
    def rebuild_pending(self) -> bool:
        """Whether the next training forward rebuilds the buckets (once, after the first
        reduction)."""
        return self._record and not self.rebuilt and self.reductions >= 1

    def rebuild_buckets(self, src: int) -> bool:
        """Adopt group rank ``src``'s observed ready order (one broadcast) and rebuild the buckets.

        Every rank must call this at the same point (torch's DDP does it at the start of the
        second iteration).  Returns whether the layout changed.
        """
        n = len(self.params)
        order = torch.full((n,), -1, dtype=torch.int64, device=self._aux)
        if self.pg.rank() == src and self.observed:
            order[:len(self.observed)] = torch.tensor(self.observed, dtype=torch.int64)
        with self.annotate("bucket rebuild"):
            broadcast(order, group=self.pg, group_src=src)
        self.rebuilt = True
        agreed = [i for i in order.tolist() if i >= 0]
        return bool(agreed) and self.layout.install(complete_order(agreed, n))

    # -- Join: a joined rank's side of an iteration ---------------------------------------------
    def shadow_backward(self, divide_by_initial_world_size: bool = True) -> None:
        """Issue one iteration's backward collectives with zero gradients (a rank out of data)."""
        with self.annotate("joined rank's shadow all-reduce"):
            handles = []
            for b in self.layout.buckets:
                zeros = torch.zeros(b.plan.numel, dtype=b.plan.dtype, device=self.layout.device)
                if self.comm_hook is not None:
                    state, hook = self.comm_hook
                    params = [self.params[i] for i in b.plan.indices]
                    gb = GradBucket(b.index, zeros, params, list(b.plan.offsets),
                                    b.index == len(self.layout.buckets) - 1)
                    handles.append(hook(state, gb))
                else:
                    handles.append(all_reduce(zeros,
                                              op=self._reduce_op(not divide_by_initial_world_size),
                                              group=self.pg, async_op=True))
            local = torch.full((len(self.params),), _JOINED, dtype=torch.uint8, device=self._aux)
            table = torch.empty(self.pg.size() * local.numel(), dtype=torch.uint8, device=self._aux)
            handles.append(all_gather_into_tensor(table, local, group=self.pg, async_op=True))
            for h in handles:
                h.wait()

    # -- end of backward -----------------------------------------------------------------------
    def _finalize(self) -> None:
        self.times["finalize_start"] = time.perf_counter_ns()
        try:
            with traced("DDP.finalize"), self.annotate("gradient all-reduce"):
                self._finish_reduction()
        except Exception as e:
            if self.on_error is not None:
                self.on_error(str(e))
            raise
        finally:
            self._reset()
        self.times["finalize_end"] = time.perf_counter_ns()
        if self.on_finalized is not None:
            self.on_finalized(self)

    def _finish_reduction(self) -> None:
        t0 = time.perf_counter()
        buckets = self.layout.buckets
        done_bytes = sum(b.plan.nbytes for b in buckets if b.is_done())
        for i in range(len(self.params)):
            if not self._fired[i] and not self._premarked[i]:
                self._mark_unused(i)                 # no gradient this backward: what .grad holds
        self._launch_ready()
        self.used_last = [f or u for f, u in zip(self._fired, self._used_since_sync)]
        local = torch.tensor([_USED if u else _NOT_USED for u in self.used_last], dtype=torch.uint8,
                             device=self._aux)
        table = torch.empty(self.pg.size() * local.numel(), dtype=torch.uint8, device=self._aux)
        work = all_gather_into_tensor(table, local, group=self.pg, async_op=True)
        divisor = self._join_divisor()
        # Copy each bucket out as soon as it is reduced, while later buckets are still in flight.
        for bucket in self.layout.buckets:
            bucket.wait_result()
            if divisor is not None and bucket.buffer is not None:
                bucket.buffer.div_(divisor)
            for i in bucket.plan.indices:
                if self._fired[i]:
                    self.layout.copy_out(i, self.params[i])
        if work is None:
            raise AssertionError("DDP: the used-map all-gather returned no Work")
        work.wait()
        used = table.view(self.pg.size(), -1)
        if not self.find_unused:
            self._check_all_fired(used)
        if not all(self._fired):
            used_any = (used == _USED).any(dim=0).tolist()
            for i, p in enumerate(self.params):
                if not self._fired[i] and used_any[i]:
                    self.layout.copy_out(i, p)       # used on another rank: take the average
        if self.static_graph and self._expected_calls is None:
            self._expected_calls = list(self._calls)
        self.last_stats = ReductionStats(self.reductions + 1, len(buckets),
                                         sum(b.plan.nbytes for b in buckets),
                                         done_bytes, time.perf_counter() - t0)

    def _check_all_fired(self, used: torch.Tensor) -> None:
        if bool(used.min() != _NOT_USED):              # the common case: one cheap check
            return
        missing = (used == _NOT_USED).nonzero().tolist()
        by_rank: dict[int, list[str]] = {}
        for r, i in missing:
            by_rank.setdefault(r, []).append(self.names[i])
        parts = [f"rank {r}: {', '.join(repr(n) for n in names[:10])}"
                 + (f" and {len(names) - 10} more" if len(names) > 10 else "")
                 for r, names in sorted(by_rank.items())]
        raise RuntimeError(
            f"DistributedDataParallel (rank {self.pg.rank()}): expected every parameter that "
            f"requires grad to receive a gradient in iteration {self.reductions + 1}, but these "
            f"did not: {'; '.join(parts)}.  Pass find_unused_parameters=True if the forward pass "
            "does not use every parameter (or the use differs between ranks), make sure every "
            "output takes part in the loss, or set requires_grad=False on parameters that are not "
            "trained")

    def _join_divisor(self) -> int | None:
        """Inside Join with ``divide_by_initial_world_size=False`` (SUM): the active ranks."""
        if not self.join_sums or self.comm_hook is not None:
            return None
        self.join_work.wait()          # issued before this iteration's buckets: already done
        return max(1, int(_work_value(self.join_work).item()))

    def _reset(self) -> None:
        n = len(self.params)
        self._fired = [False] * n
        self._premarked = [False] * n
        self._calls = [0] * n
        self._reachable = None
        self._next = 0
        self.join_work = None
        self.join_sums = False
        self.layout.reset_iteration()
        if self.phase is Phase.REDUCING:
            self.reductions += 1
            self._recording = False                  # the first reduction's order is the one kept
            self._used_since_sync = [False] * n
        self.phase = Phase.IDLE

    @contextlib.contextmanager
    def annotate(self, what: str) -> Iterator[None]:
        """Re-raise communication errors naming DDP's rank, iteration and step."""
        try:
            yield
        except DistError as e:
            raise type(e)(
                f"DistributedDataParallel (rank {self.pg.rank()}) iteration {self.reductions + 1}, "
                f"{what}: {e}  (if ranks run different numbers of iterations -- uneven inputs -- "
                "wrap the training loop in `with ddp_model.join():`)", **e.context) from e

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []


def _bucket_memory(pg: ProcessGroup) -> BucketMemory | None:
    """Buckets in ``pg``'s shared memory where its collectives read them in place; None where
    they would be ordinary tensors anyway ([Note: buckets in shared memory])."""
    if not is_comm_buffer(comm_buffer(1, group=pg), group=pg):
        return None
    return BucketMemory(lambda numel, dtype: comm_buffer(numel, dtype, group=pg).zero_(),
                        lambda t: is_comm_buffer(t, group=pg))


def _work_value(work: Any) -> torch.Tensor:
    result = work.result() if hasattr(work, "result") else work.get_future().value()
    return result[0] if isinstance(result, (list, tuple)) else result
