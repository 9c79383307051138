"""``split_group``: split a process group into disjoint subgroups (torch's signature).

torch implements it with NCCL's communicator split; here each split is an ordinary
group (``new_group``) over the parent's ranks, so it works on every transport.  Every
rank of the parent calls it with the same ``split_ranks``; ranks that appear in no
split get ``None``, as in torch.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from ringlet.c10d import _call, checks
from ringlet.c10d.world import new_group

__all__ = ["split_group"]


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
    mine = None
    seconds = timeout if timeout is not None else timedelta(seconds=parent.timeout)
    for split in splits:
        ranks = [parent.ranks[r] for r in split]
        desc = f"{group_desc}{ranks}" if group_desc else f"split{ranks}"
        g = new_group(ranks, timeout=seconds, backend=backend or parent.backend, group_desc=desc)
        if parent.rank() in split:
            mine = g
    return mine
