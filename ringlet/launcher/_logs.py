"""Where each worker's output goes (pure): torchrun's ``--log-dir``, ``-r/--redirects``,
``-t/--tee`` and ``--local-ranks-filter``.

A stream spec names the streams of each local rank, as torchrun's: ``1`` stdout, ``2`` stderr,
``3`` both, ``0`` none -- for every local rank (``"3"``) or per local rank (``"0:1,1:2"``; ranks not
named get ``0``).  For each worker and stream:

* the **log file** ``<root>/attempt_<n>/<local rank>/stdout.log`` (or ``stderr.log``) receives it
  when ``--log-dir`` is given, or the stream is redirected or teed (then, without ``--log-dir``,
  the root is a fresh temporary directory, printed at start);
* the **console** receives it, with a ``[rank<r>]:`` prefix (coloured on a terminal), unless it
  is redirected (``-r``) or the local rank is outside ``--local-ranks-filter``.
"""

from __future__ import annotations

import dataclasses
import os

__all__ = ["StreamPlan", "log_paths", "parse_ranks_filter", "parse_std", "stream_plan",
           "wants_files"]

STDOUT, STDERR = 1, 2


def parse_std(spec: str, flag: str = "--redirects") -> tuple[int, dict[int, int]]:
    """(bits for every local rank, per-rank bits) of a stream spec.

    Raises:
        ValueError: worded "expected ..., got ..." naming the flag.

    Example::

        >>> parse_std("3"), parse_std("0:1,1:2")
        ((3, {}), (0, {0: 1, 1: 2}))
    """
    text = spec.strip()
    expected = f"expected {flag} as 0-3 or LOCAL_RANK:0-3 pairs such as 0:1,1:2, got {spec!r}"
    if ":" not in text:
        if text not in ("0", "1", "2", "3"):
            raise ValueError(expected)
        return int(text), {}
    per: dict[int, int] = {}
    for part in text.split(","):
        rank, sep, bits = part.strip().partition(":")
        if not sep or not rank.isdigit() or bits not in ("0", "1", "2", "3"):
            raise ValueError(expected)
        per[int(rank)] = int(bits)
    return 0, per


def _bits(spec: str, local_rank: int) -> int:
    every, per = parse_std(spec)
    return per.get(local_rank, every)


def parse_ranks_filter(text: str) -> frozenset[int] | None:
    """``--local-ranks-filter``: the local ranks shown on the console (None: all)."""
    if not text.strip():
        return None
    try:
        ranks = frozenset(int(r) for r in text.split(","))
    except ValueError:
        raise ValueError("expected --local-ranks-filter as comma-separated local ranks "
                         f"such as 0,1, got {text!r}") from None
    if any(r < 0 for r in ranks):
        raise ValueError(f"expected --local-ranks-filter ranks >= 0, got {text!r}")
    return ranks


@dataclasses.dataclass(frozen=True)
class StreamPlan:
    """Sinks of one worker's stdout and stderr."""

    console_out: bool
    console_err: bool
    file_out: bool
    file_err: bool


def wants_files(log_dir: str | None, redirects: str, tee: str) -> bool:
    """Whether any worker writes log files (so that a log root is needed)."""
    if log_dir:
        return True
    specs = [parse_std(spec) for spec in (redirects, tee)]
    return any(every or any(per.values()) for every, per in specs)


def stream_plan(local_rank: int, log_dir: str | None, redirects: str, tee: str,
                ranks_filter: str) -> StreamPlan:
    """Where the worker of ``local_rank`` sends each stream (see the module docstring)."""
    r, t = _bits(redirects, local_rank), _bits(tee, local_rank)
    shown = parse_ranks_filter(ranks_filter)
    visible = shown is None or local_rank in shown
    files = (STDOUT | STDERR) if log_dir else (r | t)
    return StreamPlan(
        console_out=visible and not r & STDOUT,
        console_err=visible and not r & STDERR,
        file_out=bool(files & STDOUT),
        file_err=bool(files & STDERR),
    )


def log_paths(root: str, attempt: int, local_rank: int) -> tuple[str, str]:
    """(stdout.log, stderr.log) of one worker in one attempt, under the run's log root."""
    folder = os.path.join(root, f"attempt_{attempt}", str(local_rank))
    return os.path.join(folder, "stdout.log"), os.path.join(folder, "stderr.log")
