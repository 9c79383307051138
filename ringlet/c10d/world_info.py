"""Questions about the current world and its groups that torch answers under these names, and
the debug-level setters (which switch the DETAIL check on the live groups).

``_get_default_group``, ``_rank_not_in_group``, ``_get_pg_config`` and ``_get_process_group_name``
are private in torch, but published code calls them (through ``distributed_c10d``), so they are
kept here with torch's meaning.
"""

from __future__ import annotations

from typing import Any

from ringlet.c10d import debug
from ringlet.c10d.debug import DebugLevel, get_debug_level
from ringlet.c10d.group import GroupArg, ProcessGroup
from ringlet.c10d.world import GroupMember, _member, current_world, resolve_group

__all__ = ["DebugLevel", "_get_default_group", "_get_pg_config", "_get_process_group_name",
           "_rank_not_in_group", "get_debug_level", "get_pg_count", "set_debug_level",
           "set_debug_level_from_env"]


def set_debug_level(level: DebugLevel | int | str) -> None:
    """Set the debug level of this process (``DebugLevel.OFF``/``INFO``/``DETAIL``).

    ``DETAIL`` turns on the cross-rank argument check of every collective, on groups that exist
    and on groups created later; every rank must choose the same level.
    """
    debug.set_level(level)
    _apply_to_groups()


def set_debug_level_from_env() -> None:
    """Read the level again from ``RINGLET_DEBUG`` / ``TORCH_DISTRIBUTED_DEBUG``."""
    debug.set_level(None)
    _apply_to_groups()


def _apply_to_groups() -> None:
    w = current_world(required=False)
    if w is None:
        return
    check = debug.detail_check if debug.detail_enabled() else None
    for pg in w.groups:
        pg.detail_check = check


def get_pg_count() -> int:
    """Number of process groups this rank belongs to (the default group included)."""
    w = current_world(required=False)
    return len(w.groups) if w is not None else 0


def _get_default_group() -> ProcessGroup:
    """The default group (what ``group.WORLD`` stands for).

    Raises:
        ValueError: no process group is initialized.
    """
    pg = resolve_group(None)
    if pg is None:  # pragma: no cover - a rank is always a member of its world
        raise AssertionError("no default group")
    return pg


def _rank_not_in_group(group: GroupArg) -> bool:
    """Whether this rank is outside ``group`` (None means the default group: False)."""
    return group is GroupMember.NON_GROUP_MEMBER


def _get_process_group_name(pg: ProcessGroup) -> str:
    """torch's name of a group: its ``group_name``.

    Raises:
        ValueError: ``pg`` is not a process group this rank belongs to.
    """
    return _member(pg, "_get_process_group_name").group_name


def _get_pg_config(group: GroupArg = None) -> dict[str, Any]:
    """torch's summary of a group: name, description, backend, size and global ranks."""
    pg = _member(group, "_get_pg_config")
    return {"pg_name": pg.group_name, "pg_desc": pg.group_desc, "backend_config": pg.backend,
            "pg_size": pg.size(), "ranks": pg.ranks, "transport": pg.transport_name}
