"""The restricted object decoder (``RINGLET_SAFE_OBJECTS=1``): what a receiver checks before and
after ``torch.load(weights_only=True)`` builds a peer's object.

[Note: restricted decode]
``torch.load(weights_only=True)`` refuses every callable outside plain data, but two things it
lets through would still hurt a receiving rank, so this module closes them:

* **Memory.**  A zip record may be DEFLATE-compressed: a few megabytes inflate to gigabytes, past
  the cap that the size exchange put on the *compressed* bytes.  Before anything is decoded the
  archive's central directory is read (no decompression) and refused unless it ends the payload,
  every record is stored uncompressed inside the payload, and the declared sizes sum to at most
  the cap (:func:`check_archive`).  ``torch.save`` never compresses, so honest senders pass.
* **Sparse invariants.**  Sparse tensors (COO, CSR, CSC, BSR, BSC) are rebuilt without checking
  their indices; one whose indices point outside its shape corrupts memory on its first
  ``to_dense()``.  The archive is read inside ``torch.sparse.check_sparse_tensor_invariants()``
  (serialized by a lock: the switch is process-wide, and ranks may be threads of one process),
  and afterwards every tensor reachable from the result -- through containers, dict keys, object
  attributes, a tensor's attributes and its ``.grad`` -- is checked again explicitly
  (:func:`check_tensors`), so that another thread's ``torch.load`` clearing torch's list of
  tensors to validate cannot let one through.  Layouts other than strided and the five sparse
  ones are refused.  Strided, quantized and nested tensors need no extra check: torch checks
  their storage offset, sizes and strides against the storage when it builds them.

Anything refused is a ``pickle.UnpicklingError`` naming the operation, the sender's rank and the
reason; there is no fallback to an unrestricted decoder.
"""

from __future__ import annotations

import _compat_pickle
import io
import pickle
import pickletools
import re
import threading
import zipfile
from typing import Any

import torch

from ringlet.c10d._pickle_scan import amplifier

__all__ = ["check_archive", "check_tensors", "decode", "refused"]

_ZIP = b"PK\x03\x04"
_END = b"PK\x05\x06"      # end of central directory record: 22 bytes when there is no comment
_SPARSE = {torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
           torch.sparse_bsc}
_LOAD_LOCK = threading.Lock()


def refused(rank: int, op: str, why: str) -> pickle.UnpicklingError:
    """The error of a refused object (the caller raises it)."""
    return pickle.UnpicklingError(
        f"{op}: RINGLET_SAFE_OBJECTS=1 refuses the object from rank {rank}: {why} (restricted mode "
        "builds only containers, numbers, strings, bytes, tensors, dtypes and devices; see "
        "docs/security.md)")


def check_archive(body: bytes, cap: int) -> str | None:
    """Why the zip archive ``body`` may not be decoded, or None: read from its central directory
    only (nothing is decompressed)."""
    if len(body) < 22 or body[-22:-18] != _END:
        return ("expected a torch.save archive that ends with its zip directory (no comment), "
                "got other bytes at its end")
    try:
        infos = zipfile.ZipFile(io.BytesIO(body)).infolist()
    except (zipfile.BadZipFile, ValueError, OSError, EOFError) as e:
        return f"expected a readable zip directory, got {e}"
    total = 0
    for info in infos:
        name = f"record {info.filename[:80]!r}"
        if info.compress_type != zipfile.ZIP_STORED:
            return (f"{name} is compressed (zip method {info.compress_type}); restricted mode "
                    "reads only stored records, as torch.save writes them (a compressed record "
                    "could inflate past the size cap)")
        if info.file_size != info.compress_size:
            return (f"{name} declares {info.file_size} bytes but stores {info.compress_size}")
        if info.header_offset + info.compress_size > len(body):
            return f"{name} lies outside the {len(body)}-byte payload"
        total += info.file_size
        if total > cap:
            return f"its records declare more than the {cap}-byte cap"
    return None


def _stored_record(body: bytes, suffix: str) -> bytes:
    """The first stored record whose name ends with ``suffix`` (b"" if none or compressed)."""
    try:
        with zipfile.ZipFile(io.BytesIO(body)) as z:
            for info in z.infolist():
                if info.filename.endswith(suffix):
                    if info.compress_type != zipfile.ZIP_STORED:
                        return b""
                    return z.read(info)
    except Exception:  # noqa: BLE001 - not a readable archive: nothing to name
        return b""
    return b""


def _check_sparse(t: torch.Tensor) -> None:
    """Raise when the sparse tensor ``t`` breaks its layout's invariants."""
    if t.layout is torch.sparse_coo:
        torch._validate_sparse_coo_tensor_args(t._indices(), t._values(), t.size(),
                                               t.is_coalesced(), check_pinning=False)
        return
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        compressed, plain = t.crow_indices(), t.col_indices()
    else:
        compressed, plain = t.ccol_indices(), t.row_indices()
    torch._validate_sparse_compressed_tensor_args(compressed, plain, t.values(), t.size(),
                                                  t.layout, check_pinning=False)


def _tensor_problem(t: torch.Tensor) -> str | None:
    if t.layout in _SPARSE:
        try:
            _check_sparse(t)
        except Exception as e:  # noqa: BLE001 - torch's own words for the broken invariant
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            return (f"a {str(t.layout).removeprefix('torch.')} tensor of shape {list(t.shape)} "
                    f"breaks its invariants ({first})")
        return None
    if t.layout is not torch.strided and not t.is_nested:
        return f"a tensor of layout {t.layout} (expected strided or sparse)"
    return None


_SCALARS = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.dtype,
            torch.device, torch.layout, torch.Size)


def _children(o: Any) -> list[Any]:
    if isinstance(o, dict):
        return [*o.keys(), *o.values()]
    if isinstance(o, list | tuple | set | frozenset):
        return list(o)
    out = list(getattr(o, "__dict__", {}).values())
    for cls in type(o).__mro__:
        slots = getattr(cls, "__slots__", ())
        for slot in (slots,) if isinstance(slots, str) else slots:
            if isinstance(slot, str) and hasattr(o, slot):
                out.append(getattr(o, slot))
    return out


def _storages(t: torch.Tensor) -> list[torch.UntypedStorage]:
    """The memory ``t`` holds (a sparse tensor: its index and value tensors'; meta: none)."""
    if t.device.type == "meta":
        return []
    if t.layout is torch.sparse_coo:
        parts = [t._indices(), t._values()]
    elif t.layout in (torch.sparse_csr, torch.sparse_bsr):
        parts = [t.crow_indices(), t.col_indices(), t.values()]
    elif t.layout in (torch.sparse_csc, torch.sparse_bsc):
        parts = [t.ccol_indices(), t.row_indices(), t.values()]
    else:
        return [t.untyped_storage()]
    return [p.untyped_storage() for p in parts]


def check_tensors(obj: Any, cap: int | None = None) -> str | None:
    """Why ``obj`` (a decoded object) may not be handed to the caller, or None: every tensor it
    reaches is checked (iteratively: a deep nesting cannot exhaust the stack), and together their
    storages may hold at most ``cap`` bytes (legacy constructors such as ``torch.Tensor(n)``
    allocate memory the payload never carried)."""
    seen: set[int] = set()
    held: dict[int, int] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, _SCALARS) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            problem = _tensor_problem(o)
            if problem is not None:
                return problem
            held.update((s.data_ptr(), s.nbytes()) for s in _storages(o))
            stack.append(o.grad)
            stack.extend(getattr(o, "__dict__", {}).values())
            continue
        if isinstance(o, torch.UntypedStorage | torch.storage.TypedStorage):
            s = o if isinstance(o, torch.UntypedStorage) else o.untyped()
            if s.device.type != "meta":
                held[s.data_ptr()] = s.nbytes()
            continue
        stack.extend(_children(o))
    if cap is not None and sum(held.values()) > cap:
        return (f"its tensors hold {sum(held.values())} bytes, above the {cap}-byte cap (memory "
                "the payload did not carry)")
    return None


def _why_refused(err: BaseException) -> str:
    """The useful part of the restricted unpickler's error: the callable or opcode it refused."""
    text = " ".join(ln.strip() for ln in str(err).splitlines() if ln.strip())
    m = re.search(r"(WeightsUnpickler error: |Trying to load )(.*?)(\.? Please use|\.? Check the "
                  r"documentation|$)", text)
    detail = (m.group(2) if m else text).strip()
    op = re.search(r"Unsupported operand (\d+)", detail)
    names = {o.code: o.name for o in pickletools.opcodes}
    if op and chr(int(op.group(1))) in names:
        detail += f" (opcode {names[chr(int(op.group(1)))]})"
    return detail


_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "STRING", "BINSTRING",
               "SHORT_BINSTRING"}


def _py3_name(module: str, name: str) -> str:
    """``module.name`` as Python 3 spells it (protocol 2 pickles use Python 2
    names: ``__builtin__``)."""
    module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
    return f"{_compat_pickle.IMPORT_MAPPING.get(module, module)}.{name}"


def named_callables(pickle_bytes: bytes, limit: int = 8) -> list[str]:
    """The globals a pickle names (GLOBAL, INST, STACK_GLOBAL), found by parsing
    it, never running it."""
    names: list[str] = []
    strings: list[str] = []
    try:
        for opcode, arg, _pos in pickletools.genops(pickle_bytes):
            if opcode.name in ("GLOBAL", "INST"):
                module, _, name = str(arg).partition(" ")
                names.append(_py3_name(module, name))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                names.append(_py3_name(strings[-2], strings[-1]))
            elif opcode.name in _STRING_OPS:
                strings.append(str(arg))
            if len(names) >= limit:
                break
    except Exception:  # noqa: BLE001, S110 - a malformed pickle: name what was found before the damage
        pass
    return list(dict.fromkeys(names))


def with_names(why: str, pickle_bytes: bytes) -> str:
    """``why``, followed by the callables the pickle names (if any)."""
    names = named_callables(pickle_bytes)
    return f"{why}; the payload names {', '.join(names)}" if names else why


def decode(body: bytes, rank: int, op: str, cap: int) -> Any:
    """``body`` (a torch.save archive from ``rank``) as an object, or ``UnpicklingError``."""
    if body[:4] != _ZIP:
        raise refused(rank, op, with_names("expected a torch.save archive, got other bytes", body))
    why = check_archive(body, cap)
    if why is None:
        why = amplifier(_stored_record(body, "data.pkl"))
    if why is not None:
        raise refused(rank, op, why)
    try:
        # weights_only=True passed explicitly: no environment variable can turn it off.
        with _LOAD_LOCK, torch.sparse.check_sparse_tensor_invariants():
            obj = torch.load(io.BytesIO(body), weights_only=True, mmap=False)
    except pickle.UnpicklingError as e:     # a callable or opcode outside plain data
        raise refused(rank, op, with_names(_why_refused(e),
                                           _stored_record(body, "data.pkl"))) from None
    except Exception as e:  # noqa: BLE001 - whatever went wrong, never fall back to pickle
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise refused(rank, op, f"it does not rebuild into valid tensors: {first}") from None
    why = check_tensors(obj, cap)
    if why is not None:
        raise refused(rank, op, why)
    return obj
