"""The checkpoint's metadata: what ``metadata.json`` holds, its one writer and its strict parser.

The schema lives here alone: :meth:`Metadata.to_json_bytes` is the only code that writes
``metadata.json`` (``save`` builds a :class:`Metadata` and calls it), and the parser reads it
back, choosing by the document's ``version`` (``_PARSERS``: one function per format version,
so that a later format adds a parser and keeps reading the old one).  Everything a loader
trusts comes from here, so parsing checks every field (types, ranges, byte counts, file names
that cannot leave the directory, chunks that tile each tensor exactly) before anything is
opened or allocated.  The format is described in docs/checkpoint.md.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

import torch

from ringlet.checkpoint._flatten import MAX_DEPTH, Path, decode_value, join_path
from ringlet.checkpoint._geometry import Box, find_overlap, tiles_exactly

__all__ = [
    "BLOCK_BYTES",
    "DTYPES",
    "FORMAT",
    "METADATA_FILE",
    "ChunkMeta",
    "Metadata",
    "TensorMeta",
    "check_file_name",
    "dtype_name",
    "n_blocks",
]

FORMAT = "ringlet-checkpoint"
VERSION = 1
METADATA_FILE = "metadata.json"
BLOCK_BYTES = 1 << 20     # one crc32 per MiB of a chunk: a reader verifies only the blocks it reads
MAX_METADATA_BYTES = 1 << 30

# torch dtype <-> the name in metadata <-> the safetensors name (None: safetensors has none).
DTYPES: dict[str, tuple[torch.dtype, str | None]] = {
    "float64": (torch.float64, "F64"), "float32": (torch.float32, "F32"),
    "float16": (torch.float16, "F16"), "bfloat16": (torch.bfloat16, "BF16"),
    "int64": (torch.int64, "I64"),
    "int32": (torch.int32, "I32"), "int16": (torch.int16, "I16"), "int8": (torch.int8, "I8"),
    "uint8": (torch.uint8, "U8"),
    "bool": (torch.bool, "BOOL"), "complex64": (torch.complex64, "C64"),
    "complex128": (torch.complex128, None), "uint16": (torch.uint16, "U16"),
    "uint32": (torch.uint32, "U32"), "uint64": (torch.uint64, "U64"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
    "float8_e5m2": (torch.float8_e5m2, "F8_E5M2"),
}
_NAMES = {dt: name for name, (dt, _) in DTYPES.items()}
_FILE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def dtype_name(dtype: torch.dtype, key: str = "?") -> str:
    if dtype not in _NAMES:
        raise TypeError(f"state_dict[{key!r}]: dtype {dtype} cannot be checkpointed "
                        f"(expected one of {sorted(DTYPES)})")
    return _NAMES[dtype]


def n_blocks(nbytes: int) -> int:
    return -(-nbytes // BLOCK_BYTES)


def check_file_name(name: Any) -> str:
    """A data file name from metadata: a plain name inside the checkpoint directory."""
    if not isinstance(name, str) or not _FILE_NAME.fullmatch(name) or name in (METADATA_FILE,):
        raise ValueError(f"file name {name!r:.80}: expected a plain file name "
                         "inside the checkpoint directory (letters, digits, '.', "
                         "'_', '-'; no '/', no leading '.')")
    return name


@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """One stored block of a tensor: where it sits in the global tensor and in its file."""

    box: Box
    file: str
    begin: int            # byte offset of the chunk's first element in ``file``
    end: int
    crc32: tuple[int, ...]  # one per BLOCK_BYTES of [begin, end)

    def to_json(self) -> dict[str, Any]:
        return {"offsets": list(self.box.offsets), "sizes": list(self.box.sizes), "file": self.file,
                "begin": self.begin, "end": self.end, "crc32": list(self.crc32)}


@dataclasses.dataclass(frozen=True)
class TensorMeta:
    key: str
    path: Path
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def itemsize(self) -> int:
        return self.torch_dtype.itemsize

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def to_json(self) -> dict[str, Any]:
        return {"path": list(self.path), "dtype": self.dtype, "shape": list(self.shape),
                "chunks": [c.to_json() for c in self.chunks]}


@dataclasses.dataclass(frozen=True)
class Metadata:
    """A committed checkpoint: every tensor (global shape, dtype, chunks) and plain value."""

    save_id: str
    world_size: int
    files: dict[str, int]              # data file name -> its size in bytes
    tensors: dict[str, TensorMeta]
    values: dict[str, tuple[Path, Any]]   # key -> (path, JSON-encoded value)

    def to_json_bytes(self) -> bytes:
        """The ``metadata.json`` of this checkpoint, in the current format version: compact
        UTF-8 JSON, fields in the order of the dicts (the order ``save`` wrote them)."""
        doc = {"format": FORMAT, "version": VERSION, "save_id": self.save_id,
               "world_size": self.world_size,
               "checksum": {"algorithm": "crc32", "block_bytes": BLOCK_BYTES},
               "files": {n: {"bytes": b} for n, b in self.files.items()},
               "tensors": {k: t.to_json() for k, t in self.tensors.items()},
               "values": {k: {"path": list(p), "value": v} for k, (p, v) in self.values.items()}}
        return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode("utf-8")

    def value(self, key: str) -> Any:
        return decode_value(self.values[key][1], key)

    @staticmethod
    def from_json_bytes(raw: bytes, where: str = METADATA_FILE) -> Metadata:
        """Parse and check; raises ``ValueError`` naming ``where`` and the bad field."""
        try:
            doc = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
            return _parse(doc)
        except (ValueError, TypeError, KeyError, UnicodeDecodeError, RecursionError) as e:
            raise ValueError(f"{where}: not a valid ringlet checkpoint metadata file: "
                             f"{e}") from None


def _no_constants(name: str) -> Any:
    raise ValueError(f"JSON constant {name} is not allowed")


def _int(v: Any, what: str, lo: int = 0, hi: int = 1 << 62) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(f"{what}: expected an integer in [{lo}, {hi}], got {v!r:.80}")
    return v


def _ints(v: Any, what: str, field: str = "") -> tuple[int, ...]:
    """``v``: a list of at most 64 integers in [0, 2**62] (``what.field`` in errors)."""
    if isinstance(v, list) and len(v) <= 64 and all(
            type(x) is int and 0 <= x <= 1 << 62 for x in v):
        return tuple(v)
    what = f"{what}.{field}" if field else what
    if not isinstance(v, list) or len(v) > 64:
        raise ValueError(f"{what}: expected a list of at most 64 integers, got {v!r:.80}")
    return tuple(_int(x, what) for x in v)


def _path(v: Any, key: str) -> Path:
    if isinstance(v, list) and len(v) > MAX_DEPTH:
        raise ValueError(f"{key!r:.80}: path: expected at most {MAX_DEPTH} parts, got {len(v)}")
    if not isinstance(v, list) or not v or not all(
            isinstance(p, str | int) and not isinstance(p, bool) for p in v):
        raise ValueError(f"{key!r}: path: expected a non-empty list of str/int, got {v!r:.80}")
    if join_path(tuple(v)) != key:
        raise ValueError(f"{key!r}: path {v!r:.80} does not spell the key")
    return tuple(v)


def _parse(doc: Any) -> Metadata:
    """Check the format's name, then hand ``doc`` to the parser of its version."""
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ValueError(f"format: expected {FORMAT!r}")
    version = doc.get("version")
    parse = _PARSERS.get(version) if type(version) is int else None
    if parse is None:
        known = " or ".join(str(v) for v in sorted(_PARSERS))
        raise ValueError(f"version: expected {known}, got {version!r:.40} (a newer ringlet?)")
    return parse(doc)


def _parse_v1(doc: dict[str, Any]) -> Metadata:
    """Format version 1 (written by :meth:`Metadata.to_json_bytes`)."""
    ck = doc.get("checksum")
    if ck != {"algorithm": "crc32", "block_bytes": BLOCK_BYTES}:
        raise ValueError(f"checksum: expected crc32 over {BLOCK_BYTES}-byte blocks, got {ck!r:.80}")
    save_id = doc["save_id"]
    if not isinstance(save_id, str) or not re.fullmatch(r"[0-9a-f]{1,64}", save_id):
        raise ValueError(f"save_id: expected hex digits, got {save_id!r:.80}")
    files = {check_file_name(n): _int(f["bytes"], f"files[{n}].bytes")
             for n, f in _dict(doc, "files").items()}
    tensors = {k: _tensor(k, t, files) for k, t in _dict(doc, "tensors").items()}
    values = {}
    for k, v in _dict(doc, "values").items():
        if not isinstance(v, dict) or set(v) != {"path", "value"}:
            raise ValueError(f"values[{k!r}]: expected {{path, value}}")
        decode_value(v["value"], k)
        values[k] = (_path(v["path"], k), v["value"])
    both = set(tensors) & set(values)
    if both:
        raise ValueError(f"keys {sorted(both)[:5]} are both tensors and values")
    _check_paths([(f"tensors[{k!r:.80}]", t.path) for k, t in tensors.items()]
                 + [(f"values[{k!r:.80}]", p) for k, (p, _) in values.items()])
    _check_byte_ranges(tensors)
    return Metadata(save_id, _int(doc["world_size"], "world_size", 1), files, tensors, values)


# format version -> its parser; Metadata.to_json_bytes writes VERSION, which must be a key here
_PARSERS: dict[int, Callable[[dict[str, Any]], Metadata]] = {1: _parse_v1}


def _dict(doc: dict[str, Any], name: str) -> dict[str, Any]:
    v = doc.get(name)
    if not isinstance(v, dict):
        raise TypeError(f"{name}: expected an object")
    return v


def _tensor(key: str, t: Any, files: dict[str, int]) -> TensorMeta:
    if not isinstance(t, dict) or t.get("dtype") not in DTYPES:
        raise ValueError(f"tensors[{key!r}].dtype: expected one of {sorted(DTYPES)}")
    shape = _ints(t["shape"], f"tensors[{key!r}].shape")
    meta = TensorMeta(key, _path(t["path"], key), t["dtype"], shape, ())
    if not isinstance(t["chunks"], list):
        raise TypeError(f"tensors[{key!r}].chunks: expected a list")
    chunks = tuple(_chunk(meta, i, c, files) for i, c in enumerate(t["chunks"]))
    _check_tiling(key, shape, chunks)
    return dataclasses.replace(meta, chunks=chunks)


def _chunk(meta: TensorMeta, i: int, c: Any, files: dict[str, int]) -> ChunkMeta:
    what = f"tensors[{meta.key!r}].chunks[{i}]"
    if not isinstance(c, dict):
        raise TypeError(f"{what}: expected an object")
    box = Box(_ints(c["offsets"], what, "offsets"), _ints(c["sizes"], what, "sizes"))
    ends = zip(box.offsets, box.sizes, meta.shape, strict=True)   # iterated only when lengths match
    if len(box.sizes) != len(meta.shape) or any(o + s > n for o, s, n in ends):
        raise ValueError(f"{what}: box {box} does not fit the shape {list(meta.shape)}")
    name = c["file"]
    if not isinstance(name, str) or name not in files:    # files' names are checked already
        raise ValueError(f"{what}.file: {check_file_name(name)!r} is not listed under files")
    begin, end = _int(c["begin"], f"{what}.begin"), _int(c["end"], f"{what}.end")
    if end - begin != box.numel * meta.itemsize or end > files[name]:
        raise ValueError(f"{what}: byte range [{begin}, {end}) does not hold {box.numel} x "
                         f"{meta.itemsize} bytes inside {name} ({files[name]} bytes)")
    crcs = c["crc32"]
    if not isinstance(crcs, list) or len(crcs) != n_blocks(end - begin):
        raise ValueError(f"{what}.crc32: expected {n_blocks(end - begin)} checksums")
    if not all(type(x) is int and 0 <= x <= 0xFFFFFFFF for x in crcs):
        for x in crcs:
            _int(x, f"{what}.crc32", 0, 0xFFFFFFFF)
    return ChunkMeta(box, name, begin, end, tuple(crcs))


def _check_tiling(key: str, shape: tuple[int, ...], chunks: tuple[ChunkMeta, ...]) -> None:
    """The chunks must cover the tensor exactly once: no overlap, nothing missing (in one pass
    over the chunks' corners, not by comparing every pair)."""
    boxes = [c.box for c in chunks]
    exact = tiles_exactly(shape, boxes)
    if exact is None:
        raise ValueError(f"tensors[{key!r}]: {len(chunks)} chunks cut too many dims to check "
                         "(ringlet cuts a tensor along at most a few dims)")
    if exact:
        return
    pair = find_overlap(boxes)
    if pair is not None:
        a, b = (chunks[i] for i in pair)
        raise ValueError(f"tensors[{key!r}]: chunks[{pair[0]}] {a.box} and chunks[{pair[1]}] "
                         f"{b.box} overlap")
    held = sum(c.box.numel for c in chunks)
    if held != math.prod(shape):
        raise ValueError(f"tensors[{key!r}]: chunks hold {held} of the "
                         f"{math.prod(shape)} elements of shape {list(shape)}")
    raise ValueError(f"tensors[{key!r}]: chunks overlap (and leave as many elements uncovered)")


def _check_byte_ranges(tensors: dict[str, TensorMeta]) -> None:
    """No two chunks -- of one tensor or of two -- may store their bytes in the same place of a
    file (ringlet never writes such files; reading them would multiply what the file holds)."""
    by_file: dict[str, list[tuple[int, int, str, int]]] = {}
    for key, t in tensors.items():
        for i, c in enumerate(t.chunks):
            if c.end > c.begin:
                by_file.setdefault(c.file, []).append((c.begin, c.end, key, i))
    for name, spans in by_file.items():
        spans.sort()
        last = spans[0]
        for span in spans[1:]:
            if span[0] < last[1]:
                raise ValueError(
                    f"files[{name!r}]: bytes [{span[0]}, {min(span[1], last[1])}) are claimed by "
                    f"both tensors[{last[2]!r:.80}].chunks[{last[3]}] and "
                    f"tensors[{span[2]!r:.80}].chunks[{span[3]}] (byte ranges may not overlap)")
            if span[1] > last[1]:
                last = span


_END = None   # marks, in _check_paths' tree, where an entry's path ends (parts are str or int)


def _check_paths(paths: list[tuple[str, Path]]) -> None:
    """No entry's path may run through another entry (``a`` and ``a.b`` as paths ``["a"]`` and
    ``["a", "b"]``): the tree they spell would put a leaf where a dict must be."""
    root: dict[Any, Any] = {}
    for field, path in paths:
        node = root
        for part in path:
            if _END in node:
                raise ValueError(f"{field}.path: {list(path)!r:.80} runs through "
                                 f"{node[_END]}, which is itself an entry")
            node = node.setdefault(part, {})
        if node:
            below = node
            while _END not in below:
                below = next(iter(below.values()))
            raise ValueError(f"{field}.path: {list(path)!r:.80} is an entry and also the start "
                             f"of {below[_END]}")
        node[_END] = field

