"""``comm_buffer``: tensors in a group's shared memory that collectives use without copies.

On the ``shm`` transport (and ``auto`` on one host, and ``inproc``) a group has a buffer heap in
its shared memory (see ``ringlet/transport/arena_buffers.py``).  A tensor allocated there is read
by the peers in place: ``all_reduce`` on it, ``all_gather_into_tensor`` into it (or from it) and
``reduce_scatter_tensor`` from it move no bytes through the transport's own staging slots, which
roughly halves the memory traffic of a large all-reduce.  Transports without such memory hand
back an ordinary tensor, so code that asks for buffers runs everywhere.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import _call, checks
from ringlet.errors import DistBackendError

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = ["comm_buffer", "is_comm_buffer"]


def _shape(shape: Any) -> tuple[int, ...]:
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    if not isinstance(shape, (Sequence, torch.Size)) or not all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise checks.fail(TypeError, "comm_buffer", "shape",
                          f"expected an int or a sequence of ints >= 0, got {shape!r}")
    return tuple(shape)


def comm_buffer(shape: Any, dtype: torch.dtype = torch.float32,
                group: GroupArg = None) -> torch.Tensor:
    """An uninitialised tensor that ``group``'s collectives read and write in place.

    On shared-memory groups the tensor lives in the group's buffer heap: peers read it where it
    is, so a collective on it copies nothing into or out of the transport (large ``all_reduce``
    moves about half the bytes).  Elsewhere (tcp, several hosts, torch's engines, a rank outside
    ``group``, or a heap that is full or disabled with ``RINGLET_SHM_BUFFER_BYTES=0``) it is an
    ordinary ``torch.empty`` tensor.  Either way every collective accepts it, together with
    ordinary tensors on other ranks.

    Lifetime: the memory returns to the group's heap when the tensor and every view of it are
    gone.  It stays valid memory after the group is destroyed (the mapping lives as long as a
    view does), but collectives then treat it as an ordinary tensor.  As with any tensor handed
    to an asynchronous collective, do not write it before the ``Work`` completes.

    Args:
        shape: the tensor's shape (an int or a sequence of ints).
        dtype: its dtype (default ``torch.float32``).
        group: the process group whose collectives will use it (default: the world).

    Returns:
        A contiguous CPU tensor of ``shape`` and ``dtype``.

    Raises:
        TypeError: a bad ``shape`` or ``dtype``.
        DistBackendError: the shared memory cannot be committed (``/dev/shm`` is full).

    Example::

        buf = dist.comm_buffer((1024, 1024))
        buf.copy_(grads)
        dist.all_reduce(buf)          # no copy into or out of the arena
    """
    dims = _shape(shape)
    if not isinstance(dtype, torch.dtype):
        raise checks.fail(TypeError, "comm_buffer", "dtype",
                          f"expected a torch.dtype, got {dtype!r}")
    pg = _call.resolve(group, "comm_buffer", quiet=True)
    numel = 1
    for d in dims:
        numel *= d
    nbytes = numel * dtype.itemsize
    raw = None
    if pg is not None and nbytes:
        pg.check_usable()
        raw = _allocate(pg, nbytes)
    if raw is None:
        return torch.empty(dims, dtype=dtype)
    return raw.view(dtype).view(dims)


def _allocate(pg: ProcessGroup, nbytes: int) -> torch.Tensor | None:
    try:
        return pg.transport.buffer(nbytes)
    except OSError as e:
        raise DistBackendError(f"[rank {pg.rank()}] comm_buffer: cannot commit {nbytes} bytes of "
                               f"shared memory for {pg!r}: {e.strerror} (enlarge /dev/shm, or set "
                               "RINGLET_SHM_BUFFER_BYTES=0 for ordinary tensors)") from None


def is_comm_buffer(tensor: torch.Tensor, group: GroupArg = None) -> bool:
    """Whether ``tensor``'s bytes lie in this rank's buffer heap of ``group`` (see
    :func:`comm_buffer`), i.e. whether its collectives on that group run in place."""
    pg = _call.resolve(group, "is_comm_buffer", quiet=True)
    heap = getattr(pg.transport, "heap", None) if pg is not None else None
    return heap is not None and heap.offset_of(tensor) >= 0
