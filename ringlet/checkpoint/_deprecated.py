"""torch's deprecated names of :func:`~ringlet.checkpoint.save` and
:func:`~ringlet.checkpoint.load`: ``save_state_dict`` and ``load_state_dict``.

torch still ships them (older scripts call them) with a ``FutureWarning``; here they warn the
same way and delegate, so a script written against them runs unchanged.

Example::

    save_state_dict(sd, FileSystemWriter(path))      # FutureWarning: use save
    load_state_dict(sd, FileSystemReader(path))      # FutureWarning: use load
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from ringlet.checkpoint._api import DefaultLoadPlanner, DefaultSavePlanner, load, save
from ringlet.checkpoint._metadata import Metadata
from ringlet.checkpoint.filesystem import FileSystemReader, FileSystemWriter

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["load_state_dict", "save_state_dict"]


def _check_coordinator(coordinator_rank: Any, where: str) -> None:
    if isinstance(coordinator_rank, bool) or not isinstance(coordinator_rank, int) \
            or coordinator_rank < 0:
        raise ValueError(f"{where}: coordinator_rank: expected a rank (an int >= 0), "
                         f"got {coordinator_rank!r}")


def save_state_dict(state_dict: dict[str, Any], storage_writer: FileSystemWriter,
                    process_group: GroupArg = None, coordinator_rank: int = 0,
                    no_dist: bool = False, planner: DefaultSavePlanner | None = None) -> Metadata:
    """Deprecated: :func:`~ringlet.checkpoint.save` with ``storage_writer`` given positionally.

    Warns ``FutureWarning`` (as torch does), then saves.  ``coordinator_rank`` is accepted
    for torch's signature: the checkpoint written is the same whichever rank coordinates.

    Raises:
        ValueError: ``coordinator_rank`` is not a rank; and whatever ``save`` raises.
    """
    warnings.warn("`save_state_dict` is deprecated and will be removed in future versions. "
                  "Please use `save` instead.", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank, "save_state_dict")
    return save(state_dict, storage_writer=storage_writer, planner=planner,
                process_group=process_group, no_dist=no_dist)


def load_state_dict(state_dict: dict[str, Any], storage_reader: FileSystemReader,
                    process_group: GroupArg = None, coordinator_rank: int = 0,
                    no_dist: bool = False, planner: DefaultLoadPlanner | None = None) -> None:
    """Deprecated: :func:`~ringlet.checkpoint.load` with ``storage_reader`` given positionally.

    Warns ``FutureWarning`` (as torch does), then loads into ``state_dict`` in place.

    Raises:
        ValueError: ``coordinator_rank`` is not a rank; and whatever ``load`` raises.
    """
    warnings.warn("`load_state_dict` is deprecated and will be removed in future versions. "
                  "Please use `load` instead.", FutureWarning, stacklevel=2)
    _check_coordinator(coordinator_rank, "load_state_dict")
    load(state_dict, storage_reader=storage_reader, planner=planner,
         process_group=process_group, no_dist=no_dist)
