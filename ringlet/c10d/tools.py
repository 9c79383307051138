"""User-facing debugging helpers: ``agree``, ``stats``, ``report_stragglers``."""

from __future__ import annotations

import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import collectives as C
from ringlet.c10d import debug
from ringlet.c10d.objects import all_gather_object
from ringlet.c10d.reduce_op import ReduceOp
from ringlet.c10d.world import current_world, resolve_group

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["agree", "report_stragglers", "stats"]

# group -> (time, wait_s) at this rank's last report (by group object: ranks may be threads)
_last_report: weakref.WeakKeyDictionary[Any, tuple[float, float]] = weakref.WeakKeyDictionary()


def agree(flag: bool, op: str = "any", group: GroupArg = None) -> bool:
    """Make a rank-local decision the same on every rank: True if ``any`` (or ``all``) rank says so.

    The classic hang: ``if loss.isnan(): continue`` where only one rank sees the NaN; that rank
    skips the next all_reduce, the others wait in it forever.  Branch on ``agree`` instead::

        if dist.agree(bool(loss.isnan())):
            continue            # every rank skips this batch together

    One 1-byte all_reduce (MAX for "any", MIN for "all").
    """
    if op not in ("any", "all"):
        raise ValueError(f"agree: op: expected 'any' or 'all', got {op!r}")
    t = torch.tensor([1 if flag else 0], dtype=torch.uint8)
    C.all_reduce(t, op=ReduceOp.MAX if op == "any" else ReduceOp.MIN, group=group)
    return bool(t.item())


def stats(group: GroupArg = None) -> dict[str, Any] | list[dict[str, Any]]:
    """This rank's communication statistics: per group, collectives issued (by op), elements moved,
    seconds spent waiting for peers and, per peer, how long it was the one awaited.

    ``group=None`` returns a list for every group of the world; local, no communication.
    """
    if group is not None:
        pg = resolve_group(group)
        return debug.group_stats(pg) if pg is not None else {}
    w = current_world()
    return [debug.group_stats(pg) for pg in w.groups] if w is not None else []


def report_stragglers(group: GroupArg = None, print_on: int = 0) -> list[str]:
    """Gather every rank's stats of ``group`` (a collective: every rank calls it) and, on rank
    ``print_on``, print who arrives late and how much of the time since its previous report (or
    since the group was created) each rank spent waiting.  Returns the report lines (on every
    rank)."""
    pg = resolve_group(group)
    if pg is None:
        return []
    now = time.monotonic()
    mine = debug.group_stats(pg)
    then, waited = _last_report.get(pg, (pg.created, 0.0))
    _last_report[pg] = (now, mine["wait_s"])
    mine["interval_s"] = now - then
    mine["wait_share"] = debug.waiting_share(mine["wait_s"] - waited, now - then)
    everyone: list[Any] = [None] * pg.size()
    all_gather_object(everyone, mine, group=pg)
    lines = debug.straggler_lines(everyone)
    if pg.rank() == print_on:
        for line in lines:
            print(f"[ringlet stragglers, group {pg.group_desc}] {line}", flush=True)
    return lines
