"""Subgroups: ``split_group``, ``new_subgroups``, ``new_subgroups_by_enumeration`` (torch's
signatures), each one group creation of the world ([Note: group creation] in ``_creation.py``).

torch implements it with NCCL's communicator split; here each split is an ordinary
group (``new_group``) over the parent's ranks, so it works on every transport.  Every
rank of the parent calls it with the same ``split_ranks``; ranks that appear in no
split get ``None``, as in torch.
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import TYPE_CHECKING, Any

from ringlet.c10d import _call, checks
from ringlet.c10d.world import (
    GroupMember,
    _members,
    create_groups,
    current_world,
    get_process_group_ranks,
)

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["new_subgroups", "new_subgroups_by_enumeration", "split_group"]


def _check_splits(split_ranks: Any, size: int) -> list[list[int]]:
    op = "split_group"
    if not isinstance(split_ranks, (list, tuple)) or not split_ranks:
        raise checks.fail(ValueError, op, "split_ranks", "expected a non-empty list of lists of "
                          f"group ranks, got {split_ranks!r}")
    seen: set[int] = set()
    out = []
    for i, split in enumerate(split_ranks):
        if not isinstance(split, (list, tuple)) or not split:
            raise checks.fail(ValueError, op, f"split_ranks[{i}]", "expected a non-empty list of "
                              f"group ranks, got {split!r}")
        ranks = [checks.root(r, size, op, f"split_ranks[{i}]") for r in split]
        twice = sorted(seen.intersection(ranks)) or sorted({r for r in ranks if ranks.count(r) > 1})
        if twice:
            raise checks.fail(ValueError, op, f"split_ranks[{i}]", "expected disjoint splits, got "
                              f"rank(s) {twice} more than once")
        seen.update(ranks)
        out.append(ranks)
    return out


def split_group(parent_pg: Any = None, split_ranks: list[list[int]] | None = None,
                timeout: timedelta | None = None, pg_options: Any = None,
                group_desc: str | None = None, backend: str | None = None) -> Any:
    """Create one new group per entry of ``split_ranks`` (group ranks of ``parent_pg``).

    Args:
        parent_pg: the group to split (default: the world).
        split_ranks: disjoint lists of the parent's *group* ranks, e.g. ``[[0, 1], [2, 3]]``.
        timeout: the new groups' deadline (default: the parent's).
        pg_options: accepted for torch's signature (ringlet's transports take no options).
        group_desc: a name for the new groups (suffixed with their ranks).
        backend: the new groups' backend (default: the parent's).

    Returns:
        The new group this rank belongs to, or ``None`` if it is in no split.

    Raises:
        ValueError: ``split_ranks`` is not a list of disjoint lists of ranks of the parent.

    Example::

        evens_odds = dist.split_group(split_ranks=[[0, 2], [1, 3]])
    """
    parent = _call.resolve(parent_pg, "split_group", quiet=True)
    if parent is None:
        return None
    splits = _check_splits(split_ranks, parent.size())
    seconds = timeout if timeout is not None else timedelta(seconds=parent.timeout)
    lists = [sorted(parent.ranks[r] for r in split) for split in splits]
    descs = [f"{group_desc or 'split'}{ranks}" for ranks in lists]
    made = create_groups(lists, seconds, backend or parent.backend, descs, scope=parent.ranks,
                         what="split_group")
    mine = None
    for split, g in zip(splits, made, strict=True):
        if parent.rank() in split:
            mine = g
    return mine


def new_subgroups(group_size: int | None = None, group: GroupArg = None,
                  timeout: timedelta | None = None,
                  backend: str | None = None, pg_options: Any = None,
                  group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Split ``group`` (default: the world) into consecutive subgroups of ``group_size`` ranks.

    Returns ``(the subgroup holding this rank, every subgroup)``, as torch does.  Every rank of
    ``group`` calls it with the same arguments; ``group_size`` defaults to ``LOCAL_WORLD_SIZE``
    (one subgroup per node under the launcher).

    Example::

        mine, everyone = dist.new_subgroups(2)      # world of 4: [0, 1] and [2, 3]
    """
    w = current_world()
    parent = list(range(w.world_size)) if group is None else get_process_group_ranks(group)
    size = group_size if group_size is not None else int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
    if isinstance(size, bool) or not isinstance(size, int) or size <= 0:
        raise ValueError(f"new_subgroups: group_size: expected a positive int, got {group_size!r}")
    if size > len(parent):
        raise ValueError(f"new_subgroups: group_size {size} must not exceed the group's size "
                         f"{len(parent)}")
    if len(parent) % size:
        raise ValueError(f"new_subgroups: group_size: expected a divisor of the group's size "
                         f"{len(parent)}, got {group_size}")
    lists = [parent[i:i + size] for i in range(0, len(parent), size)]
    return _by_enumeration(lists, timeout, backend, group_desc, parent, "new_subgroups")


def new_subgroups_by_enumeration(ranks_per_subgroup_list: list[list[int]],
                                 timeout: timedelta | None = None,
                                 backend: str | None = None, pg_options: Any = None,
                                 group_desc: str | None = None) -> tuple[Any, list[Any]]:
    """Make one group per list of global ranks; every rank of the world calls it with the same
    lists, in the same order.

    Returns:
        ``(the subgroup holding this rank or None, every subgroup)``; on ranks outside a subgroup
        its entry is ``GroupMember.NON_GROUP_MEMBER``.

    Raises:
        ValueError: a rank appears in more than one list.

    Example::

        mine, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])   # world of 4
    """
    seen: set[int] = set()
    for ranks in ranks_per_subgroup_list:
        if seen & set(ranks):
            raise ValueError(f"new_subgroups_by_enumeration: rank(s) {sorted(seen & set(ranks))} "
                             "appear in more than one subgroup")
        seen |= set(ranks)
    return _by_enumeration(ranks_per_subgroup_list, timeout, backend, group_desc, None,
                           "new_subgroups_by_enumeration")


def _by_enumeration(ranks_per_subgroup_list: list[list[int]], timeout: timedelta | None,
                    backend: str | None, group_desc: str | None, scope: list[int] | None,
                    what: str) -> tuple[Any, list[Any]]:
    w = current_world()
    lists = [_members(w, ranks) for ranks in ranks_per_subgroup_list]
    descs = [f"{group_desc or 'group'}{ranks}" for ranks in lists]
    subgroups = create_groups(lists, timeout, backend, descs, scope=scope, what=what)
    mine = None
    for g in subgroups:
        if g is not GroupMember.NON_GROUP_MEMBER:
            mine = g
    return mine, subgroups
