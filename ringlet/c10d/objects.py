"""Object collectives: pickled Python objects over the tensor collectives.

[Note: object codec]
Every payload starts with a 4-byte header naming its format, checked before anything is
decoded; sizes are exchanged and capped (``MAX_OBJECT_BYTES``) before anything is allocated.

* Default mode (as torch): the payload is a pickle (``RLO1``) and is unpickled.  Unpickling runs
  whatever callables the bytes name, so this mode trusts every peer of the job -- which is who can
  send: shm peers are processes of the same user, tcp peers passed the handshake keyed by the run
  token or the host secret (docs/security.md).
* Restricted mode (``RINGLET_SAFE_OBJECTS=1`` on every rank): the sender writes the object with
  ``torch.save`` (``RLS1``: a zip archive) and the receiver reads it only with
  ``torch.load(weights_only=True)``, torch's maintained unpickler that can build nothing but plain
  data -- containers, numbers, strings, bytes, tensors, dtypes, devices -- plus whatever the user
  allowed with ``torch.serialization.add_safe_globals``.  There is no allowlist of callables kept
  here: a list entry that unpickles again (``torch.storage._load_from_bytes`` calls
  ``torch.load(weights_only=False)``) would reopen everything.  A plain pickle, a non-zip payload
  or anything the restricted unpickler refuses is an error naming the rank and the refused
  callable or opcode; there is no fallback to an unrestricted decoder.  Compressed archives and
  sparse tensors whose indices break their invariants are refused too ([Note: restricted decode]
  in ``ringlet/c10d/_restricted.py``).

A rank whose object cannot be encoded sends a "failed" marker so that its peers raise at once
instead of waiting.
"""

from __future__ import annotations

import io
import pickle
from typing import TYPE_CHECKING, Any

import torch

from ringlet import _env
from ringlet.c10d import _call, _restricted, p2p
from ringlet.c10d import collectives as C

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = [
    "MAX_OBJECT_BYTES",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]

MAGIC = b"RLO1"          # a pickle: default (trusting) mode
SAFE_MAGIC = b"RLS1"     # a torch.save archive: decodable by the restricted unpickler
MAX_OBJECT_BYTES = 1 << 31     # a peer claiming more is refused before allocating
_FAILED = -1
_BAD_LIST = -2      # broadcast_object_list: the source's object_list is not a list


def _encode(obj: Any) -> bytes | None:
    """The payload for ``obj`` in this rank's mode, or None when it cannot be encoded."""
    try:
        return _encode_or_raise(obj)
    except Exception:  # noqa: BLE001 - reported to the peers as a failure marker
        return None


def _encode_or_raise(obj: Any) -> bytes:
    if _env.safe_objects():
        buf = io.BytesIO()
        torch.save(obj, buf)
        return SAFE_MAGIC + buf.getvalue()
    return MAGIC + pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def _decode(data: bytes, rank: int, op: str) -> Any:
    head, body = data[:4], data[4:]
    if head not in (MAGIC, SAFE_MAGIC):
        raise ValueError(f"{op}: the object from rank {rank} has an unknown header {head!r} "
                         f"(expected {MAGIC!r} or {SAFE_MAGIC!r}: a different ringlet version?)")
    if _env.safe_objects():
        if head != SAFE_MAGIC:
            raise _restricted.refused(rank, op, _restricted.with_names(
            "it is a plain pickle (set RINGLET_SAFE_OBJECTS=1 on every rank, so that every "
            "sender writes the restricted format)", body))
        return _restricted.decode(body, rank, op, MAX_OBJECT_BYTES)
    if head == SAFE_MAGIC:      # a restricted-mode sender; this rank trusts its peers
        return torch.load(io.BytesIO(body), weights_only=False, mmap=False)
    return pickle.loads(body)


def _size_check(size: int, rank: int, op: str) -> None:
    if size == _FAILED:
        raise RuntimeError(f"{op}: rank {rank} failed to serialize its "
                           "object (see that rank's error)")
    if not 0 <= size <= MAX_OBJECT_BYTES:
        raise ValueError(f"{op}: rank {rank} announced an object of {size} bytes; the limit is "
                         f"{MAX_OBJECT_BYTES} (refused before allocating)")


def _raise_own(obj: Any, op: str) -> None:
    _encode_or_raise(obj)   # re-raises the real error locally
    raise AssertionError(f"{op}: object failed to encode once but not twice")


def _as_tensor(data: bytes | None, size: int) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if data:
        t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _exchange_sizes(pg: ProcessGroup, obj: Any, data: bytes | None, op: str) -> list[int]:
    """Every rank's payload size (or the failure marker), checked before anything is allocated;
    this rank re-raises its own pickling error after the exchange, so peers never wait for it."""
    sizes = torch.zeros(pg.size(), dtype=torch.int64)
    C.all_gather_into_tensor(sizes, torch.tensor([len(data) if data is not None else _FAILED]),
                             group=pg)
    out = sizes.tolist()
    if data is None:
        _raise_own(obj, op)
    for r, s in enumerate(out):
        _size_check(s, r, op)
    return out


def all_gather_object(object_list: list[Any], obj: Any, group: GroupArg = None) -> None:
    """Fill ``object_list`` (length = group size) with every rank's ``obj``."""
    pg = _call.resolve(group, "all_gather_object")
    if pg is None:
        return
    n = pg.size()
    if len(object_list) != n:
        raise ValueError(f"all_gather_object: object_list: expected {n} "
                         f"entries, got {len(object_list)}")
    data = _encode(obj)
    sizes = _exchange_sizes(pg, obj, data, "all_gather_object")
    width = max(sizes)
    out = torch.empty(n * width, dtype=torch.uint8)
    C.all_gather_into_tensor(out, _as_tensor(data, width), group=pg)
    for r, s in enumerate(sizes):
        object_list[r] = _decode(out[r * width:r * width + s].numpy().tobytes(), pg.ranks[r],
                                 "all_gather_object")


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: GroupArg = None, group_dst: int | None = None) -> None:
    """On ``dst``, fill ``object_gather_list`` with every rank's ``obj``."""
    pg = _call.resolve(group, "gather_object")
    if pg is None:
        return
    root = C.peer_rank(pg, dst, group_dst, "gather", "dst")
    n = pg.size()
    if pg.rank() == root and (object_gather_list is None or len(object_gather_list) != n):
        raise ValueError(f"gather_object: object_gather_list: expected a list of {n} "
                         "entries on the destination")
    # Sizes go to every rank so that a serialization failure is reported everywhere.
    data = _encode(obj)
    sizes = _exchange_sizes(pg, obj, data, "gather_object")
    width = max(sizes)
    is_root = pg.rank() == root
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)] if is_root else None
    C.gather(_as_tensor(data, width), outs, group=pg, group_dst=root)
    if outs is not None and object_gather_list is not None:
        for r, s in enumerate(sizes):
            object_gather_list[r] = _decode(outs[r][:s].numpy().tobytes(), pg.ranks[r],
                                            "gather_object")


def _not_a_list(object_list: Any) -> str:
    return ("broadcast_object_list: object_list: expected a list of objects, got "
            f"{type(object_list).__name__}")


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: GroupArg = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank with ``src``'s."""
    pg = _call.resolve(group, "broadcast_object_list")
    if pg is None:
        return
    root = C.peer_rank(pg, src, group_src, "broadcast", "src")
    me = pg.rank() == root
    # A bad object_list is reported after the size broadcast, which every rank takes part in:
    # the source sends a marker instead of a size, so no rank waits and the group stays in step.
    bad = None if isinstance(object_list, list) else _not_a_list(object_list)
    data = (_encode(list(object_list)) if bad is None else None) if me else b""
    marker = _BAD_LIST if bad is not None else _FAILED
    size = torch.tensor([(len(data) if data is not None else marker) if me else 0],
                        dtype=torch.int64)
    C.broadcast(size, group=pg, group_src=root)
    if me and bad is not None:
        raise TypeError(bad)
    if me and data is None:
        _raise_own(list(object_list), "broadcast_object_list")
    if int(size) == _BAD_LIST:
        raise TypeError(f"broadcast_object_list: the source rank {pg.ranks[root]} passed an "
                        "object_list that is not a list (see that rank's error); nothing was "
                        "broadcast")
    _size_check(int(size), pg.ranks[root], "broadcast_object_list")
    buf = _as_tensor(data if me else None, int(size))
    C.broadcast(buf, group=pg, group_src=root)
    if not me and bad is not None:
        raise TypeError(bad)
    if not me:
        got = _decode(buf.numpy().tobytes(), pg.ranks[root], "broadcast_object_list")
        if len(got) != len(object_list):
            raise ValueError(f"broadcast_object_list: object_list: rank {pg.ranks[root]} sent "
                             f"{len(got)} objects, this rank's list has {len(object_list)} entries")
        object_list[:] = got


def scatter_object_list(scatter_object_output_list: list[Any],
                        scatter_object_input_list: list[Any] | None = None, src: int | None = None,
                        group: GroupArg = None,
                        group_src: int | None = None) -> None:
    """Rank ``r`` receives ``scatter_object_input_list[r]`` of ``src`` in
    ``scatter_object_output_list[0]``."""
    pg = _call.resolve(group, "scatter_object_list")
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("Expected argument scatter_object_output_list to be a list of size at "
                         "least 1. (scatter_object_list: scatter_object_output_list: expected a "
                         f"list of at least 1 entry, got {scatter_object_output_list!r})")
    root = C.peer_rank(pg, src, group_src, "scatter", "src")
    n = pg.size()
    me = pg.rank() == root
    datas: list[bytes | None] = []
    if me:
        if scatter_object_input_list is None or len(scatter_object_input_list) != n:
            raise ValueError("scatter_object_list: scatter_object_input_list: expected "
                             f"{n} objects on the source")
        datas = [_encode(o) for o in scatter_object_input_list]
    sizes = torch.tensor([len(d) if d is not None else _FAILED for d in datas] if me else [0] * n,
                         dtype=torch.int64)
    C.broadcast(sizes, group=pg, group_src=root)
    if me and any(d is None for d in datas):
        _raise_own(scatter_object_input_list, "scatter_object_list")
    for s in sizes.tolist():
        _size_check(s, pg.ranks[root], "scatter_object_list")
    width = max(sizes.tolist())
    out = torch.empty(width, dtype=torch.uint8)
    C.scatter(out, [_as_tensor(d, width) for d in datas] if me else None, group=pg, group_src=root)
    mine = int(sizes[pg.rank()])
    scatter_object_output_list[0] = _decode(out[:mine].numpy().tobytes(), pg.ranks[root],
                                            "scatter_object_list")


def send_object_list(object_list: list[Any], dst: int | None = None, group: GroupArg = None,
                     device: Any = None, group_dst: int | None = None,
                     use_batch: bool = False) -> None:
    """Send the objects of ``object_list`` to ``dst`` (pairs with :func:`recv_object_list`);
    ``use_batch=True`` sends through ``batch_isend_irecv``, as torch's does."""
    data = _encode(list(object_list))
    size = len(data) if data is not None else _FAILED
    p2p.send_one(torch.tensor([size], dtype=torch.int64), dst, group, group_dst, use_batch)
    if data is None:
        _raise_own(list(object_list), "send_object_list")
    p2p.send_one(_as_tensor(data, size), dst, group, group_dst, use_batch)


def recv_object_list(object_list: list[Any], src: int | None = None, group: GroupArg = None,
                     device: Any = None, group_src: int | None = None,
                     use_batch: bool = False) -> int:
    """Receive objects into ``object_list``; returns the sender's global rank (``use_batch``: as
    :func:`send_object_list`)."""
    size = torch.zeros(1, dtype=torch.int64)
    sender = p2p.recv_one(size, src, group, group_src, use_batch)
    _size_check(int(size), sender, "recv_object_list")
    buf = torch.empty(int(size), dtype=torch.uint8)
    p2p.recv_one(buf, sender, group, None, use_batch)
    got = _decode(buf.numpy().tobytes(), sender, "recv_object_list")
    object_list[:len(got)] = got
    return sender
