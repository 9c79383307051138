"""``load``: fill a state dict in place from a checkpoint, in whatever sharding it has now.

Phases (every one ends in an agreement, so a problem on any rank raises the same
:class:`CheckpointException` on all of them and nobody waits for a peer that gave up):

1. rank 0 reads and checks ``metadata.json`` and broadcasts its bytes (one view for all);
2. each rank matches its state dict against the metadata (missing keys, dtype and shape
   mismatches), plans its reads (``_planner.plan_reads``: only the byte ranges holding
   the boxes it must fill) and *verifies* them -- file type and size, then the crc32 of
   every checksum block it will read -- before touching the state dict;
3. each rank copies: straight from the file into the tensor's memory where the stored
   bytes and the target are both contiguous, otherwise through a buffer of the rows it
   needs (at most one chunk);
4. plain values are set, tensors the state dict lacked are created, Stateful objects get
   ``load_state_dict``.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
import zlib
from collections.abc import Callable
from typing import Any

import torch

from ringlet.checkpoint._coord import Coordinator
from ringlet.checkpoint._flatten import Leaf, Path, flatten, replace_leaves
from ringlet.checkpoint._geometry import Box
from ringlet.checkpoint._local import load_piece
from ringlet.checkpoint._metadata import BLOCK_BYTES, METADATA_FILE, ChunkMeta, Metadata, TensorMeta
from ringlet.checkpoint._planner import ReadOp, plan_reads
from ringlet.checkpoint._storage import open_shard, pread_into, read_metadata, tensor_bytes
from ringlet.checkpoint.stateful import resolve_stateful

__all__ = ["load_into", "shared_metadata"]


@dataclasses.dataclass
class _Target:
    key: str
    meta: TensorMeta
    local: torch.Tensor          # the memory to fill
    box: Box                     # what ``local`` holds of the global tensor
    ops: list[ReadOp]
    finish: Callable[[], None] | None = None


def shared_metadata(directory: str, coord: Coordinator, op: str) -> Metadata:
    """Rank 0 reads and checks the metadata; every rank gets the same copy (or the same error)."""
    raw, error = None, None
    if coord.rank == 0:
        try:
            raw = read_metadata(directory)
            Metadata.from_json_bytes(raw, os.path.join(directory, METADATA_FILE))
        except (OSError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
    coord.agree(op, error)
    raw = coord.broadcast_bytes(raw)
    return Metadata.from_json_bytes(raw, os.path.join(directory, METADATA_FILE))


def _match(meta: Metadata, leaves: dict[str, Leaf],
           strict: bool) -> tuple[list[_Target], dict[Path, Any]]:
    """Targets to read, and leaves to replace; raises ``ValueError`` on any mismatch."""
    targets, updates, missing, bad = [], {}, [], []
    for key, leaf in leaves.items():
        if leaf.is_tensor and key in meta.tensors:
            tm, t = meta.tensors[key], leaf.value
            if t.dtype != tm.torch_dtype or tuple(t.shape) != tm.shape:
                bad.append(f"{key!r}: checkpoint has {tm.dtype}{list(tm.shape)}, the state dict "
                           f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}")
                continue
            local, box, finish = load_piece(t)
            targets.append(_Target(key, tm, local, box, plan_reads(tm, box), finish))
        elif not leaf.is_tensor and key in meta.values:
            updates[leaf.path] = meta.value(key)
        # a tensor where the state dict has a value
        elif not leaf.is_tensor and key in meta.tensors:
            tm = meta.tensors[key]
            full = Box.of([0] * len(tm.shape), tm.shape)
            new = torch.empty(tm.shape, dtype=tm.torch_dtype)
            targets.append(_Target(key, tm, new, full, plan_reads(tm, full)))
            updates[leaf.path] = new
        elif leaf.is_tensor and key in meta.values:
            bad.append(f"{key!r}: checkpoint has a plain value, the state dict a tensor")
        elif not _subtree(meta, leaf, targets, updates):
            missing.append(key)
    if bad:
        raise ValueError("mismatched entries: " + "; ".join(bad))
    if missing and strict:
        raise ValueError(f"missing keys (in the state dict, not in the checkpoint): {missing}")
    return targets, updates


def _subtree(meta: Metadata, leaf: Leaf, targets: list[_Target], updates: dict[Path, Any]) -> bool:
    """An empty container in the state dict takes everything stored under its
    key (as nested dicts)."""
    if not (isinstance(leaf.value, dict | list | tuple) and not leaf.value):
        return False
    prefix, n = leaf.key + ".", len(leaf.path)
    found: dict[Path, Any] = {}
    for key, tm in meta.tensors.items():
        if key.startswith(prefix) and tm.path[:n] == leaf.path:
            full = Box.of([0] * len(tm.shape), tm.shape)
            new = torch.empty(tm.shape, dtype=tm.torch_dtype)
            targets.append(_Target(key, tm, new, full, plan_reads(tm, full)))
            found[tm.path[n:]] = new
    for key, (path, _) in meta.values.items():
        if key.startswith(prefix) and path[:n] == leaf.path:
            found[path[n:]] = meta.value(key)
    if not found:
        return False
    tree: dict[Any, Any] = {}
    for rel, value in found.items():
        node = tree
        for part in rel[:-1]:
            node = node.setdefault(part, {})
        node[rel[-1]] = value
    updates[leaf.path] = tree
    return True


def _verify(directory: str, files: dict[str, int], targets: list[_Target]) -> str | None:
    """Check every file and every checksum block the reads will touch; the first problem or None."""
    blocks: dict[str, dict[tuple[int, int], tuple[str, ChunkMeta]]] = {}
    for t in targets:
        for op in t.ops:
            for b in op.blocks:
                blocks.setdefault(op.chunk.file, {})[(op.chunk.begin, b)] = (t.key, op.chunk)
    buf = memoryview(bytearray(BLOCK_BYTES))
    with _Files(directory, files) as fds:
        for name, needed in blocks.items():
            where = os.path.join(directory, name)
            try:
                fd = fds.get(name)
                for (begin, b), (key, c) in sorted(needed.items(), key=lambda kv: kv[0]):
                    lo = begin + b * BLOCK_BYTES
                    n = min(BLOCK_BYTES, c.end - lo)
                    pread_into(fd, buf[:n], lo, name)
                    got = zlib.crc32(buf[:n])
                    if got != c.crc32[b]:
                        return (f"{where}: tensor {key!r} chunk {c.box}: checksum mismatch "
                                f"in bytes [{lo}, {lo + n}) (expected crc32 "
                                f"{c.crc32[b]:08x}, got {got:08x})")
            except ValueError as e:
                return f"{directory}: {e} (holds tensor {next(iter(needed.values()))[0]!r})"
    return None


class _Files:
    """Shard files opened on demand (safely, sizes checked), all closed on exit."""

    def __init__(self, directory: str, files: dict[str, int]) -> None:
        self.files = files
        self.dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        self.fds: dict[str, int] = {}

    def get(self, name: str) -> int:
        if name not in self.fds:
            self.fds[name] = open_shard(self.dir_fd, name, self.files[name])
        return self.fds[name]

    def __enter__(self) -> _Files:  # noqa: PYI034 - no typing.Self (Python 3.10)
        return self

    def __exit__(self, *exc: object) -> None:
        for fd in self.fds.values():
            os.close(fd)
        os.close(self.dir_fd)


def _copy(directory: str, files: dict[str, int], targets: list[_Target]) -> None:
    """Fill every target from its reads (after verification)."""
    with _Files(directory, files) as fds, torch.no_grad():
        for t in targets:
            for op in t.ops:
                _copy_one(fds.get(op.chunk.file), op, t)
            if t.finish is not None:
                t.finish()


def _copy_one(fd: int, op: ReadOp, t: _Target) -> None:
    dest = t.local
    for d, (o, n) in enumerate(zip(op.inter.relative_to(t.box).offsets, op.inter.sizes,
                                   strict=True)):
        dest = dest.narrow(d, o, n)
    if op.direct and dest.is_contiguous() and dest.device.type == "cpu":
        pread_into(fd, tensor_bytes(dest), op.lo, op.chunk.file)
        return
    buf = torch.empty(op.hi - op.lo, dtype=torch.uint8)
    pread_into(fd, tensor_bytes(buf), op.lo, op.chunk.file)
    src = buf.view(t.meta.torch_dtype)
    sizes = op.chunk.box.sizes
    if op.direct:
        src = src.view(op.inter.sizes)
    else:
        rel = op.inter.relative_to(op.chunk.box)
        src = src.view(rel.sizes[0], *sizes[1:])
        for d in range(1, len(sizes)):
            src = src.narrow(d, rel.offsets[d], rel.sizes[d])
    dest.copy_(src)


def load_into(state_dict: dict[str, Any], directory: str, coord: Coordinator,
              strict: bool = True) -> None:
    """Fill ``state_dict`` in place from the checkpoint in ``directory`` (collective)."""
    meta = shared_metadata(directory, coord, "load")
    resolved, objects = resolve_stateful(state_dict)
    targets: list[_Target] = []
    updates: dict[Path, Any] = {}
    leaves: dict[str, Leaf] = {}
    error = None
    try:
        leaves = flatten(resolved)
        targets, updates = _match(meta, leaves, strict)
        error = _verify(directory, meta.files, targets)
    except Exception as e:  # noqa: BLE001 - agreed below, so every rank raises and none waits
        error = (f"{directory}: {type(e).__name__}: {e}" if not isinstance(e, ValueError)
                 else f"{directory}: {e}")
    coord.agree("load", error)
    unexpected = sorted((set(meta.tensors) | set(meta.values)) - set(leaves))
    if unexpected and coord.rank == 0:
        warnings.warn(f"load: the checkpoint in {directory} holds keys the state dict does not ask "
                      f"for: {unexpected[:20]}{' ...' if len(unexpected) > 20 else ''}",
                      stacklevel=3)
    error = None
    try:
        _copy(directory, meta.files, targets)
    except Exception as e:  # noqa: BLE001 - agreed below
        error = f"{directory}: reading failed after verification: {e}"
    coord.agree("load", error)
    replace_leaves(resolved, updates)
    for key, value in resolved.items():
        if key in objects:
            objects[key].load_state_dict(value)
        else:
            state_dict[key] = value
