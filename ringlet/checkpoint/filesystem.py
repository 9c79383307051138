"""``FileSystemWriter`` / ``FileSystemReader``: where a checkpoint lives and how it is written.

torch spells a checkpoint's location either ``checkpoint_id=path`` or
``storage_writer=FileSystemWriter(path)`` / ``storage_reader=FileSystemReader(path)``; both
work here.  These objects carry the directory and the writing options; the file format
itself is fixed (docs/checkpoint.md).
"""

from __future__ import annotations

import os
from typing import Any, TypeVar

__all__ = ["FileSystemReader", "FileSystemWriter", "resolve_location"]


class FileSystemWriter:
    """Write a checkpoint into the directory ``path``.

    Args:
        path: the checkpoint directory (created if missing).
        single_file_per_rank: accepted for torch compatibility; ringlet always writes one
            file per writing rank.
        sync_files: fsync every file and the directory before the commit (default).  Without
            it a machine crash (not a process crash) can lose a committed checkpoint.
        thread_count, per_thread_copy_ahead, cache_staged_state_dict: accepted for torch
            compatibility; ringlet writes each rank's file with one thread.
        overwrite: replace a checkpoint already committed in ``path`` (default); with
            ``False`` saving into a committed directory raises.

    Example::

        dcp.save(state, storage_writer=FileSystemWriter("ckpt/step_100", sync_files=False))
    """

    def __init__(self, path: str | os.PathLike[str], single_file_per_rank: bool = True,
                 sync_files: bool = True, thread_count: int = 1,
                 per_thread_copy_ahead: int = 10_000_000,
                 cache_staged_state_dict: bool = False, overwrite: bool = True,
                 **_torch_only: Any) -> None:
        if thread_count < 1:
            raise ValueError(f"FileSystemWriter: thread_count: expected >= 1, got {thread_count}")
        self.path = os.fspath(path)
        self.sync_files = bool(sync_files)
        self.overwrite = bool(overwrite)
        self.thread_count = thread_count

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def __repr__(self) -> str:
        return (f"FileSystemWriter({self.path!r}, sync_files={self.sync_files}, "
                f"overwrite={self.overwrite})")


class FileSystemReader:
    """Read the checkpoint in directory ``path``.

    Example::

        dcp.load(state, storage_reader=FileSystemReader("ckpt/step_100"))
    """

    def __init__(self, path: str | os.PathLike[str], **_torch_only: Any) -> None:
        self.path = os.fspath(path)

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)

    def read_metadata(self) -> Any:
        """The checkpoint's :class:`~ringlet.checkpoint.Metadata` (local read, no communication)."""
        from ringlet.checkpoint._metadata import Metadata
        from ringlet.checkpoint._storage import read_metadata

        return Metadata.from_json_bytes(read_metadata(self.path),
                                        os.path.join(self.path, "metadata.json"))

    def __repr__(self) -> str:
        return f"FileSystemReader({self.path!r})"


_Location = TypeVar("_Location", FileSystemWriter, FileSystemReader)


def resolve_location(op: str, checkpoint_id: Any, storage: Any,
                     kind: type[_Location]) -> _Location:
    """The writer/reader for a call: ``storage`` (re-pointed at ``checkpoint_id`` if given) or
    a default one at ``checkpoint_id``."""
    if storage is None:
        if checkpoint_id is None:
            raise ValueError(f"{op}: expected checkpoint_id=<directory> or a storage "
                             f"{'writer' if kind is FileSystemWriter else 'reader'}, got neither")
        return kind(checkpoint_id)
    if not isinstance(storage, kind):
        raise TypeError(f"{op}: expected a ringlet {kind.__name__}, got {type(storage).__name__} "
                        "(ringlet reads and writes its own format only)")
    storage.reset(checkpoint_id)
    return storage
