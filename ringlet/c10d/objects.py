"""Object collectives: pickled Python objects over the tensor collectives.

Security (RELIABILITY.md, "Security"): objects are unpickled only from peers of
the same job (shm peers are same-user by construction; network peers must pass
the run-token handshake); every payload carries a small header (magic, format
version, length) checked before anything is allocated; ``RINGLET_SAFE_OBJECTS=1``
switches to a restricted unpickler that accepts only builtins, containers,
tensors and numpy arrays.  A rank whose object cannot be pickled sends a
"failed" marker so that its peers raise at once instead of waiting.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch

from ringlet import _env
from ringlet.c10d import collectives as C
from ringlet.c10d import p2p
from ringlet.c10d.world import resolve_group

__all__ = [
    "MAX_OBJECT_BYTES",
    "all_gather_object",
    "broadcast_object_list",
    "gather_object",
    "recv_object_list",
    "scatter_object_list",
    "send_object_list",
]

MAGIC = b"RLO1"
MAX_OBJECT_BYTES = 1 << 31     # a peer claiming more is refused before allocation
_FAILED = -1

_SAFE_MODULES = {
    "builtins": {"list", "dict", "set", "frozenset", "tuple", "int", "float", "complex", "bool", "str",
                 "bytes", "bytearray", "slice", "range", "NoneType", "object"},
    "collections": {"OrderedDict", "defaultdict", "deque", "Counter"},
    "datetime": {"datetime", "date", "time", "timedelta", "timezone"},
    "torch._utils": {"_rebuild_tensor_v2", "_rebuild_tensor", "_rebuild_parameter"},
    "torch": {"Size", "float32", "float64", "float16", "bfloat16", "int64", "int32", "int16", "int8",
              "uint8", "bool", "complex64", "complex128", "FloatStorage", "DoubleStorage", "LongStorage",
              "IntStorage", "HalfStorage", "BFloat16Storage", "ByteStorage", "BoolStorage"},
    "torch.storage": {"_load_from_bytes"},
    "numpy": {"ndarray", "dtype"},
    "numpy.core.multiarray": {"_reconstruct", "scalar"},
    "numpy._core.multiarray": {"_reconstruct", "scalar"},
    "numpy.dtypes": {"Float64DType", "Float32DType", "Int64DType", "Int32DType", "BoolDType"},
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if name in _SAFE_MODULES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"RINGLET_SAFE_OBJECTS=1 refuses {module}.{name} in a received object")


def _encode(obj: Any) -> bytes | None:
    try:
        body = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # noqa: BLE001 - reported to the peers as a failure marker
        return None
    return MAGIC + body


def _decode(data: bytes, rank: int, op: str) -> Any:
    if data[:4] != MAGIC:
        raise ValueError(f"{op}: the object from rank {rank} has an unknown header {data[:4]!r} (expected "
                         f"{MAGIC!r}: a different ringlet version?)")
    body = io.BytesIO(data[4:])
    if _env.safe_objects():
        return _SafeUnpickler(body).load()
    return pickle.load(body)


def _size_check(size: int, rank: int, op: str) -> None:
    if size == _FAILED:
        raise RuntimeError(f"{op}: rank {rank} failed to serialize its object (see that rank's error)")
    if not 0 <= size <= MAX_OBJECT_BYTES:
        raise ValueError(f"{op}: rank {rank} announced an object of {size} bytes; the limit is "
                         f"{MAX_OBJECT_BYTES} (refused before allocating)")


def _raise_own(obj: Any, op: str) -> None:
    pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)   # re-raises the real error locally
    raise AssertionError(f"{op}: object failed to pickle once but not twice")


def _as_tensor(data: bytes | None, size: int) -> torch.Tensor:
    t = torch.zeros(size, dtype=torch.uint8)
    if data:
        t[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return t


def _exchange_sizes(pg: Any, obj: Any, data: bytes | None, op: str) -> list[int]:
    """Every rank's payload size (or the failure marker), checked before anything is allocated;
    this rank re-raises its own pickling error after the exchange, so peers never wait for it."""
    sizes = torch.zeros(pg.size(), dtype=torch.int64)
    C.all_gather_into_tensor(sizes, torch.tensor([len(data) if data is not None else _FAILED]), group=pg)
    out = sizes.tolist()
    if data is None:
        _raise_own(obj, op)
    for r, s in enumerate(out):
        _size_check(s, r, op)
    return out


def all_gather_object(object_list: list[Any], obj: Any, group: Any = None) -> None:
    """Fill ``object_list`` (length = group size) with every rank's ``obj``."""
    pg = resolve_group(group)
    if pg is None:
        return
    n = pg.size()
    if len(object_list) != n:
        raise ValueError(f"all_gather_object: object_list: expected {n} entries, got {len(object_list)}")
    data = _encode(obj)
    sizes = _exchange_sizes(pg, obj, data, "all_gather_object")
    width = max(sizes)
    out = torch.empty(n * width, dtype=torch.uint8)
    C.all_gather_into_tensor(out, _as_tensor(data, width), group=pg)
    for r, s in enumerate(sizes):
        object_list[r] = _decode(out[r * width:r * width + s].numpy().tobytes(), pg.ranks[r], "all_gather_object")


def gather_object(obj: Any, object_gather_list: list[Any] | None = None, dst: int | None = None,
                  group: Any = None, group_dst: int | None = None) -> None:
    """On ``dst``, fill ``object_gather_list`` with every rank's ``obj``."""
    pg = resolve_group(group)
    if pg is None:
        return
    root = C.peer_rank(pg, dst, group_dst, "gather", "dst")
    n = pg.size()
    if pg.rank() == root and (object_gather_list is None or len(object_gather_list) != n):
        raise ValueError(f"gather_object: object_gather_list: expected a list of {n} entries on the destination")
    # Sizes go to every rank so that a serialization failure is reported everywhere.
    data = _encode(obj)
    sizes = _exchange_sizes(pg, obj, data, "gather_object")
    width = max(sizes)
    is_root = pg.rank() == root
    outs = [torch.empty(width, dtype=torch.uint8) for _ in range(n)] if is_root else None
    C.gather(_as_tensor(data, width), outs, group=pg, group_dst=root)
    if outs is not None and object_gather_list is not None:
        for r, s in enumerate(sizes):
            object_gather_list[r] = _decode(outs[r][:s].numpy().tobytes(), pg.ranks[r], "gather_object")


def broadcast_object_list(object_list: list[Any], src: int | None = None, group: Any = None,
                          device: Any = None, group_src: int | None = None) -> None:
    """Replace ``object_list``'s entries on every rank with ``src``'s."""
    pg = resolve_group(group)
    if pg is None:
        return
    root = C.peer_rank(pg, src, group_src, "broadcast", "src")
    me = pg.rank() == root
    data = _encode(list(object_list)) if me else b""
    size = torch.tensor([(len(data) if data is not None else _FAILED) if me else 0], dtype=torch.int64)
    C.broadcast(size, group=pg, group_src=root)
    if me and data is None:
        _raise_own(list(object_list), "broadcast_object_list")
    _size_check(int(size), pg.ranks[root], "broadcast_object_list")
    buf = _as_tensor(data if me else None, int(size))
    C.broadcast(buf, group=pg, group_src=root)
    if not me:
        got = _decode(buf.numpy().tobytes(), pg.ranks[root], "broadcast_object_list")
        if len(got) != len(object_list):
            raise ValueError(f"broadcast_object_list: object_list: rank {pg.ranks[root]} sent {len(got)} "
                             f"objects, this rank's list has {len(object_list)} entries")
        object_list[:] = got


def scatter_object_list(scatter_object_output_list: list[Any], scatter_object_input_list: list[Any] | None = None,
                        src: int | None = None, group: Any = None, group_src: int | None = None) -> None:
    """Rank ``r`` receives ``scatter_object_input_list[r]`` of ``src`` in ``scatter_object_output_list[0]``."""
    pg = resolve_group(group)
    if pg is None:
        return
    if not isinstance(scatter_object_output_list, list) or len(scatter_object_output_list) < 1:
        raise ValueError("scatter_object_list: scatter_object_output_list: expected a list of at least 1 entry")
    root = C.peer_rank(pg, src, group_src, "scatter", "src")
    n = pg.size()
    me = pg.rank() == root
    datas: list[bytes | None] = []
    if me:
        if scatter_object_input_list is None or len(scatter_object_input_list) != n:
            raise ValueError(f"scatter_object_list: scatter_object_input_list: expected {n} objects on the source")
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
    scatter_object_output_list[0] = _decode(out[:mine].numpy().tobytes(), pg.ranks[root], "scatter_object_list")


def send_object_list(object_list: list[Any], dst: int | None = None, group: Any = None, device: Any = None,
                     group_dst: int | None = None) -> None:
    """Send the objects of ``object_list`` to ``dst`` (pairs with :func:`recv_object_list`)."""
    data = _encode(list(object_list))
    size = len(data) if data is not None else _FAILED
    p2p.send(torch.tensor([size], dtype=torch.int64), dst, group, group_dst=group_dst)
    if data is None:
        _raise_own(list(object_list), "send_object_list")
    p2p.send(_as_tensor(data, size), dst, group, group_dst=group_dst)


def recv_object_list(object_list: list[Any], src: int | None = None, group: Any = None, device: Any = None,
                     group_src: int | None = None) -> int:
    """Receive objects into ``object_list``; returns the sender's global rank."""
    size = torch.zeros(1, dtype=torch.int64)
    sender = p2p.recv(size, src, group, group_src=group_src)
    _size_check(int(size), sender, "recv_object_list")
    buf = torch.empty(int(size), dtype=torch.uint8)
    p2p.recv(buf, sender, group)
    got = _decode(buf.numpy().tobytes(), sender, "recv_object_list")
    object_list[:len(got)] = got
    return sender
