"""Bucket buffers and gradient slots: the memory side of the reducer.

A :class:`Layout` turns a bucket plan (``_buckets.plan_buckets``) into buckets and gives each
parameter a *slot*: a view, shaped like the parameter, of its bucket's flat buffer.  Buffers are
allocated once and reused every iteration.  Gradients move between ``.grad`` and slots:

- default: ``copy_in`` copies ``.grad`` into the slot before the all-reduce, ``copy_out``
  copies the reduced slot back;
- ``gradient_as_bucket_view=True``: ``.grad`` is made the slot itself (the first time with a
  copy; after that autograd accumulates straight into the bucket), so neither copy happens;
- a one-parameter bucket (see [Note: solo buckets] in ``_buckets.py``) adopts the gradient
  tensor itself as this iteration's buffer when it is contiguous: the all-reduce runs in place
  on ``.grad``, with no copy in either mode.  Its own buffer is allocated only if needed (a
  parameter without a gradient, a non-contiguous gradient) -- unless buffers live in shared
  memory (below).

[Note: buckets in shared memory]
On groups whose transport has a buffer heap (``shm``, ``auto`` on one host) bucket buffers are
``comm_buffer``s (:class:`BucketMemory`): the all-reduce then reads the peers' buckets where they
are and writes the result into every bucket, with no copy through the transport's slots (about
half the memory traffic of the slot path; [Note: in-place collectives] in
``ringlet/transport/arena_inplace.py``).  With ``gradient_as_bucket_view`` solo buckets use their
own shared buffer too: one copy of the gradient into it (none once autograd accumulates into the
slot) plus the in-place all-reduce beats reducing ``.grad`` through the slots (measured for a
25 MB gradient, 2 ranks: copy 2.0 ms + in place 1.55 ms against 4.1 ms).  Without bucket views
they keep adopting ``.grad``: a copy back out as well would cost 6.2 ms.  Where the heap is
missing or full, buffers are ordinary tensors and everything works as before.

[Note: slots of unused parameters]
A parameter whose hook did not fire in this backward contributes what its ``.grad`` holds:
the gradient accumulated by earlier ``no_sync`` micro-batches (or zeros when it has none), so
that every rank ends the synchronised step with the same average whichever micro-batches used
the parameter ([Note: gradients accumulated under no_sync] in ``_reducer.py``).  With bucket
views its ``.grad`` may *be* that slot, so it is first detached into a private copy; if no rank
used the parameter, that copy keeps the old gradient (a gradient nobody produced is left
untouched, as in torch), otherwise ``.grad`` becomes the averaged slot.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ringlet.parallel.ddp._buckets import BucketPlan, default_order, plan_buckets

__all__ = ["Bucket", "BucketMemory", "Layout"]


@dataclasses.dataclass(frozen=True)
class BucketMemory:
    """Where bucket buffers live ([Note: buckets in shared memory]): ``alloc(numel, dtype)``
    returns a zero-filled flat buffer, ``shared(t)`` whether the group reads ``t`` in place."""

    alloc: Callable[[int, torch.dtype], torch.Tensor]
    shared: Callable[[torch.Tensor], bool]


class Bucket:
    """One bucket: its plan, its buffer, and the state of its reduction in this iteration."""

    def __init__(self, index: int, plan: BucketPlan, params: Sequence[torch.Tensor],
                 memory: BucketMemory | None = None, device: torch.device | None = None) -> None:
        self.index = index
        self.plan = plan
        self.device = device                          # the module's (None: the CPU)
        self._shapes = [params[i].shape for i in plan.indices]
        self._memory = memory
        self._own: torch.Tensor | None = None         # the flat buffer (lazy for solo buckets)
        self.shared = False                           # _own is read by the peers in place
        self._slots: list[torch.Tensor] = []
        if not plan.solo:
            self.own()
        self.buffer: torch.Tensor | None = self._own  # what this iteration reduces
        self.adopted = False                          # solo: buffer is the gradient itself
        self._pending = len(plan.indices)             # members not counted in yet (arrive/mark)
        self.launched = False
        # Work (plain all-reduce) or Future (comm hook)
        self.handle: Any = None

    def own(self) -> torch.Tensor:
        """The bucket's own flat buffer, allocated on first use."""
        if self._own is None:
            mem = self._memory
            if mem is None:
                self._own = torch.zeros(self.plan.numel, dtype=self.plan.dtype, device=self.device)
            else:
                self._own = mem.alloc(self.plan.numel, self.plan.dtype)
                self.shared = mem.shared(self._own)
            self._slots = [self._own[off:off + shape.numel()].view(shape)
                           for off, shape in zip(self.plan.offsets, self._shapes)]
        return self._own

    def slot(self, member: int) -> torch.Tensor:
        self.own()
        return self._slots[member]

    def use_own(self) -> torch.Tensor:
        """Reduce the own buffer this iteration (not an adopted gradient)."""
        self.buffer = self.own()
        self.adopted = False
        return self.buffer

    @property
    def pending(self) -> int:
        """Members not yet counted in this iteration (by :meth:`arrive` or :meth:`mark_unused`)."""
        return self._pending

    @property
    def ready(self) -> bool:
        """Every member is counted in: the bucket can be reduced."""
        return self._pending == 0

    def arrive(self) -> bool:
        """Count in a member whose gradient is now in the bucket; True if it was the last one.

        Raises:
            AssertionError: every member was already counted in this iteration.
        """
        return self._count_in("a gradient")

    def mark_unused(self) -> bool:
        """Count in a member that gets no gradient in this backward (what its ``.grad`` holds
        was put into its slot instead); True if it was the last one.

        Raises:
            AssertionError: every member was already counted in this iteration.
        """
        return self._count_in("an unused mark")

    def _count_in(self, what: str) -> bool:
        if self._pending <= 0:
            raise AssertionError(f"DDP: bucket {self.index} expected at most "
                                 f"{len(self.plan.indices)} members counted in, got {what} after "
                                 "all of them")
        self._pending -= 1
        return self._pending == 0

    def reset(self) -> None:
        """Forget this iteration: no member counted in, nothing launched, own buffer again."""
        self.buffer = self._own
        self.adopted = False
        self._pending = len(self.plan.indices)
        self.launched = False
        self.handle = None

    def is_done(self) -> bool:
        """Whether this iteration's reduction has finished (without waiting)."""
        h = self.handle
        if h is None:
            return self.launched
        return bool(h.done() if isinstance(h, torch._C.Future) else h.is_completed())

    def wait_result(self) -> None:
        """Wait for this bucket's reduction; a comm hook's result is written into the buffer."""
        handle, self.handle = self.handle, None
        if handle is None:
            return
        if not isinstance(handle, torch._C.Future):     # a Work of a plain all-reduce
            handle.wait()
            return
        value = handle.wait()                           # a comm hook's future
        if isinstance(value, (list, tuple)):
            value = value[0]
        buf = self.buffer
        if buf is None or not isinstance(value, torch.Tensor) or value.numel() != buf.numel():
            raise TypeError("DistributedDataParallel: expected the comm hook's future to hold a "
                            f"tensor of {self.plan.numel} elements for bucket {self.index}, got "
                            f"{_describe(value)}")
        if value.data_ptr() != buf.data_ptr():
            buf.copy_(value.reshape(-1))

    def __repr__(self) -> str:
        return f"Bucket({self.index}, {self.plan!r}, pending {self.pending})"


class Layout:
    """Buckets for ``params`` and each parameter's slot (see the module docstring)."""

    def __init__(self, params: Sequence[torch.Tensor], cap_bytes: int, as_view: bool,
                 caps: Sequence[int] | None = None, memory: BucketMemory | None = None,
                 device: torch.device | None = None) -> None:
        self.params = params
        self.memory = memory
        self.device = device          # where buffers live (a GPU module's device; None: CPU)
        self.cap_bytes = cap_bytes
        self.caps = list(caps) if caps else None      # per-bucket caps (bucket_cap_mb_list)
        self.as_view = as_view
        # None: plan_buckets' default.  Benchmarks set a huge value (then re-install) to measure
        # torch's packing of large gradients, i.e. what solo buckets save.
        self.solo_bytes: int | None = None
        self.buckets: list[Bucket] = []
        self._where: list[tuple[int, int]] = []
        # per parameter, looked up by every gradient hook: its bucket, and its slot (a view of
        # the bucket's buffer; None for a solo bucket, whose buffer may never be allocated)
        self._bucket_of: list[Bucket] = []
        self._slot_of: list[torch.Tensor | None] = []
        self.install(default_order(len(params)))

    @property
    def plans(self) -> list[BucketPlan]:
        return [b.plan for b in self.buckets]

    def install(self, order: list[int]) -> bool:
        """(Re)build the buckets for a ready ``order``; False if the plan did not change."""
        plans = plan_buckets([p.numel() for p in self.params],
                             [p.dtype for p in self.params], order,
                             self.cap_bytes, solo_bytes=self.solo_bytes, caps=self.caps)
        if self.buckets and plans == self.plans:
            return False
        old = [self.slot(i) if self.buckets and not self.bucket_of(i).plan.solo else None
               for i in range(len(self.params))]
        self.buckets = [Bucket(k, plan, self.params, self.memory, self.device)
                        for k, plan in enumerate(plans)]
        where = [(0, 0)] * len(self.params)
        for b in self.buckets:
            for m, i in enumerate(b.plan.indices):
                where[i] = (b.index, m)
        self._where = where
        self._bucket_of = [self.buckets[b] for b, _ in where]
        self._slot_of = [None if self.buckets[b].plan.solo else self.buckets[b].slot(m)
                         for b, m in where]
        if self.as_view:
            for i, p in enumerate(self.params):
                prev = old[i]
                if p.grad is not None and not self.bucket_of(i).plan.solo and (
                        prev is None or _aliases(p.grad, prev)):
                    self.copy_in(i, p)       # existing gradients move into the (new) buckets
            self.reset_iteration()
        return True

    def bucket_of(self, i: int) -> Bucket:
        return self._bucket_of[i]

    def slot(self, i: int) -> torch.Tensor:
        s = self._slot_of[i]
        if s is not None:
            return s
        b, m = self._where[i]
        return self.buckets[b].slot(m)

    def copy_in(self, i: int, p: torch.Tensor) -> None:
        """Put parameter ``i``'s gradient into its bucket (see the module docstring)."""
        g = p.grad
        slot = self._slot_of[i]
        if slot is not None and not self.as_view and g is not None and g.layout is _STRIDED:
            slot.copy_(g)    # the common case: a shared bucket, whose buffer is its own
            return
        if g is None:
            raise AssertionError(f"DDP: parameter {i} fired its gradient hook without a gradient")
        if g.layout != torch.strided:
            raise NotImplementedError("DistributedDataParallel: expected dense gradients, got a "
                                      f"{g.layout} gradient for parameter {i} (sparse gradients "
                                      "are not supported)")
        bucket = self._bucket_of[i]
        if (bucket.plan.solo and g.is_contiguous() and g.dtype == bucket.plan.dtype
                and not (self.as_view and self.memory is not None and bucket.own() is not None
                         and bucket.shared)):
            bucket.buffer = g.view(-1)       # reduce in place on the gradient: no copy
            bucket.adopted = True
            return
        slot = self.slot(i)
        bucket.use_own()
        if self.as_view:
            if not _aliases(g, slot):
                slot.copy_(g)
                p.grad = slot
        else:
            slot.copy_(g)

    def copy_out(self, i: int, p: torch.Tensor) -> None:
        """Make ``.grad`` hold the reduced slot."""
        bucket = self.bucket_of(i)
        if bucket.adopted:
            return                           # reduced in place on .grad
        slot = self.slot(i)
        g = p.grad
        if self.as_view:
            if g is None or not _aliases(g, slot):
                p.grad = slot
        elif g is None:
            p.grad = slot.clone()
        else:
            g.copy_(slot)

    def contribute_held(self, i: int) -> None:
        """Parameter ``i`` got no gradient in this backward: put what ``.grad`` holds (zeros if
        nothing) into its slot, never reducing ``.grad`` in place (see [Note: slots of unused
        parameters])."""
        bucket = self.bucket_of(i)
        if bucket.plan.solo:
            bucket.use_own()
        slot = self.slot(i)
        g = self.params[i].grad
        if g is None:
            slot.zero_()
        elif self.as_view and _aliases(g, slot):
            self.params[i].grad = slot.clone()   # the slot already holds the values
        elif g.layout != torch.strided:
            raise NotImplementedError(f"DistributedDataParallel: expected dense gradients, got a "
                                      f"{g.layout} gradient for parameter {i}")
        else:
            slot.copy_(g)

    def reset_iteration(self) -> None:
        for b in self.buckets:
            b.reset()


_STRIDED = torch.strided


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of {value.numel()} elements"
    return type(value).__name__
