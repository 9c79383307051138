"""Gradient bucket planning: which parameters share a flat all-reduce buffer (pure, no groups).

DDP packs gradients into a few large flat buffers so that each all-reduce moves many bytes
at once, and launches a bucket's all-reduce as soon as its last gradient is ready.  The plan
only needs each parameter's size and dtype and the order in which gradients are expected to
become ready:

- before the first iteration that order is the reverse of registration order (backward
  visits the last layers first);
- after it, the order actually observed (rank 0's, so every rank agrees) -- see
  :func:`complete_order`.

Buckets hold one dtype each (a flat buffer has one dtype); every dtype has its own open
bucket, which closes once it holds at least the cap.  The first bucket of each dtype gets a
small cap (1 MiB, as torch's DDP does) so that the first all-reduce starts early in backward.

[Note: solo buckets]
A parameter of at least ``solo_bytes`` (default: the first bucket's cap, 1 MiB) gets a bucket of
its own, and a one-parameter bucket is all-reduced *in place on the gradient tensor* (see
``_bucket_state.py``): packing it would cost a copy into the bucket and one back, a full pass over
memory each, which on one host costs about as much as the all-reduce itself, while an extra
collective on shared memory costs tens of microseconds.  Only gradients smaller than that are
packed, where packing is what saves time.

Example::

    >>> plan = plan_buckets([10, 20, 30], [torch.float32] * 3, [2, 1, 0],
    ...                     cap_bytes=100, first_cap_bytes=100)
    >>> [b.indices for b in plan]        # 30 floats = 120 bytes >= 100: a solo bucket
    [(2,), (1, 0)]
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

__all__ = [
    "DEFAULT_BUCKET_CAP_MB",
    "FIRST_BUCKET_BYTES",
    "BucketPlan",
    "cap_bytes_from_mb",
    "complete_order",
    "default_order",
    "plan_buckets",
]

DEFAULT_BUCKET_CAP_MB = 25
# torch's DDP starts with a 1 MiB bucket (dist._DEFAULT_FIRST_BUCKET_BYTES) so that communication
# begins after the first few gradients instead of after 25 MiB of them.
FIRST_BUCKET_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class BucketPlan:
    """One bucket: parameter ``indices`` (in ready order) packed at ``offsets`` of a flat buffer.

    ``offsets[k]`` is the element offset of parameter ``indices[k]``; ``numel`` the buffer's
    length; ``dtype`` the buffer's (and every member's) dtype.
    """

    dtype: torch.dtype
    indices: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int

    @property
    def solo(self) -> bool:
        """One parameter: reduced in place on its gradient (see [Note: solo buckets])."""
        return len(self.indices) == 1

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"BucketPlan({dtype}, params {list(self.indices)}, {self.nbytes} B)"


def cap_bytes_from_mb(bucket_cap_mb: float | None) -> int:
    """``bucket_cap_mb`` (MiB, None = 25) as bytes; raises ``ValueError`` for a negative cap."""
    mb = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
    if not isinstance(mb, (int, float)) or mb < 0:
        raise ValueError("DistributedDataParallel: expected bucket_cap_mb >= 0 "
                         f"(MiB), got {bucket_cap_mb!r}")
    return int(mb * (1 << 20))


def default_order(num_params: int) -> list[int]:
    """The ready order assumed before anything was observed: reverse registration order."""
    return list(range(num_params - 1, -1, -1))


def complete_order(observed: Sequence[int], num_params: int) -> list[int]:
    """``observed`` followed by the parameters it lacks, in default (reverse) order.

    Parameters missing from an observed order got no gradient in that iteration (unused); they
    go last.  Raises ``ValueError`` for an index out of range or listed twice.
    """
    seen = set()
    for i in observed:
        if not 0 <= i < num_params:
            raise ValueError("bucket order: expected parameter indices in "
                             f"[0, {num_params}), got {i}")
        if i in seen:
            raise ValueError(f"bucket order: expected each parameter once, got {i} twice")
        seen.add(i)
    return list(observed) + [i for i in default_order(num_params) if i not in seen]


def plan_buckets(numels: Sequence[int], dtypes: Sequence[torch.dtype], order: Sequence[int],
                 cap_bytes: int, first_cap_bytes: int = FIRST_BUCKET_BYTES,
                 solo_bytes: int | None = None,
                 caps: Sequence[int] | None = None) -> list[BucketPlan]:
    """Assign parameters to buckets.

    Args:
        numels: elements of each parameter (by registration index).
        dtypes: dtype of each parameter.
        order: every parameter index once, in the order gradients are expected to be ready.
        cap_bytes: a bucket closes as soon as it holds at least this many bytes (0 = one
            bucket per parameter).
        first_cap_bytes: the cap of each dtype's first bucket (``min`` with ``cap_bytes``).
        solo_bytes: a parameter of at least this many bytes gets a bucket of its own (the open
            bucket of its dtype is closed first, so buckets stay in ready order).  Default:
            ``min(cap_bytes, first_cap_bytes)`` (with ``caps``: their largest, at most
            ``first_cap_bytes``).  See
            [Note: solo buckets].
        caps: per-bucket caps (DDP's ``bucket_cap_mb_list``): the ``k``-th bucket of a dtype
            closes at ``caps[min(k, len(caps) - 1)]``; replaces ``cap_bytes``/``first_cap_bytes``.

    Returns:
        Buckets sorted by the position of their first parameter in ``order``: the order in
        which they become ready and are all-reduced.

    Raises:
        ValueError: ``order`` is not a permutation of the parameter indices, or the lists
            differ in length.
    """
    n = len(numels)
    if len(dtypes) != n:
        raise ValueError(f"plan_buckets: expected one dtype per parameter ({n}), got {len(dtypes)}")
    if sorted(order) != list(range(n)):
        raise ValueError("plan_buckets: expected order to be a permutation of "
                         f"range({n}), got {list(order)}")
    if caps is not None and (not caps or min(caps) < 0):
        raise ValueError("plan_buckets: caps: expected a non-empty list of "
                         f"sizes >= 0, got {list(caps)}")
    solo = (min(max(caps), first_cap_bytes) if caps else min(cap_bytes, first_cap_bytes)) \
        if solo_bytes is None else solo_bytes
    position = {i: k for k, i in enumerate(order)}
    open_: dict[torch.dtype, list[int]] = {}
    open_bytes: dict[torch.dtype, int] = {}
    closed: dict[torch.dtype, int] = {}
    done: list[list[int]] = []

    def close(dt: torch.dtype) -> None:
        if open_.get(dt):
            done.append(open_.pop(dt))
            closed[dt] = closed.get(dt, 0) + 1
        open_bytes[dt] = 0

    for i in order:
        dt = dtypes[i]
        nbytes = numels[i] * dt.itemsize
        if nbytes >= solo:
            close(dt)
            open_[dt] = [i]
            close(dt)
            continue
        open_.setdefault(dt, []).append(i)
        open_bytes[dt] = open_bytes.get(dt, 0) + nbytes
        k = closed.get(dt, 0)
        if caps:
            limit = caps[min(k, len(caps) - 1)]
        else:
            limit = min(first_cap_bytes, cap_bytes) if k == 0 else cap_bytes
        if open_bytes[dt] >= limit:
            close(dt)
    done.extend(m for m in open_.values() if m)
    done.sort(key=lambda m: position[m[0]])
    return [_layout(m, numels, dtypes[m[0]]) for m in done]


def _layout(members: list[int], numels: Sequence[int], dtype: torch.dtype) -> BucketPlan:
    offsets, off = [], 0
    for i in members:
        offsets.append(off)
        off += numels[i]
    return BucketPlan(dtype, tuple(members), tuple(offsets), off)
