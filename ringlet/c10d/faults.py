"""Test-only fault injection, enabled by ``RINGLET_FAULT`` (docs/reliability.md#fault-injection).

Spec: ``rank=<global rank>;at=collective:seq=<n>;do=<action>`` where action is
one of ``sigkill``, ``sigterm``, ``sigstop``, ``abort`` (``os.abort()``),
``exit0``, ``exit1`` (``sys.exit``), ``sleep:<seconds>`` or ``raise``.  Several
specs may be joined with ``|``.  Without the variable nothing is checked on the
hot path but one ``is None`` test.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time

from ringlet import _env
from ringlet.transport.base import OpContext

__all__ = ["Fault", "parse", "parse_for"]

_ACTIONS = ("sigkill", "sigterm", "sigstop", "abort", "exit0", "exit1", "sleep", "raise")


@dataclasses.dataclass(frozen=True, slots=True)
class Fault:
    rank: int
    seq: int
    action: str
    arg: float = 0.0

    def maybe_fire(self, ctx: OpContext) -> None:
        if ctx.seq != self.seq:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        if self.action == "sigkill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "abort":
            os.abort()
        elif self.action == "exit0":
            os._exit(0)
        elif self.action == "exit1":
            os._exit(1)
        elif self.action == "sleep":
            time.sleep(self.arg)
        elif self.action == "raise":
            raise RuntimeError("RINGLET_FAULT: injected error on rank "
                               f"{self.rank} at {ctx.op} #{ctx.seq}")


def parse(spec: str) -> list[Fault]:
    faults = []
    for part in spec.split("|"):
        fields = dict(kv.split("=", 1) for kv in part.split(";") if "=" in kv)
        try:
            at = fields["at"]
            if not at.startswith("collective:seq="):
                raise ValueError
            action, _, arg = fields["do"].partition(":")
            if action not in _ACTIONS:
                raise ValueError
            faults.append(Fault(int(fields["rank"]), int(at.split("=", 1)[1]), action,
                                float(arg or 0)))
        except (KeyError, ValueError):
            raise ValueError("RINGLET_FAULT: expected 'rank=R;at=collective:seq=N;do=ACTION' with "
                             f"ACTION in {_ACTIONS}, got {part!r}") from None
    return faults


def parse_for(global_rank: int) -> Fault | None:
    """The fault this rank must inject, if ``RINGLET_FAULT`` names it (first match)."""
    spec = _env.fault_spec()
    if not spec:
        return None
    for fault in parse(spec):
        if fault.rank == global_rank:
            return fault
    return None
