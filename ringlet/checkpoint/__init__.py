"""Sharded checkpoints (layer 8): save on N ranks, load on M, in any sharding; exact and atomic.

Files, in dependency order: ``_flatten`` (state dict <-> flat leaves, plain values as
JSON) and ``_geometry`` (boxes) -> ``_metadata`` (``metadata.json`` and its strict
parser) -> ``_planner`` (who writes what, what to read; pure) -> ``_storage`` (files, the
commit, the lock) -> ``_coord`` (agreement across ranks) -> ``_local`` (a tensor's local
piece) -> ``_save`` / ``_load`` -> ``_api`` (``save``, ``load``, ``async_save``);
``state_dict`` (model and optimizer state dicts for DDP, fully_shard, TP), ``stateful``,
``filesystem``, ``format_utils`` (single-file export/import) and ``cli``.
The format and its guarantees: docs/checkpoint.md.
"""

from ringlet.checkpoint._api import DefaultLoadPlanner, DefaultSavePlanner, async_save, load, save
from ringlet.checkpoint._deprecated import load_state_dict, save_state_dict
from ringlet.checkpoint._errors import CheckpointException
from ringlet.checkpoint._metadata import Metadata
from ringlet.checkpoint.filesystem import FileSystemReader, FileSystemWriter
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
    "load_state_dict",
    "save",
    "save_state_dict",
]
