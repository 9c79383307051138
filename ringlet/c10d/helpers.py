"""torch.distributed's small helpers: ``breakpoint``, ``is_torchelastic_launched``,
``get_node_local_rank`` and ``default_pg_timeout``."""

from __future__ import annotations

import os
import pdb  # noqa: T100 - dist.breakpoint() is a debugger entry point by design
import sys
from datetime import timedelta
from typing import Any

from ringlet import _env
from ringlet.c10d.collectives import monitored_barrier
from ringlet.c10d.world import get_rank

__all__ = ["breakpoint", "default_pg_timeout", "get_node_local_rank", "is_torchelastic_launched"]

# ringlet's default deadline of blocking calls (``RINGLET_TIMEOUT`` changes what groups get).
default_pg_timeout = timedelta(seconds=_env.DEFAULT_TIMEOUT_S)

_breakpoint_hits = [0]


def is_torchelastic_launched() -> bool:
    """Whether this process was started by ``ringlet-run`` or torchrun (``TORCHELASTIC_RUN_ID``)."""
    return os.environ.get("TORCHELASTIC_RUN_ID") is not None


def get_node_local_rank(fallback_rank: int | None = None) -> int:
    """This process's rank on its node (``LOCAL_RANK``), else ``fallback_rank``.

    Raises:
        RuntimeError: ``LOCAL_RANK`` is unset and no ``fallback_rank`` is given.
        ValueError: ``LOCAL_RANK`` is not an integer.
    """
    raw = os.environ.get("LOCAL_RANK")
    if raw is not None:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"LOCAL_RANK: expected an integer, got {raw!r}") from None
    if fallback_rank is not None:
        return int(fallback_rank)
    raise RuntimeError("get_node_local_rank: LOCAL_RANK is not set (start with ringlet-run or "
                       "torchrun) and no fallback_rank was given")


class _Pdb(pdb.Pdb):
    """pdb on the terminal even in a worker whose stdin is not the user's (launcher children)."""

    def interaction(self, *args: Any, **kwargs: Any) -> None:
        saved = sys.stdin
        try:
            with open("/dev/stdin") as tty:
                sys.stdin = tty
                super().interaction(*args, **kwargs)
        finally:
            sys.stdin = saved


def breakpoint(rank: int = 0, skip: int = 0, timeout_s: float = 3600) -> None:
    """Stop rank ``rank`` in pdb while the other ranks wait for it (up to ``timeout_s``).

    Every rank of the world calls it.  ``skip``: let the first ``skip`` calls pass.

    Example::

        dist.breakpoint()          # rank 0 debugs; the others wait at a barrier
    """
    _breakpoint_hits[0] += 1
    if _breakpoint_hits[0] <= skip:
        return
    if get_rank() == rank:
        debugger = _Pdb()
        debugger.message(f"\n!!! ATTENTION !!!\n\nType 'up' to get to the frame that called "
                         f"dist.breakpoint(rank={rank})\n")
        debugger.set_trace(sys._getframe(1))
    monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
