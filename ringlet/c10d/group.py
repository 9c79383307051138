"""``ProcessGroup``: a set of ranks, its transport, sequence numbers and error policy.

Collectives are issued through :meth:`ProcessGroup.run`.  A synchronous call
runs inline on the caller's thread when nothing is queued (no thread hand-off
on the latency path); otherwise, and for ``async_op=True``, it is queued on the
group's communication thread, so operations on one group always run in issue
order.  Point-to-point operations run on one thread per (peer, direction), so
a pending large ``isend`` never blocks an ``irecv`` (see ``p2p.py``).

A communication fault (timeout, dead peer, mismatch) poisons the group: the
transport's abort flag makes every peer fail fast, and every later call here
raises :class:`GroupAbortedError` citing the first error.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeAlias

import torch

from ringlet._heartbeat import beat
from ringlet.c10d import _cuda, faults
from ringlet.c10d.pg_methods import TorchGroupMethods
from ringlet.c10d.work import Executor, Work
from ringlet.errors import CollectiveTimeoutError, DistBackendError, GroupAbortedError
from ringlet.transport.base import OpContext, Transport

__all__ = ["ProcessGroup"]


class WrapsGroup(Protocol):
    """An object that stands for a group wherever a ``group=`` argument is taken (a 1-d
    DeviceMesh): ``resolve_group`` asks it for its group, or None on a rank outside it."""

    def _ringlet_pg(self) -> ProcessGroup | None: ...


HangReporter = Callable[["ProcessGroup", BaseException], str]
DetailCheck = Callable[["ProcessGroup", OpContext, Any], None]


class ProcessGroup(TorchGroupMethods):
    """Ranks ``ranks`` (global ranks, sorted) communicating over ``transport``.

    ``rank()`` and ``size()`` are this rank's position in the group and its size
    (methods, as in torch); ``backend`` (and ``name()``) is the name the user gave,
    ``transport_name`` what runs.  Prints as ``ProcessGroup(rank 1/2, ranks [0, 1], gloo on shm)``.
    torch's method API (``pg.allreduce([t]).get_future()``, ...) comes from
    :class:`~ringlet.c10d.pg_methods.TorchGroupMethods`.

    Args:
        hang_reporter: builds the merged hang report when a collective times out.
        detail_check: run before every collective (debug level DETAIL) to compare its
            arguments across ranks.
    """

    def __init__(self, name: str, ranks: list[int], group_rank: int, transport: Transport,
                 timeout: float, backend: str, desc: str | None = None, *,
                 transport_name: str | None = None, hang_reporter: HangReporter | None = None,
                 detail_check: DetailCheck | None = None) -> None:
        self.group_name = name
        self.group_desc = desc or name
        self._ranks = list(ranks)
        self._rank = group_rank
        self._size = len(ranks)
        self.transport = transport
        self.timeout = timeout
        self.backend = backend
        self.transport_name = transport_name or backend
        self._seq = 0
        self._error: BaseException | None = None
        self._executor = Executor(f"ringlet-{self.group_desc}")
        self._p2p: dict[tuple[int, str], Executor] = {}
        self._p2p_lock = threading.Lock()
        self._fault = faults.parse_for(self._ranks[group_rank])
        # Per-op counters (collectives issued, elements moved); read with counts() /
        # ringlet.distributed.stats().
        self._counts: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._elements: collections.defaultdict[str, int] = collections.defaultdict(int)
        self._history: collections.deque[OpContext] = collections.deque(maxlen=16)
        self._done = 0               # sequence number of the last collective that completed here
        # Given by the world (ringlet.c10d.world): merged hang report on timeout, DETAIL checks
        # (set_debug_level switches the latter on live groups).
        self.hang_reporter = hang_reporter
        self.detail_check = detail_check
        self.destroyed = False
        self.created = time.monotonic()   # the straggler reports' first interval starts here
        # CUDA tensors are looked for only where the transport serves them ([Note: CUDA streams]).
        self._accel = _cuda.serves(transport)
        self._device_streams: dict[Any, Any] = {}    # device -> this group's side stream

    # -- torch's accessors ----------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def name(self) -> str:
        return self.backend

    @property
    def ranks(self) -> list[int]:
        return list(self._ranks)

    def __repr__(self) -> str:
        on = "" if self.transport_name == self.backend else f" on {self.transport_name}"
        return (f"ProcessGroup(rank {self._rank}/{self._size}, ranks {self._ranks}, "
                f"{self.backend}{on})")

    # -- running operations -----------------------------------------------------------------
    def context(self, op: str, dtype: torch.dtype | None = None, numel: int = 0, root: int = -1,
                redop: int = -1) -> OpContext:
        """Allocate the next sequence number and the op's deadline."""
        if self._error is not None or self.destroyed:
            self.check_usable()
        self._seq += 1
        return OpContext(op, self._seq, self._rank, self._size, self.group_desc, self.timeout,
                         dtype, numel, root, redop)

    def counts(self) -> dict[str, int]:
        """Collectives issued on this group so far, per op name (``{"all_reduce": 12, ...}``)."""
        return dict(self._counts)

    def elements(self) -> dict[str, int]:
        """Elements of this rank's input moved per op name (all_gather: input elements)."""
        return dict(self._elements)

    def debug_state(self) -> dict[str, Any]:
        """What a hang report needs from this group: last issued/completed seq, recent calls."""
        return {"desc": self.group_desc, "seq": self._seq, "done": self._done,
                "history": [[c.seq, c.describe()] for c in list(self._history)]}

    def wait_stats(self) -> tuple[float, dict[int, float]]:
        """(seconds this rank spent waiting for peers, {group rank: seconds it was the one
        awaited})."""
        fn = getattr(self.transport, "wait_stats", None)
        return fn() if fn is not None else (0.0, {})

    def reset_counts(self) -> None:
        self._counts.clear()
        self._elements.clear()

    @property
    def seq(self) -> int:
        """Sequence number of the last collective issued on this group."""
        return self._seq

    def check_usable(self) -> None:
        if self.destroyed:
            raise DistBackendError(f"{self!r} was destroyed; create a new group")
        if self._error is not None:
            raise GroupAbortedError(f"{self!r} is unusable after an earlier failure: {self._error}",
                                    group=self.group_desc) from self._error

    def run(self, fn: Callable[[], None], ctx: OpContext, result: Any, async_op: bool,
            guard: bool = True, label: str | None = None, inputs: Any = None) -> Work | None:
        """Run ``fn`` (which talks to the transport) in issue order; see the module docstring.

        ``guard=False`` says that no tensor involved requires grad, so the autograd guard
        (~1 us on the latency path) can be skipped.  Under a profiler the op is one event
        named ``<backend>:<label>`` (default label: ``ctx.op``) recording ``inputs``
        (default: ``result``), see [Note: profiler events].
        """
        fn = self._issued(fn, ctx, result)
        op = ctx.op
        device = _cuda.device_of(result, inputs) if self._accel else None
        if device is not None:
            if device.type in self.transport.stream_ordered:
                return _cuda.issue(self, fn, ctx, result, async_op, guard, device, inputs)
            fn = _cuda.staged(self, fn, device)
        profiling = torch._C._autograd._profiler_enabled()
        idle = not profiling and self._executor.pending == 0
        if idle and not async_op:
            self._call(fn, guard)
            self._done = ctx.seq
            return None
        work = Work(result, op=f"{ctx.op} #{ctx.seq}", bound=self.timeout, device=device)
        if idle and self._size == 1:
            return self._run_alone(fn, ctx, work, guard)
        if profiling:
            self._begin_event(f"{self.backend}:{label or op}",
                              result if inputs is None else inputs, work)
        self._executor.submit(lambda: self._call_queued(fn, ctx), work)
        if async_op:
            return work
        work.wait()
        return None

    def _run_alone(self, fn: Callable[[], None], ctx: OpContext, work: Work, guard: bool) -> Work:
        """An asynchronous op of a one-rank group: nothing to overlap with (no peer to wait
        for), so it runs on the caller's thread and ``work`` is complete when returned, which
        spares the hand-off to the communication thread (~0.1 ms).  An error is the Work's, as
        on that thread (``wait()`` raises it)."""
        try:
            self._call(fn, guard)
        except Exception as e:  # noqa: BLE001 - handed to the waiter, as the thread does
            work._complete(e)
        else:
            work._complete()
        self._done = ctx.seq
        return work

    def run_now(self, fn: Callable[[], None], ctx: OpContext, result: Any, guard: bool) -> None:
        """:meth:`run` for a synchronous op when nothing is queued on this group, no profiler
        runs and the transport serves no accelerator (the caller checked all three): the
        latency path, which builds no :class:`Work`."""
        self._call(self._issued(fn, ctx, result), guard)
        self._done = ctx.seq

    def _issued(self, fn: Callable[[], None], ctx: OpContext, result: Any) -> Callable[[], None]:
        """What every issued op records (progress, fault injection, counters, history);
        ``fn`` with the DETAIL check in front when that debug level is on."""
        beat()   # progress, for ringlet-run --heartbeat-timeout ([Note: heartbeat])
        if self._fault is not None:
            self._fault.maybe_fire(ctx)
        op = ctx.op
        self._counts[op] += 1
        self._elements[op] += ctx.numel
        self._history.append(ctx)
        if self.detail_check is not None:
            return self._with_detail_check(fn, ctx, result)
        return fn

    def _begin_event(self, name: str, inputs: Any, work: Work) -> None:
        """[Note: profiler events] Under ``torch.profiler``/``torch.autograd.profiler`` every
        operation is one event named ``"<backend>:<op>"`` (``"gloo:all_reduce"``, as torch
        names them) recording its input shapes (complex tensors as their real view), the
        tensors only, as torch's do (scripts compare ``input_shapes``).  The op then runs on a
        communication thread and its event ends when the op completes there, so it is an
        asynchronous span, as torch's are.  Inside it, at its start, an instant event
        ``"ringlet:group [r0, r1, ...]"`` names the group by its global ranks."""
        tensors = [torch.view_as_real(t) if t.is_complex() else t for t in _tensors(inputs)]
        handle = torch._C._autograd._record_function_with_args_enter(name, *tensors)
        mark = torch._C._autograd._record_function_with_args_enter(
            f"ringlet:group {list(self._ranks)}")
        torch.ops.profiler._record_function_exit._RecordFunction(mark)
        torch.ops.profiler._call_end_callbacks_on_jit_fut(handle, work.get_future())

    def _call_queued(self, fn: Callable[[], None], ctx: OpContext) -> None:
        self._call(fn, False)   # the communication thread runs without grad
        self._done = ctx.seq

    def _with_detail_check(self, fn: Callable[[], None], ctx: OpContext,
                           result: Any) -> Callable[[], None]:
        from ringlet.c10d.debug import callsite

        ctx.callsite = callsite()
        check = self.detail_check

        def checked() -> None:
            if check is not None:
                check(self, ctx, result)
            fn()
        return checked

    def run_p2p(self, fn: Callable[[Work], None], peer: int, direction: str, ctx: OpContext,
                result: Any, label: str | None = None) -> Work:
        """Queue a send/recv on the (peer, direction) thread; returns its Work."""
        device = _cuda.device_of(result) if self._accel else None
        if device is not None:
            if device.type in self.transport.stream_ordered:
                return _cuda.issue_p2p(self, fn, ctx, result, device)
            fn = _cuda.staged(self, fn, device)
        key = (peer, direction)
        with self._p2p_lock:
            ex = self._p2p.get(key)
            if ex is None:
                ex = self._p2p[key] = Executor(f"ringlet-{self.group_desc}-{direction}-{peer}")
        work = Work(result, op=f"{ctx.op} peer {peer}", bound=self.timeout, device=device)
        if torch._C._autograd._profiler_enabled():
            self._begin_event(f"{self.backend}:{label or ctx.op}", result, work)
        ex.submit(lambda: self._call(lambda: fn(work), False), work)
        return work

    def _call(self, fn: Callable[[], None], guard: bool) -> None:
        if self._error is not None or self.destroyed:
            self.check_usable()
        # Transports write into user tensors in place; like torch's C++ collectives they must not
        # be seen by autograd (a Parameter broadcast would otherwise raise).
        if guard and torch.is_grad_enabled():
            torch._C._set_grad_enabled(False)
            try:
                self._call(fn, False)
            finally:
                torch._C._set_grad_enabled(True)
            return
        try:
            fn()
        except CollectiveTimeoutError as e:
            # a timeout learnt from a peer's abort carries that peer's report already
            if (self.hang_reporter is None or self._error is not None
                    or isinstance(e, GroupAbortedError)):
                self._poison(e)
                raise
            report = self.hang_reporter(self, e)
            full = CollectiveTimeoutError(f"{e}\n{report}", **{**e.context, "report": report})
            self._poison(full)
            raise full from None
        except DistBackendError as e:
            self._poison(e)
            raise

    def _poison(self, err: BaseException) -> None:
        if self._error is None:
            self._error = err
            try:
                self.transport.abort(f"{type(err).__name__}: {err}")
            except Exception:  # noqa: BLE001, S110 - best effort; the local error is what matters
                pass

    def abort(self, reason: str = "aborted by the user") -> None:
        """Poison this group on every rank (peers fail fast)."""
        self._poison(GroupAbortedError(reason, group=self.group_desc))

    def destroy(self) -> None:
        """Bounded teardown: stop the threads, mark this rank departed, release the transport."""
        if self.destroyed:
            return
        self.destroyed = True
        self._executor.close(timeout=min(self.timeout, 5.0))
        for ex in list(self._p2p.values()):
            ex.close(timeout=1.0)
        self.transport.close()


# What a ``group=`` argument accepts: a group, an object that wraps one, or None (the default
# group). The markers ``group.WORLD`` and ``GroupMember.NON_GROUP_MEMBER`` are typed ``Any``.
GroupArg: TypeAlias = ProcessGroup | WrapsGroup | None


def _tensors(x: Any) -> list[torch.Tensor]:
    """The tensors in ``x`` (a tensor or nested lists of them), in order."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for item in x for t in _tensors(item)]
    return []
