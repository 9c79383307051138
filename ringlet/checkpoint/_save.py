"""``save``: every rank writes its own boxes, rank 0 commits the metadata.

Phases, each ending in an exchange so that every rank knows every other rank's outcome
(a failure anywhere raises the same :class:`CheckpointException` everywhere and nothing is
committed):

1. *prepare* -- resolve Stateful objects, describe the local pieces (no data moves), and on
   rank 0 create the directory and take its lock; all-gather the descriptions and plan
   who writes what (``_planner.plan_save``, identical on every rank).
2. *write* -- each rank writes the boxes it owns into its own shard file straight from the
   tensors' memory (a staging copy only for a non-contiguous or non-CPU piece, one at a
   time), with a crc32 per MiB, and fsyncs it.
3. *commit* -- all-gather the chunk records; rank 0 builds ``metadata.json``, publishes it
   by rename (``_storage.commit``) and tells the others.
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable
from typing import Any

import torch

from ringlet.checkpoint._coord import Coordinator
from ringlet.checkpoint._errors import CheckpointException
from ringlet.checkpoint._flatten import encode_value, flatten
from ringlet.checkpoint._geometry import Box
from ringlet.checkpoint._local import save_piece
from ringlet.checkpoint._metadata import METADATA_FILE, ChunkMeta, Metadata, TensorMeta, dtype_name
from ringlet.checkpoint._planner import SavePlan, plan_save
from ringlet.checkpoint._storage import DirLock, commit, remove_quietly, shard_name, write_shard
from ringlet.checkpoint.filesystem import FileSystemWriter

__all__ = ["Prepared", "finish", "prepare", "write"]

Item = tuple[str, Box, str, Callable[[], torch.Tensor]]


@dataclasses.dataclass
class Prepared:
    """A planned save: the plan, this rank's items to write, and rank 0's directory lock."""

    writer: FileSystemWriter
    save_id: str
    plan: SavePlan
    items: list[Item]
    lock: DirLock | None

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def _contiguous_cpu(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    if t.is_contiguous() and t.device.type == "cpu":
        return lambda: t
    return lambda: t.detach().to("cpu").contiguous()


def _describe(state_dict: dict[str, Any]) -> tuple[dict[str, Any],
                                                   dict[tuple[str, Box], torch.Tensor]]:
    """This rank's JSON description of its state, and its local pieces by (key, box)."""
    tensors, values, pieces = [], [], {}
    for key, leaf in flatten(state_dict).items():
        if leaf.is_tensor:
            local, box = save_piece(leaf.value)
            tensors.append([key, list(leaf.path), dtype_name(leaf.value.dtype, key),
                            list(leaf.value.shape), list(box.offsets), list(box.sizes)])
            pieces[(key, box)] = local
        else:
            values.append([key, list(leaf.path), encode_value(leaf.value, key)])
    return {"tensors": tensors, "values": values}, pieces


def _open_directory(writer: FileSystemWriter) -> DirLock:
    path = writer.path
    if os.path.exists(path) and not os.path.isdir(path):
        raise NotADirectoryError(f"{path}: exists and is not a directory")
    os.makedirs(path, exist_ok=True)
    lock = DirLock(path)
    if not writer.overwrite and os.path.exists(os.path.join(path, METADATA_FILE)):
        lock.release()
        raise FileExistsError(f"{path}: holds a committed checkpoint and overwrite=False")
    return lock


def prepare(state_dict: dict[str, Any], writer: FileSystemWriter, coord: Coordinator) -> Prepared:
    """Phase 1 (collective): describe, lock, exchange, plan."""
    payload: dict[str, Any] = {"error": None, "save_id": secrets.token_hex(8)}
    pieces: dict[tuple[str, Box], torch.Tensor] = {}
    lock = None
    try:
        desc, pieces = _describe(state_dict)
        payload.update(desc)
        if coord.rank == 0:
            lock = _open_directory(writer)
    except Exception as e:  # noqa: BLE001 - shared with the peers, who raise it too (no one waits)
        payload.update(error=f"{type(e).__name__}: {e}", tensors=[], values=[])
    payloads = coord.all_gather_json(payload)
    failures = {r: p["error"] for r, p in enumerate(payloads) if p["error"]}
    try:
        if failures:
            raise CheckpointException("save", failures)
        try:
            plan = plan_save(payloads)
        except ValueError as e:
            raise CheckpointException("save", {coord.rank: str(e)}) from None
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    items = [(key, box, plan.tensors[key].dtype, _contiguous_cpu(pieces[(key, box)]))
             for key, box in plan.writes[coord.rank]]
    return Prepared(writer, payloads[0]["save_id"], plan, items, lock)


def write(prep: Prepared, rank: int) -> dict[str, Any]:
    """Phase 2 (local): write this rank's shard; returns its record, or its error."""
    if not prep.items:
        return {"error": None, "file": None, "bytes": 0, "chunks": []}
    name = shard_name(prep.save_id, rank)
    try:
        size, chunks = write_shard(prep.writer.path, name, prep.save_id, rank, prep.items,
                                   prep.writer.sync_files)
    except Exception as e:  # noqa: BLE001 - reported to every rank by ``finish``
        want = sum(b.numel * prep.plan.tensors[k].itemsize for k, b, _, _ in prep.items)
        why = (f"[errno {e.errno}] {e.strerror}" if isinstance(e, OSError)
               else f"{type(e).__name__}: {e}")
        where = os.path.join(prep.writer.path, name)
        return {"error": f"writing {where} ({want} bytes of tensors) failed: {why}", "file": name,
                "bytes": 0, "chunks": []}
    return {"error": None, "file": name, "bytes": size,
            "chunks": [[key, c.to_json()]
                       for (key, _, _, _), c in zip(prep.items, chunks, strict=True)]}


def _metadata(prep: Prepared, results: list[dict[str, Any]], world: int) -> Metadata:
    """The checkpoint the ranks' write records (``results[r]`` from rank ``r``) make up: files in
    rank order, each tensor's chunks sorted by their offsets."""
    chunks: dict[str, list[ChunkMeta]] = {k: [] for k in prep.plan.tensors}
    for res in results:
        for key, c in res["chunks"]:
            chunks[key].append(ChunkMeta(Box.of(c["offsets"], c["sizes"]), c["file"], c["begin"],
                                         c["end"], tuple(c["crc32"])))
    tensors = {k: TensorMeta(k, t.path, t.dtype, t.shape,
                             tuple(sorted(chunks[k], key=lambda c: c.box.offsets)))
               for k, t in prep.plan.tensors.items()}
    return Metadata(prep.save_id, world, {r["file"]: r["bytes"] for r in results if r["file"]},
                    tensors, dict(prep.plan.values))


def finish(prep: Prepared, result: dict[str, Any], coord: Coordinator,
           op: str = "save") -> Metadata:
    """Phase 3 (collective): exchange write records; rank 0 commits; every
    rank learns the outcome."""
    try:
        results = coord.all_gather_json(result)
        failures = {r: res["error"] for r, res in enumerate(results) if res["error"]}
        if failures:
            # free the space of a save that will not commit
            if result["file"] and not result["error"]:
                remove_quietly(prep.writer.path, result["file"])
            raise CheckpointException(op, failures)
        raw = _metadata(prep, results, coord.size).to_json_bytes()
        meta = Metadata.from_json_bytes(raw, "the metadata being saved")
        error = None
        if coord.rank == 0:
            try:
                keep = [r["file"] for r in results if r["file"]] + [METADATA_FILE]
                commit(prep.writer.path, raw, prep.save_id, keep, prep.writer.sync_files)
            except OSError as e:
                error = (f"committing {prep.writer.path}/{METADATA_FILE} failed: [errno {e.errno}] "
                         f"{e.strerror}")
        coord.agree(op, error)
        return meta
    finally:
        prep.release()
