"""``ringlet.distributed.checkpoint.filesystem``: ``FileSystemWriter`` / ``FileSystemReader``
(re-exports only)."""

from ringlet.checkpoint.filesystem import FileSystemReader, FileSystemWriter

__all__ = ["FileSystemReader", "FileSystemWriter"]
