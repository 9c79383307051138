"""``ringlet.distributed.checkpoint``: torch's ``torch.distributed.checkpoint`` (re-exports only).

The implementation lives in ``ringlet.checkpoint`` (layer 8); the format is in docs/checkpoint.md.
``python -m ringlet.distributed.checkpoint`` lists, verifies and converts checkpoints.
"""

from ringlet.checkpoint import (
    CheckpointException,
    DefaultLoadPlanner,
    DefaultSavePlanner,
    FileSystemReader,
    FileSystemWriter,
    Metadata,
    async_save,
    load,
    save,
)
from ringlet.checkpoint.stateful import Stateful

__all__ = [
    "CheckpointException",
    "DefaultLoadPlanner",
    "DefaultSavePlanner",
    "FileSystemReader",
    "FileSystemWriter",
    "Metadata",
    "Stateful",
    "async_save",
    "load",
    "save",
]
