"""Debugging aids: call sites, the DETAIL cross-rank check, hang reports, ``agree`` and ``stats``.

[Note: hang reports]
Every process runs one watchdog thread per world.  It polls the world store's
``hang/req`` counter (4 times a second; a store round trip each).  A rank whose
collective passes its deadline increments the counter and waits up to
``REPORT_WAIT`` seconds for every rank of the group to publish its state
(``hang/state/<rank>``: its Python stack's innermost user frame and, per group,
the last collectives it issued and completed).  Watchdogs answer even when
their rank is busy elsewhere -- in ``evaluate()``, say -- which is exactly the
rank the others are waiting for.  The merged report names who waits where,
who is missing, and the line the missing rank is executing.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import socket
import sys
import threading
import time
import traceback
from types import FrameType
from typing import TYPE_CHECKING, Any

from ringlet import _env

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

log = logging.getLogger("ringlet")

REPORT_WAIT = 2.0       # seconds a timed-out rank waits for its peers' states
POLL_PERIOD = 0.25      # watchdog period

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SKIP = [_PKG_DIR + os.sep]
try:
    import torch as _torch

    _SKIP.append(os.path.dirname(os.path.abspath(_torch.__file__)) + os.sep)
except Exception:  # noqa: BLE001, S110 - torch is always there in practice
    pass
_STDLIB = os.path.dirname(os.path.abspath(os.__file__)) + os.sep


def user_frame(frame: FrameType | None) -> str | None:
    """``file:line in func()`` of the innermost frame outside ringlet, torch and the stdlib."""
    fallback = None
    while frame is not None:
        fn = frame.f_code.co_filename
        if not any(fn.startswith(d) for d in _SKIP):
            where = f"{_short(fn)}:{frame.f_lineno} in {frame.f_code.co_name}()"
            if not fn.startswith(_STDLIB) and "site-packages" not in fn:
                return where
            fallback = fallback or where
        frame = frame.f_back
    return fallback


def callsite() -> str | None:
    """The user's line that called into ringlet (for DETAIL mode)."""
    return user_frame(sys._getframe(1))


def _short(path: str) -> str:
    cwd = os.getcwd() + os.sep
    return path.removeprefix(cwd)


class DebugLevel(enum.IntEnum):
    """torch's debug levels: ``OFF``; ``INFO`` (set-up and per-group summaries are logged);
    ``DETAIL`` (every collective's arguments are compared across ranks before it runs)."""

    OFF = 0
    INFO = 1
    DETAIL = 2


_level: list[DebugLevel | None] = [None]     # set_debug_level's choice; None: the environment's


def get_debug_level() -> DebugLevel:
    """The debug level: what ``set_debug_level`` chose, else ``RINGLET_DEBUG`` /
    ``TORCH_DISTRIBUTED_DEBUG`` (``set_debug_level_from_env`` returns to the environment's)."""
    level = _level[0]
    return level if level is not None else DebugLevel[_env.debug_level()]


def set_level(level: DebugLevel | int | str | None) -> DebugLevel:
    """Record the process's debug level (None: read the environment again); returns it."""
    if level is None:
        _level[0] = None
        return get_debug_level()
    if isinstance(level, str):
        try:
            value = DebugLevel[level.strip().upper()]
        except KeyError:
            raise ValueError("set_debug_level: expected OFF, INFO or DETAIL, got "
                             f"{level!r}") from None
    else:
        try:
            value = DebugLevel(int(level))
        except (ValueError, TypeError):
            raise ValueError(f"set_debug_level: expected a DebugLevel, got {level!r}") from None
    _level[0] = value
    setup_logging(value.name)
    return value


def detail_enabled() -> bool:
    return get_debug_level() == DebugLevel.DETAIL


def setup_logging(level: str) -> None:
    """Route ringlet's log to stderr at ``TORCH_CPP_LOG_LEVEL``'s level, or INFO when the debug
    level asks for more."""
    wanted = _env.log_level()
    if level != "OFF":
        wanted = min(wanted or logging.INFO, logging.INFO)
    if wanted is None:
        return
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[ringlet %(levelname)s] %(message)s"))
        log.addHandler(handler)
    log.setLevel(wanted)


# -- watchdog -----------------------------------------------------------------------------
class Watchdog:
    """Answers hang-report requests for one world (see [Note: hang reports])."""

    def __init__(self, store: Any, rank: int, thread_ident: int,
                 groups: list[ProcessGroup]) -> None:
        self._store = store
        self._rank = rank
        self._ident = thread_ident
        self._groups = groups          # the world's live list of groups
        self._seen = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ringlet-watchdog-r{rank}",
                                        daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        period = _env.straggler_report_period()
        next_report = time.monotonic() + period
        last: dict[str, tuple[float, float]] = {}    # group -> (time, wait_s) at its last line
        while not self._stop.wait(POLL_PERIOD):
            try:
                req = int(self._store.add("hang/req", 0))
                if req > self._seen:
                    self._seen = req
                    self._store.set(f"hang/state/{self._rank}", json.dumps(self.state(req)))
            except Exception:  # noqa: BLE001 - the store is gone: the job is ending
                if self._stop.is_set():
                    return
            now = time.monotonic()
            if period and now >= next_report:
                next_report = max(next_report + period, now)   # no burst after a stall
                for pg in list(self._groups):
                    self._log_waiting(pg, last)

    def _log_waiting(self, pg: ProcessGroup, last: dict[str, tuple[float, float]]) -> None:
        """RINGLET_STRAGGLER_REPORT: one local line per group -- how much of the time since its
        previous line (measured, not the nominal period) this rank waited, and on whom."""
        now = time.monotonic()
        wait_s, late = pg.wait_stats()      # includes a wait still in progress
        then, before = last.get(pg.group_name, (pg.created, 0.0))
        last[pg.group_name] = (now, wait_s)
        share = waiting_share(wait_s - before, now - then)
        worst = max(late.items(), key=lambda kv: kv[1], default=None)
        who = f"; mostly on rank {pg.ranks[worst[0]]} ({worst[1]:.2f} s in all)" if worst else ""
        log.warning("rank %d, group %s: waiting for peers was %.0f%% of the last %.1f s%s",
                    self._rank, pg.group_desc, 100 * share, now - then, who)

    def state(self, req: int) -> dict[str, Any]:
        frame = sys._current_frames().get(self._ident)
        full = _env.show_stacktraces()
        stack = (traceback.format_stack(frame, limit=None if full else 12) if frame is not None
                 else [])
        return {
            "req": req, "rank": self._rank, "pid": os.getpid(), "host": socket.gethostname(),
            "where": user_frame(frame), "stack": "".join(stack)[-(20000 if full else 3000):],
            "groups": {pg.group_name: pg.debug_state() for pg in list(self._groups)},
        }

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(POLL_PERIOD * 4 + 1.0)


def hang_report(store: Any, pg: ProcessGroup, err: BaseException) -> str:
    """Ask every rank of ``pg`` for its state and merge the answers into one report.

    Bounded: the store may itself be unreachable (a cut link), and its calls wait for the store's
    own timeout, so the collection runs on a helper thread that gets ``REPORT_WAIT + 1`` seconds.
    """
    box: list[str] = []
    worker = threading.Thread(target=lambda: box.append(_collect_report(store, pg, err)),
                              name="ringlet-hang-report", daemon=True)
    worker.start()
    worker.join(REPORT_WAIT + 1.0)
    return (box[0] if box
            else f"(no hang report: the store did not answer within {REPORT_WAIT + 1.0:.0f} s)")


def _collect_report(store: Any, pg: ProcessGroup, err: BaseException) -> str:
    try:
        req = int(store.add("hang/req", 1))
    except Exception as e:  # noqa: BLE001
        return f"(no hang report: the store is unreachable: {e})"
    deadline = time.monotonic() + REPORT_WAIT
    states: dict[int, dict[str, Any]] = {}
    while len(states) < pg.size() and time.monotonic() < deadline:
        for gr, r in enumerate(pg.ranks):
            if gr in states:
                continue
            try:
                if store.check([f"hang/state/{r}"]):
                    s = json.loads(store.get(f"hang/state/{r}"))
                    if s["req"] >= req:
                        states[gr] = s
            except Exception:  # noqa: BLE001
                return "(no hang report: the store failed while collecting it)"
        time.sleep(0.05)
    return format_report(pg, states, list(getattr(err, "context", {}).get("missing", [])))


def format_report(pg: ProcessGroup, states: dict[int, dict[str, Any]], missing: list[int]) -> str:
    lines = [f"hang report for group {pg.group_desc} ({pg.size()} ranks):"]
    waiting: dict[str, list[int]] = {}
    for gr in range(pg.size()):
        s = states.get(gr)
        who = f"rank {gr}" if pg.ranks[gr] == gr else f"rank {gr} (global {pg.ranks[gr]})"
        if s is None:
            lines.append(f"  {who}: no answer within {REPORT_WAIT:.0f} s "
                         "(dead, or stuck outside Python)")
            continue
        g = s["groups"].get(pg.group_name, {})
        seq, done = g.get("seq", 0), g.get("done", 0)
        descs = {h[0]: h[1] for h in g.get("history", [])}
        host = f"pid {s['pid']} on {s['host']}"
        if seq > done:
            what = f"waiting in {descs.get(seq, f'#{seq}')}"
            waiting.setdefault(descs.get(seq, f"#{seq}"), []).append(gr)
        else:
            what = f"completed {descs.get(done, f'#{done}')}, in no collective of this group"
        lines.append(f"  {who} ({host}): {what}; at {s.get('where') or '?'}")
    summary = []
    for desc, ranks in waiting.items():
        summary.append(f"ranks {ranks} wait in {desc}")
    for gr in missing:
        s = states.get(gr)
        if s is None:
            summary.append(f"rank {gr} did not answer")
            continue
        g = s["groups"].get(pg.group_name, {})
        summary.append(f"rank {gr} completed #{g.get('done', 0)} and is at {s.get('where') or '?'}")
    if summary:
        lines.insert(1, "  => " + "; ".join(summary))
    if _env.show_stacktraces():        # TORCH_SHOW_CPP_STACKTRACES=1: every rank's stack, in full
        for gr, s in sorted(states.items()):
            stack = "".join(f"    {ln}\n" for ln in s.get("stack", "").splitlines())
            lines.append(f"  stack of rank {gr}:\n" + stack.rstrip())
    return "\n".join(lines)


def monitored_barrier_error(pg: ProcessGroup, err: Any, seconds: float | None,
                            wait_all_ranks: bool) -> Any:
    """``err`` (a barrier timeout naming the missing ranks) with torch's text first, which scripts
    search for: on the group's first rank "Rank 2 failed to pass monitoredBarrier in 2000 ms"
    ("Ranks 1, 2 ..." with ``wait_all_ranks``); on the others "Rank 1 successfully reached
    monitoredBarrier, but received errors while waiting for send/recv from rank 0"; with no time
    to wait at all, "Rank 0 timed out in monitoredBarrier after 0 ms".  ringlet's own report
    (every missing rank, where each one is) follows on the next lines."""
    context = dict(getattr(err, "context", {}))
    missing = [pg.ranks[r]
               for r in context.get("missing", []) if isinstance(r, int) and 0 <= r < pg.size()]
    me = pg.ranks[pg.rank()]
    ms = round(1000 * (seconds if seconds is not None else pg.timeout))
    if seconds is not None and seconds <= 0 or (pg.rank() == 0 and not missing):
        head = f"Rank {me} timed out in monitoredBarrier after {ms} ms"
    elif pg.rank() != 0:
        head = (f"Rank {me} successfully reached monitoredBarrier, but received errors while "
                f"waiting for send/recv from rank {pg.ranks[0]}")
    elif wait_all_ranks:
        head = f"Ranks {', '.join(map(str, missing))} failed to pass monitoredBarrier in {ms} ms"
    else:
        head = f"Rank {missing[0]} failed to pass monitoredBarrier in {ms} ms"
    return type(err)(f"{head}\n{err}", **context)


# -- DETAIL: check every collective's arguments across ranks before running it ---------------
_SHAPED_OPS = {"all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter"}
_DETAIL_BYTES = 1024


def detail_check(pg: ProcessGroup, ctx: Any, result: Any) -> None:
    """Exchange a description of this call with every rank; raise if any
    differs (both call sites)."""
    import torch

    from ringlet.errors import CollectiveMismatchError
    from ringlet.transport.base import OpContext

    shapes = [list(t.shape) for t in _tensors(result)] if ctx.op in _SHAPED_OPS else None
    me = {"op": ctx.op, "seq": ctx.seq, "dtype": str(ctx.dtype), "root": ctx.root,
          "redop": ctx.redop, "numel": ctx.numel if ctx.op != "all_to_all" else None,
          "shapes": shapes}
    blob = json.dumps({**me, "at": ctx.callsite}).encode()[:_DETAIL_BYTES]
    buf = torch.zeros(_DETAIL_BYTES, dtype=torch.uint8)
    buf[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    out = torch.empty(pg.size() * _DETAIL_BYTES, dtype=torch.uint8)
    dctx = OpContext("debug_check", ctx.seq, ctx.rank, ctx.world_size, ctx.group, ctx.timeout,
                     dtype=torch.uint8, numel=_DETAIL_BYTES)
    pg.transport.all_gather(buf, out, dctx)
    calls = []
    for r in range(pg.size()):
        raw = bytes(out[r * _DETAIL_BYTES:(r + 1) * _DETAIL_BYTES].numpy()).rstrip(b"\0")
        calls.append(json.loads(raw.decode("utf-8", "replace")) if raw else {})
    keys = ("op", "seq", "dtype", "root", "redop", "numel", "shapes")
    if any(tuple(c.get(k) for k in keys) != tuple(me[k] for k in keys) for c in calls):
        lines = [f"rank {r}: {_describe_call(c)}" for r, c in enumerate(calls)]
        raise ctx.error(CollectiveMismatchError, "ranks called different collectives "
                        "(RINGLET_DEBUG=DETAIL):\n  "
                        + "\n  ".join(lines), calls=lines)


def _tensors(result: Any) -> list[Any]:
    import torch

    out: list[Any] = []
    for x in result if isinstance(result, (list, tuple)) else [result]:
        if isinstance(x, torch.Tensor):
            out.append(x)
        elif isinstance(x, (list, tuple)):
            out += _tensors(x)
    return out


def _describe_call(c: dict[str, Any]) -> str:
    if not c:
        return "(no description)"
    shapes = c.get("shapes")
    shape = "x".join(map(str, shapes[0])) if shapes else str(c.get("numel"))
    extra = f" root {c['root']}" if c.get("root", -1) >= 0 else ""
    dtype = c["dtype"].replace("torch.", "")
    return f"{c['op']} #{c['seq']} {dtype}[{shape}]{extra} at {c.get('at') or '?'}"


# -- per-group statistics ------------------------------------------------------------------
def group_stats(pg: ProcessGroup) -> dict[str, Any]:
    wait_s, late = pg.wait_stats()
    counts = pg.counts()
    return {
        "group": pg.group_desc, "ranks": pg.ranks, "collectives": sum(counts.values()),
        "by_op": counts, "elements": pg.elements(), "wait_s": wait_s,
        "late_s": {pg.ranks[r]: s for r, s in late.items()},
    }


def waiting_share(waited: float, interval: float) -> float:
    """The share of ``interval`` seconds spent waiting, clamped to [0, 1] (a wait that ended just
    after one reading and was counted in progress by it can make two readings overlap a little)."""
    if interval <= 0:
        return 0.0
    return min(1.0, max(0.0, waited / interval))


def straggler_lines(stats_by_rank: list[dict[str, Any]]) -> list[str]:
    """Who the others wait for, from every rank's stats of one group (gathered); each rank's
    entry carries ``interval_s`` (its time since its previous report) and ``wait_share``."""
    n = max(1, max(s["collectives"] for s in stats_by_rank))
    blame: dict[int, float] = {}
    for s in stats_by_rank:
        for r, sec in s["late_s"].items():
            blame[int(r)] = blame.get(int(r), 0.0) + sec / max(1, len(stats_by_rank) - 1)
    lines = []
    for r, sec in sorted(blame.items(), key=lambda kv: -kv[1]):
        if sec > 0:
            lines.append(f"rank {r} arrives {sec / n * 1e3:.1f} ms late on "
                         f"average (over {n} collectives)")
    for rank, s in enumerate(stats_by_rank):
        if s["interval_s"] > 0:
            lines.append(f"rank {rank}: waiting is {100 * s['wait_share']:.0f}% of the "
                         f"last {s['interval_s']:.1f} s")
    return lines
