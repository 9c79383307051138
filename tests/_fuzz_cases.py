"""The fuzz engine shared by tests/test_fuzz.py (short, CI) and scripts/fuzz.py (long, by hand).

A *case* is a small dict drawn by hypothesis (:func:`cases`): a public API of
``ringlet.distributed``, an argument *slot* of it, the *kind* of tensor put there (odd but
valid: strided, transposed, offset, 0-d, 0-element, conjugate, Parameter, numpy- or
bytearray-backed, expanded or read-only inputs; or bad: DTensor, wrapper subclass, meta,
sparse, quantized, nested, mkldnn, freed storage, unsupported dtype, not a tensor, expanded
/ overlapping / read-only outputs), a dtype, a shape, a reduce op, a root, and optionally a
bad non-tensor argument (*fault*: rank, op, group, list length, dtype mix, numel, split
sizes, tag, timeout, device_ids).

Every rank of a world of 2 runs the same cases (:func:`run_cases`; threads or processes)
and checks, per case:

- *no hang*: the call returns or raises within ``DEADLINE`` seconds;
- *the right verdict*: a bad argument is refused (TypeError/ValueError, or DistBackendError
  for a destroyed group) before the group's sequence number moves -- nothing was sent -- and
  the user's tensors are untouched; a valid call is not refused;
- *no silently wrong value*: a valid call's results equal a local computation over every
  rank's inputs (each rank can build every rank's inputs: they are a function of the case);
- *the group stays usable*: an all_reduce after the case is correct on every rank.

A crash ends the rank's process: the parent sees the exit code, and the progress file
(``progress`` argument) names the case that was running.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import warnings
from datetime import timedelta
from typing import Any

import torch
from hypothesis import strategies as st

N = 2
DEADLINE = 8.0          # seconds a call may take (the op deadline in these worlds is 5 s)
DTYPES = ["bool", "uint8", "int8", "int32", "int64", "float16", "bfloat16", "float32", "float64",
          "complex64"]
SHAPES = [(), (0,), (1,), (3,), (2, 3), (3, 0), (4, 2), (2, 1, 2, 2)]
GOOD = ["contig", "T", "strided", "offset", "param", "numpy", "bytearray", "channels_last", "conj",
        "neg"]
READ_ONLY_OK = ["expand", "overlap", "ro_bytes", "ro_mmap"]     # valid to read, refused as outputs
BAD = ["meta", "sparse", "quantized", "nested", "mkldnn", "wrapper", "dtensor", "freed", "float8",
       "not_tensor"]
OPS = ["SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "PREMUL_SUM"]

# api -> (slots as (name, role, symmetric), applicable faults).  role: "in" (read), "out"
# (written), "inout".  symmetric=False: only valid kinds may go there (the slot is read on one
# rank and written on another, or only the root looks at it, so a local refusal on one rank
# would leave the other waiting -- as with torch).
APIS: dict[str, tuple[list[tuple[str, str, bool]], list[str]]] = {
    "all_reduce": ([("t", "inout", True)], ["op", "group"]),
    "reduce": ([("t", "inout", True)], ["rank", "op", "group"]),
    "broadcast": ([("t", "inout", True)], ["rank", "group"]),
    "all_gather": ([("out", "out", True), ("t", "in", True)],
                   ["len", "dtype_mix", "numel", "group"]),
    "all_gather_into_tensor": ([("out", "out", True), ("t", "in", True)], ["numel", "dtype_mix"]),
    "_all_gather_base": ([("out", "out", True), ("t", "in", True)], ["numel"]),
    "reduce_scatter": ([("out", "out", True), ("in", "in", True)],
                       ["len", "dtype_mix", "numel", "op"]),
    "reduce_scatter_tensor": ([("out", "out", True), ("in", "in", True)], ["numel", "op", "group"]),
    "_reduce_scatter_base": ([("out", "out", True), ("in", "in", True)], ["numel"]),
    "all_reduce_coalesced": ([("t", "inout", True)], ["len", "op"]),   # mixed dtypes are valid
    "all_gather_coalesced": ([("out", "out", True), ("t", "in", True)],
                             ["len", "numel", "dtype_mix"]),
    "all_to_all": ([("out", "out", True), ("in", "in", True)], ["len", "dtype_mix"]),
    "all_to_all_single": ([("out", "out", True), ("in", "in", True)], ["split", "dtype_mix"]),
    "gather": ([("t", "in", True), ("list", "out", False)], ["rank"]),
    "scatter": ([("t", "out", True), ("list", "in", False)], ["rank"]),
    "send_recv": ([("t", "p2p", True)], ["rank", "tag", "group"]),
    "isend_irecv": ([("t", "p2p", True)], ["rank", "tag"]),
    "batch_isend_irecv": ([("send", "in", True), ("recv", "out", True)], ["rank", "tag", "entry"]),
    "barrier": ([], ["timeout", "device_ids", "group"]),
    "monitored_barrier": ([], ["timeout"]),
    "all_gather_object": ([("obj", "in", False)], ["len"]),
    "broadcast_object_list": ([("obj", "in", False)], ["rank"]),
    "gather_object": ([("obj", "in", False)], ["rank"]),
    "scatter_object_list": ([("obj", "in", False)], ["rank"]),
    "send_recv_object_list": ([("obj", "in", False)], ["rank"]),
    "coalescing_manager": ([("t", "inout", True), ("out", "out", True)], ["op"]),
}
FAULT_VALUES: dict[str, list[Any]] = {
    "rank": [-1, N, True, 1.5, "0"], "op": ["sum", 99, True, "BAND", "MIN", "PREMUL_SUM", "UNUSED"],
    "group": ["world", 7, "destroyed"], "len": [0, 1], "dtype_mix": [0], "numel": [1],
    "split": [[1.5, 0.5], [-1, 3], [1], [True, 1], "ab"], "tag": [True, 1 << 40, "1", -(1 << 33)],
    "entry": [0], "timeout": ["5s", -1, timedelta(seconds=-1)], "device_ids": ["0", [-1], 1.5],
}


# -- hypothesis strategy ------------------------------------------------------------------------
@st.composite
def cases(draw: Any) -> dict[str, Any]:
    api = draw(st.sampled_from(sorted(APIS)))
    slots, faults = APIS[api]
    c: dict[str, Any] = {"api": api, "cid": draw(st.integers(0, 999)),
                         "dtype": draw(st.sampled_from(DTYPES)),
                         "shape": draw(st.sampled_from(SHAPES)),
                         "root": draw(st.integers(0, N - 1)),
                         "kind": "contig", "slot": None, "fault": None, "fval": 0}
    c["op"] = draw(st.sampled_from([o for o in OPS if _op_ok(o, c["dtype"])]))
    if faults and draw(st.integers(0, 4)) == 0:
        c["fault"] = draw(st.sampled_from(faults))
        c["fval"] = draw(st.integers(0, len(FAULT_VALUES[c["fault"]]) - 1))
    elif slots:
        name, role, symmetric = draw(st.sampled_from(slots))
        kinds = list(GOOD)
        if symmetric and role != "p2p" and api != "broadcast":
            kinds += READ_ONLY_OK         # the source of a broadcast, or a sender, may read them
        if symmetric:
            kinds += BAD
        if api in ("all_reduce", "coalescing_manager"):
            kinds.remove("sparse")        # a sparse all_reduce is a valid call (gloo's SUM)
        c["slot"], c["kind"] = name, draw(st.sampled_from(kinds))
    return c


def _op_ok(op: str, dtype: str) -> bool:
    dt = getattr(torch, dtype)
    if op in ("BAND", "BOR", "BXOR"):
        return not (dt.is_floating_point or dt.is_complex)
    if op in ("AVG", "PREMUL_SUM"):
        return dt.is_floating_point or dt.is_complex
    if dt.is_complex:
        return op in ("SUM", "AVG", "PREMUL_SUM")     # as torch: no order, no product on complex
    return True


# -- tensors of each kind
# ---------------------------------------------------------------------------
class _Wrapper(torch.Tensor):
    """A wrapper subclass like DTensor: its storage holds nothing (data_ptr() == 0)."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Any:
        return torch.Tensor._make_wrapper_subclass(cls, inner.shape, dtype=inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        unwrap = lambda x: x.inner if isinstance(x, _Wrapper) else x
        return func(*[unwrap(a) for a in args], **{k: unwrap(v) for k, v in (kwargs or {}).items()})


class Maker:
    """Builds one rank's tensors of one case; keeps read-only mappings alive until ``close``."""

    def __init__(self, rank: int, mesh: Any) -> None:
        self.rank = rank
        self.mesh = mesh
        self.maps: list[mmap.mmap] = []

    def close(self) -> None:
        for m in self.maps:
            try:
                m.close()
            except BufferError:
                pass            # a tensor still views it; the mapping goes with that tensor
        self.maps.clear()

    def build(self, kind: str, values: torch.Tensor) -> Any:
        """A tensor of ``kind`` whose logical values are ``values`` (or derived from them, for
        expand / overlap), or a bad object of that kind."""
        fn = getattr(self, f"_k_{kind}")
        try:
            return fn(values)
        except (RuntimeError, ValueError, TypeError, NotImplementedError):
            return self._fallback(kind, values)

    def _fallback(self, kind: str, values: torch.Tensor) -> Any:
        if kind in BAD:
            return torch.empty(values.shape, dtype=values.dtype, device="meta")   # still bad
        return values.clone()

    def _k_contig(self, v: torch.Tensor) -> torch.Tensor:
        return v.clone()

    def _k_T(self, v: torch.Tensor) -> torch.Tensor:
        return v.transpose(-1, -2).contiguous().transpose(-1, -2) if v.dim() >= 2 else v.clone()

    def _k_strided(self, v: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(*v.shape, 2, dtype=v.dtype)[..., 1]
        x.copy_(v)
        return x

    def _k_offset(self, v: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(v.numel() + 3, dtype=v.dtype)[3:].view(v.shape)
        x.copy_(v)
        return x

    def _k_param(self, v: torch.Tensor) -> torch.Tensor:
        return torch.nn.Parameter(v.clone(), requires_grad=v.dtype.is_floating_point)

    def _k_numpy(self, v: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(v.numpy().copy())

    def _k_bytearray(self, v: torch.Tensor) -> torch.Tensor:
        raw = bytearray(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        return torch.frombuffer(raw, dtype=v.dtype).view(v.shape)

    def _k_channels_last(self, v: torch.Tensor) -> torch.Tensor:
        return v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v.clone()

    def _k_conj(self, v: torch.Tensor) -> torch.Tensor:
        return torch.conj_physical(v).conj() if v.is_complex() else v.clone()

    def _k_neg(self, v: torch.Tensor) -> torch.Tensor:
        if v.dtype.is_floating_point or v.is_complex():
            return torch._neg_view(-v)
        return v.clone()

    def _k_expand(self, v: torch.Tensor) -> torch.Tensor:
        if v.numel() == 0:
            return v.clone()
        return v.reshape(-1)[:1].clone().reshape([1] * v.dim()).expand(v.shape)

    def _k_overlap(self, v: torch.Tensor) -> torch.Tensor:
        if v.dim() == 0 or v.numel() == 0:
            return v.clone()
        span = sum(s - 1 for s in v.shape) + 1
        return v.reshape(-1).repeat(2)[:span].clone().as_strided(v.shape, [1] * v.dim())

    def _k_ro_bytes(self, v: torch.Tensor) -> torch.Tensor:
        raw = bytes(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()) + b"\0" * 16
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)      # "the given buffer is not writable"
            return torch.frombuffer(raw, dtype=v.dtype)[:v.numel()].view(v.shape)

    def _k_ro_mmap(self, v: torch.Tensor) -> torch.Tensor:
        mm = read_only_map(v.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                           + b"\0" * 16)
        self.maps.append(mm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.frombuffer(mm, dtype=v.dtype)[:v.numel()].view(v.shape)

    def _k_meta(self, v: torch.Tensor) -> torch.Tensor:
        return torch.empty(v.shape, dtype=v.dtype, device="meta")

    def _k_sparse(self, v: torch.Tensor) -> torch.Tensor:
        return v.to_sparse() if v.dim() else v.reshape(1).to_sparse()

    def _k_quantized(self, v: torch.Tensor) -> torch.Tensor:
        return torch.quantize_per_tensor(v.real.float() if v.is_complex() else v.float(), 0.5, 0,
                                         torch.qint8)

    def _k_nested(self, v: torch.Tensor) -> torch.Tensor:
        flat = v.reshape(-1)
        return torch.nested.nested_tensor([flat, torch.cat([flat, flat])])

    def _k_mkldnn(self, v: torch.Tensor) -> torch.Tensor:
        return v.float().reshape(-1, 1).to_mkldnn()

    def _k_wrapper(self, v: torch.Tensor) -> torch.Tensor:
        return _Wrapper(v.clone())

    def _k_dtensor(self, v: torch.Tensor) -> Any:
        from ringlet.distributed.tensor import DTensor, Replicate

        return DTensor.from_local(v.clone(), self.mesh, [Replicate()], run_check=False)

    def _k_freed(self, v: torch.Tensor) -> torch.Tensor:
        x = v.clone()
        x.untyped_storage().resize_(0)
        return x

    def _k_float8(self, v: torch.Tensor) -> torch.Tensor:
        return torch.zeros(v.shape, dtype=torch.float8_e4m3fn)

    def _k_not_tensor(self, v: torch.Tensor) -> Any:
        return [v.tolist(), v.numpy(), None, 3, "t"][int(v.numel()) % 5]


def read_only_map(data: bytes) -> mmap.mmap:
    """A read-only mapping of a file holding ``data`` (the file is already unlinked)."""
    fd, path = tempfile.mkstemp(prefix="ringlet-ro-")
    try:
        os.write(fd, data)
        return mmap.mmap(fd, len(data), access=mmap.ACCESS_READ)
    finally:
        os.close(fd)
        os.unlink(path)


def refused(kind: str, role: str, x: Any, shape: tuple[int, ...]) -> bool:
    """The contract: whether a tensor of ``kind`` in a slot of ``role`` must be refused."""
    numel = 1
    for s in shape:
        numel *= s
    if kind in BAD:
        return kind != "freed" or numel > 0
    if role not in ("out", "inout") or kind not in READ_ONLY_OK or numel == 0:
        return False
    if kind in ("ro_bytes", "ro_mmap"):
        return True
    if kind == "expand":
        return numel > 1
    offsets = torch.zeros(x.shape, dtype=torch.int64)
    for d, (s, k) in enumerate(zip(x.shape, x.stride())):
        view = [1] * x.dim()
        view[d] = s
        offsets = offsets + (torch.arange(s) * k).reshape(view)
    return int(torch.unique(offsets).numel()) < numel


def logical(x: torch.Tensor) -> torch.Tensor:
    """What a tensor reads as, materialized (conjugate / negative views resolved)."""
    return x.detach().resolve_conj().resolve_neg().contiguous().clone()
