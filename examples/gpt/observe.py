"""Watching a run: where each rank's time goes, who the others wait for, a progress bar.

The per-rank breakdown reads ringlet's own counters (``ringlet.distributed.stats()``): for
every process group, the seconds this rank spent waiting for its peers inside collectives,
and for each peer how long it was the one being waited for, plus how many collectives ran
and how many elements they carried.  ``StepMeter`` brackets every training step with them.

Time in a step splits into *data* (building the batch), *comm wait* (blocked in a collective
because a peer had not arrived yet) and *compute* (everything else: forward, backward,
optimizer, and the copies and sums of the collectives themselves).  With DDP the gradient
all-reduce runs on a communication thread during backward, so part of its wait is hidden
behind compute: the columns then add up to a little more than the step.
"""

from __future__ import annotations

import dataclasses
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ringlet.distributed as dist

try:
    from tqdm import tqdm
except ImportError:      # the `examples` extra is not installed: plain lines instead of a bar
    tqdm = None


@dataclass
class Counters:
    """ringlet's communication counters of this rank, summed over its process groups."""

    wait_s: float = 0.0                                       # blocked, waiting for a peer
    late_s: dict[int, float] = field(default_factory=dict)    # rank -> seconds it was awaited
    by_op: dict[str, int] = field(default_factory=dict)      # collectives issued, per op
    elements: int = 0                                         # elements handed to them

    @classmethod
    def read(cls) -> Counters:
        c = cls()
        for s in dist.stats():                     # one dict per process group; local, no messages
            c.wait_s += s["wait_s"]
            _add(c.late_s, {int(r): sec for r, sec in s["late_s"].items()})
            _add(c.by_op, s["by_op"])
            c.elements += sum(s["elements"].values())
        return c


def _add(into: dict[Any, Any], other: dict[Any, Any], sign: int = 1) -> None:
    for k, v in other.items():
        into[k] = into.get(k, 0) + sign * v


@dataclass
class Window:
    """Sums over some steps on one rank (the last breakdown interval, or the whole run)."""

    steps: int = 0
    step_s: float = 0.0
    data_s: float = 0.0
    wait_s: float = 0.0
    elements: int = 0
    late_s: dict[int, float] = field(default_factory=dict)   # rank -> seconds I waited for it
    by_op: dict[str, int] = field(default_factory=dict)      # collectives per op name
    rss_mib: float = 0.0       # peak resident memory (set at the end)
    state_mib: float = 0.0     # parameters + gradients + optimizer state held by this rank

    def add(self, other: Window) -> None:
        self.steps += other.steps
        self.step_s += other.step_s
        self.data_s += other.data_s
        self.wait_s += other.wait_s
        self.elements += other.elements
        _add(self.late_s, other.late_s)
        _add(self.by_op, other.by_op)

    @property
    def collectives(self) -> int:
        return sum(self.by_op.values())

    def fractions(self) -> tuple[float, float, float]:
        """(compute, comm wait, data) as fractions of the step time."""
        total = max(self.step_s, 1e-9)
        compute = max(0.0, self.step_s - self.data_s - self.wait_s)
        return compute / total, self.wait_s / total, self.data_s / total


class StepMeter:
    """Times each step on this rank: ``start()``, ``data(seconds)`` per batch, ``stop()``."""

    def __init__(self) -> None:
        self.window = Window()     # since the last breakdown
        self.total = Window()      # the whole run (this process)
        self._t0 = 0.0
        self._c0 = Counters()

    def start(self) -> None:
        self._c0 = Counters.read()
        self._t0 = time.perf_counter()

    def data(self, seconds: float) -> None:
        self.window.data_s += seconds

    def stop(self) -> None:
        step_s = time.perf_counter() - self._t0
        now, w = Counters.read(), self.window
        w.steps += 1
        w.step_s += step_s
        w.wait_s += now.wait_s - self._c0.wait_s
        w.elements += now.elements - self._c0.elements
        _add(w.late_s, now.late_s)
        _add(w.late_s, self._c0.late_s, -1)
        _add(w.by_op, now.by_op)
        _add(w.by_op, self._c0.by_op, -1)
        w.late_s = {r: v for r, v in w.late_s.items() if v > 0}
        w.by_op = {op: n for op, n in w.by_op.items() if n}

    def take_window(self) -> Window:
        """The current window (added to the run's total) and a fresh one to fill."""
        w, self.window = self.window, Window()
        self.total.add(w)
        return w


def peak_rss_mib() -> float:
    """This process's peak resident memory (MiB): torch's libraries included (~300 MiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def state_mib(model: Any, optimizer: Any) -> float:
    """MiB of training state this rank holds: its parameters, as much again for their
    gradients, and the optimizer's state (local shards only, for sharded strategies)."""
    def local_bytes(t: Any) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()
    params = sum(local_bytes(p) for p in model.parameters())
    opt = sum(local_bytes(v) for s in optimizer.state.values() for v in s.values()
              if hasattr(v, "numel") and v.dim() > 0)
    return (2 * params + opt) / 2**20


def stragglers(windows: list[Window], threshold: float = 0.05) -> list[str]:
    """Name the rank the others wait for, if one stands out.

    Rank r's blame is how long the other ranks waited for it on average.  Two ranks always
    wait for each other a little (jitter); a straggler is a rank whose blame is over
    ``threshold`` of the others' step time and at least twice any other rank's blame.
    """
    n = len(windows)
    if n < 2:
        return []
    blame = [sum(w.late_s.get(r, 0.0) for i, w in enumerate(windows) if i != r) / (n - 1)
             for r in range(n)]
    worst = max(range(n), key=lambda r: blame[r])
    others = [w for i, w in enumerate(windows) if i != worst]
    their_time = sum(w.step_s for w in others) / len(others)
    runner_up = max((b for r, b in enumerate(blame) if r != worst), default=0.0)
    share = blame[worst] / max(their_time, 1e-9)
    if share <= threshold or blame[worst] < 2 * runner_up:
        return [(f"  no straggler: the others wait for any one rank at most {100 * share:.0f}% "
                "of their time")]
    steps = max(1, windows[worst].steps)
    return [(f"  straggler: rank {worst} - the others waited {blame[worst] / steps * 1e3:.1f} "
             f"ms/step for it ({100 * share:.0f}% of their time)")]


def breakdown_table(windows: list[Window], title: str) -> list[str]:
    """One line per rank: step time and how it splits, then the stragglers by name."""
    lines = [title, "  rank   step ms   compute   comm wait    data   collectives/step"]
    for r, w in enumerate(windows):
        c, k, d = w.fractions()
        n = max(1, w.steps)
        lines.append(f"  {r:>4}  {w.step_s / n * 1e3:8.1f}   {c:6.0%}    {k:7.0%}   {d:6.0%}   "
                     f"{w.collectives / n:9.1f}")
    return lines + stragglers(windows)


class Progress:
    """Rank 0's live view: a tqdm bar on a terminal, otherwise a plain line every few steps."""

    def __init__(self, total: int, start: int, tokens_per_step: int, mode: str = "auto",
                 every: int = 10, enabled: bool = True) -> None:
        if mode == "auto":     # ringlet-run sets RINGLET_CONSOLE_TTY when its console is a terminal
            on_terminal = sys.stdout.isatty() or os.environ.get("RINGLET_CONSOLE_TTY") == "1"
            mode = "bar" if tqdm is not None and on_terminal else "lines"
        if mode == "bar" and tqdm is None:
            mode = "lines"
        self.mode = mode if enabled else "off"
        self.total, self.every, self.tokens_per_step = total, every, tokens_per_step
        self.loss: float | None = None
        self._t0, self._step0 = time.perf_counter(), start
        self.bar = None
        if self.mode == "bar":
            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True,
                            file=sys.stdout,
                            bar_format="{l_bar}{bar}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}<{remaining}{postfix}]")

    def _rate(self, step: int) -> tuple[float, float]:
        """(tokens per second, seconds left) since this run started."""
        elapsed = max(time.perf_counter() - self._t0, 1e-9)
        done = step + 1 - self._step0
        return (done * self.tokens_per_step / elapsed,
                (self.total - step - 1) * elapsed / max(done, 1))

    def update(self, step: int, loss: float | None = None) -> None:
        """Step ``step`` (0-based) is done; ``loss`` is the latest known global training loss."""
        if loss is not None:
            self.loss = loss
        tok_s, eta = self._rate(step)
        loss_s = "-" if self.loss is None else f"{self.loss:.3f}"
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss_s}, {tok_s / 1e3:.1f}k tok/s", refresh=False)
            self.bar.update(1)
        elif self.mode == "lines" and ((step + 1) % self.every == 0 or step + 1 == self.total):
            print(f"step {step + 1:>5}/{self.total}  loss {loss_s}  {tok_s / 1e3:6.1f}k tok/s  "
                  f"ETA {_hms(eta)}", flush=True)

    def write(self, text: str) -> None:
        """Print above the bar (or plainly)."""
        if self.mode == "off":
            return
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _hms(seconds: float) -> str:
    m, s = divmod(int(seconds + 0.5), 60)
    return f"{m}m{s:02d}s" if m else f"{s}s"


def gather_windows(w: Window) -> list[Window]:
    """Every rank's window, on every rank (one all_gather_object on the default group)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, dataclasses.asdict(w))     # plain dicts travel anywhere
    return [Window(**d) for d in out]
