"""How the ranks of a save or load agree: JSON over tensor collectives, or over the store.

Nothing here pickles: plans, results and error messages travel as UTF-8 JSON in uint8
tensors.  :meth:`Coordinator.agree` is the rule that keeps every rank's outcome the
same -- each rank contributes its error (or none) and every rank raises the same
:class:`CheckpointException` if any rank failed, so no rank waits in a later
collective for a peer that gave up.

Three kinds: over a process group (``save``/``load``), trivial for one process without a
process group, and over the rendezvous store for the background half of
``async_save`` (which must not issue collectives on the user's groups while the
training loop does).
"""

from __future__ import annotations

import json
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d import collectives as C
from ringlet.c10d import world as _world
from ringlet.checkpoint._errors import CheckpointException

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup

__all__ = ["Coordinator", "coordinator_for"]


class Coordinator:
    """One process, no process group (the base behaviour for a world of one)."""

    rank = 0
    size = 1

    def all_gather_json(self, obj: Any) -> list[Any]:
        return [json.loads(json.dumps(obj))]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        if data is None:
            raise AssertionError("broadcast_bytes: rank 0 must provide the data")
        return data

    def agree(self, op: str, error: str | None) -> None:
        """Raise the same :class:`CheckpointException` on every rank if any rank has an error."""
        errors = self.all_gather_json(error)
        failures = {r: e for r, e in enumerate(errors) if e is not None}
        if failures:
            raise CheckpointException(op, failures)


class GroupCoordinator(Coordinator):
    def __init__(self, pg: ProcessGroup) -> None:
        self.pg = pg
        self.rank = pg.rank()
        self.size = pg.size()

    def all_gather_json(self, obj: Any) -> list[Any]:
        data = json.dumps(obj, separators=(",", ":"), allow_nan=False).encode("utf-8")
        sizes = torch.zeros(self.size, dtype=torch.int64)
        C.all_gather_into_tensor(sizes, torch.tensor([len(data)], dtype=torch.int64), group=self.pg)
        width = max(1, int(sizes.max()))
        mine = torch.zeros(width, dtype=torch.uint8)
        if data:
            mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(self.size * width, dtype=torch.uint8)
        C.all_gather_into_tensor(out, mine, group=self.pg)
        return [json.loads(out[r * width:r * width + int(n)].numpy().tobytes())
                for r, n in enumerate(sizes.tolist())]

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        src = self.pg.ranks[0]
        n = torch.tensor([len(data) if data is not None else -1], dtype=torch.int64)
        C.broadcast(n, src=src, group=self.pg)
        if int(n) < 0:
            raise AssertionError("broadcast_bytes: rank 0 must provide the data")
        buf = torch.zeros(int(n), dtype=torch.uint8)
        if self.rank == 0 and data:
            buf[:] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        C.broadcast(buf, src=src, group=self.pg)
        return buf.numpy().tobytes()


class StoreCoordinator(Coordinator):
    """All-gather through store keys under ``prefix`` (unique per save), with a deadline."""

    def __init__(self, store: Any, rank: int, size: int, prefix: str, timeout: float) -> None:
        self.store, self.rank, self.size = store, rank, size
        self.prefix, self.timeout = prefix, timeout
        self._round = 0

    def all_gather_json(self, obj: Any) -> list[Any]:
        self._round += 1
        keys = [f"{self.prefix}/{self._round}/{r}" for r in range(self.size)]
        self.store.set(keys[self.rank], json.dumps(obj, separators=(",", ":"), allow_nan=False))
        start = time.monotonic()
        try:
            self.store.wait(keys, timedelta(seconds=self.timeout))
        except Exception as e:  # noqa: BLE001 - re-raised with the ranks that never answered
            missing = [r for r, k in enumerate(keys) if not self.store.check([k])]
            raise CheckpointException("async_save", {self.rank: (
                f"ranks {missing} did not report within {time.monotonic() - start:.1f} s "
                f"({type(e).__name__}: {e})")}) from None
        return [json.loads(self.store.get(k)) for k in keys]


def coordinator_for(process_group: GroupArg, op: str) -> Coordinator:
    """The coordinator of ``process_group`` (default: the world; none: one process)."""
    if process_group is None and _world.current_world(required=False) is None:
        return Coordinator()
    pg = _world.resolve_group(process_group)
    if pg is None:
        raise ValueError(f"{op}: process_group: this rank is not a member of the group")
    return GroupCoordinator(pg)
