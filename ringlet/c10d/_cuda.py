"""Collectives on CUDA tensors: ordering on the caller's streams.

[Note: CUDA streams]
A collective on CUDA tensors keeps torch's contract for NCCL:

- it reads its inputs after every kernel that was queued on the caller's current stream (of the
  tensors' device) when it was called;
- a synchronous call returns once the collective is queued: work queued afterwards on the
  current stream sees its results, and the host does not wait for the GPU;
- ``async_op=True`` returns a :class:`~ringlet.c10d.work.Work` at once; ``work.wait()`` makes
  the stream that is current *then* wait for the results (the host blocks only where the
  transport runs on the host, below), and ``work.get_future()`` is a CUDA-aware
  ``torch.futures.Future``: its ``then`` callbacks and ``wait()`` are ordered after the
  collective on the streams, as torch's are.

Transports serve CUDA tensors in one of two ways (``Transport.stream_ordered``):

- *stream-ordered* (torch's NCCL through the ``torch_engine`` adapter): the call runs on the
  caller's thread.  A synchronous one runs on the current stream (the engine makes that stream
  wait for NCCL).  An asynchronous one runs with the group's side stream as the current stream,
  after that stream waited for the caller's; an event recorded on it after the call is what
  ``wait()`` makes the caller's stream wait for.  Compute queued after an asynchronous
  collective (DDP's next gradients, FSDP's next layer) therefore overlaps it.  Tensors used on
  the side stream are recorded with it (``record_stream``) so the caching allocator never hands
  their memory out while the collective may still read it.
- *staged* (ringlet's CPU transports, ``ringlet/transport/staging.py``): the call is a host
  collective on copies.  At issue an event is recorded on the caller's stream; the call --
  inline, or on the group's communication thread like any asynchronous op -- runs on the side
  stream after waiting for that event, with blocking copies, so when it returns the results are
  in place and nothing remains queued.  The host-side Work then carries the ordering.

Nothing here runs for CPU tensors: a group looks for CUDA tensors only when its transport serves
them (``ProcessGroup._accel``), so CPU collectives keep their cost.

The CUDA calls go through :data:`api`, which CPU tests replace with a recorder
(``tests/test_gpu.py``), together with :data:`DEVICE_TYPES`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d.work import Work
from ringlet.errors import DistBackendError

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["DEVICE_TYPES", "StreamAPI", "StreamWork", "api", "bind_device", "device_of", "issue",
           "issue_p2p", "serves", "staged"]

DEVICE_TYPES: tuple[str, ...] = ("cuda",)    # device types whose tensors are stream-ordered


class StreamAPI:
    """The CUDA stream and event calls the collectives make (one seam for tests)."""

    def current(self, device: torch.device) -> Any:
        return torch.cuda.current_stream(device)

    def new_stream(self, device: torch.device) -> Any:
        return torch.cuda.Stream(device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def record(self, stream: Any) -> Any:
        return stream.record_event()

    def wait_event(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def keep_alive(self, tensor: torch.Tensor, stream: Any) -> None:
        tensor.record_stream(stream)

    def future(self, device: torch.device) -> torch.futures.Future:
        return torch.futures.Future(devices=[device])


api = StreamAPI()


def serves(transport: Any) -> bool:
    """Whether ``transport`` takes tensors of a stream-ordered device type (checked per call)."""
    return any(d in transport.devices for d in DEVICE_TYPES)


def device_of(*groups: Any) -> torch.device | None:
    """The device of the first tensor of a stream-ordered type in ``groups`` (tensors, lists)."""
    for x in groups:
        if isinstance(x, torch.Tensor):
            if x.device.type in DEVICE_TYPES:
                return x.device
        elif isinstance(x, (list, tuple)):
            found = device_of(*x)
            if found is not None:
                return found
    return None


def side_stream(streams: dict[Any, Any], device: torch.device) -> Any:
    """The group's side stream on ``device`` (``streams`` is the group's own cache)."""
    s = streams.get(device)
    if s is None:
        s = streams[device] = api.new_stream(device)
    return s


def _tensors_on(x: Any, device: torch.device) -> Iterator[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        if x.device == device:
            yield x
    elif isinstance(x, (list, tuple)):
        for item in x:
            yield from _tensors_on(item, device)


class StreamWork(Work):
    """The Work of a stream-ordered asynchronous collective (see [Note: CUDA streams]).

    It is issued when it exists: ``wait()`` only orders the current stream after ``event``
    (with a ``timeout`` it also blocks the host until the event completes, as torch's does).
    """

    def __init__(self, result: Any, op: str, bound: float, device: torch.device, stream: Any,
                 event: Any) -> None:
        super().__init__(result, op, bound)
        self._device = device
        self._stream = stream
        self._event = event
        self._done.set()

    def wait(self, timeout: float | timedelta | None = None) -> bool:
        api.wait_event(api.current(self._device), self._event)
        limit = timeout.total_seconds() if isinstance(timeout, timedelta) else timeout
        if limit is not None and limit > 0:
            deadline = time.monotonic() + limit
            while not api.done(self._event):
                if time.monotonic() > deadline:
                    raise DistBackendError(f"Work.wait: {self._op} did not complete on "
                                           f"{self._device} within {limit:.1f} s", op=self._op,
                                           timeout=limit)
                time.sleep(0.0005)
        return True

    def is_completed(self) -> bool:
        return api.done(self._event)

    def is_success(self) -> bool:
        return self.is_completed()

    def get_future(self) -> torch.futures.Future:
        with self._lock:
            if self._future is None:
                fut = api.future(self._device)
                with api.use(self._stream):        # its events follow the collective
                    fut.set_result(self._result)
                self._future = fut
            return self._future

    def __repr__(self) -> str:
        return f"Work({self._op}, queued on {self._device})"


def issue(pg: ProcessGroup, fn: Callable[[], None], ctx: Any, result: Any, async_op: bool,
          guard: bool,
          device: torch.device, inputs: Any = None) -> Work | None:
    """Run a stream-ordered collective on the caller's thread (see [Note: CUDA streams])."""
    if pg.detail_check is not None and pg._executor.pending:
        _drain(pg)                      # the DETAIL check uses the CPU transport: in order
    if not async_op:
        pg._call(fn, guard)
        pg._done = ctx.seq
        return None
    work = StreamWork(result, f"{ctx.op} #{ctx.seq}", pg.timeout, device,
                      side_stream(pg._device_streams, device), None)
    _on_side_stream(pg, fn, work, guard, (result, inputs))
    pg._done = ctx.seq
    return work


def issue_p2p(pg: ProcessGroup, fn: Callable[[Work], None], ctx: Any, result: Any,
              device: torch.device) -> Work:
    """A stream-ordered send or receive (always asynchronous), on the caller's thread."""
    work = StreamWork(result, f"{ctx.op} peer {ctx.root}", pg.timeout, device,
                      side_stream(pg._device_streams, device), None)
    _on_side_stream(pg, lambda: fn(work), work, True, result)
    return work


def _on_side_stream(pg: ProcessGroup, call: Callable[[], None], work: StreamWork, guard: bool,
                    tensors: Any) -> None:
    """``call()`` with ``work``'s side stream current, after the caller's stream; then the
    event that ``work.wait()`` waits for, and the tensors kept from the caching allocator."""
    side, device = work._stream, work._device
    api.wait_stream(side, api.current(device))
    with api.use(side):
        pg._call(call, guard)
        work._event = api.record(side)
    for t in _tensors_on(tensors, device):
        api.keep_alive(t, side)


def staged(pg: ProcessGroup, fn: Callable[..., None], device: torch.device) -> Callable[..., None]:
    """``fn`` (a host collective on copies of device tensors) ordered after the caller's stream.

    The event is recorded now, at issue; the returned callable may run later on the group's
    communication thread."""
    ready = api.record(api.current(device))
    side = side_stream(pg._device_streams, device)

    def run(*args: Any) -> None:
        with api.use(side):
            api.wait_event(side, ready)
            fn(*args)
    return run


def bind_device(device_id: Any, where: str) -> torch.device | None:
    """``init_process_group(device_id=...)``: check it and make it the current CUDA device.

    Returns the bound device (None for ``None`` or a CPU device).

    Raises:
        TypeError: not an int or a ``torch.device``.
        ValueError: a CUDA device this host lacks.
    """
    if device_id is None:
        return None
    if isinstance(device_id, int) and not isinstance(device_id, bool):
        device = torch.device("cuda", device_id)
    elif isinstance(device_id, torch.device):
        device = device_id
    else:
        raise TypeError(f"{where}: device_id: expected a torch.device or a CUDA device index, "
                        f"got {device_id!r}")
    if device.type == "cpu":
        return None
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if device.type != "cuda" or device.index is None or not 0 <= device.index < count:
        raise ValueError(f"{where}: device_id: expected a CUDA device with an index below {count} "
                         f"(the CUDA devices this host has), got {device_id!r}")
    torch.cuda.set_device(device)
    return device


def _drain(pg: ProcessGroup) -> None:
    """Wait until the group's communication thread has run everything queued before now."""
    marker = Work(None, op="drain", bound=pg.timeout)
    pg._executor.submit(lambda: None, marker)
    marker.wait()
