"""Helpers shared by ringlet's benchmarks: the command line, rank worlds (beside a torch gloo
group), sizes, statistics, tables, provenance.

Ranks are started by ``ringlet.testing.procs.run_world`` (a forkserver that preloads torch,
children that die with the parent, bounded joins, SIGKILL on a hang, a TCPStore hosted by
the parent on port 0), so a benchmark inherits the test harness's robustness.  A benchmark
script imports this module as ``_common`` (its own folder is first on ``sys.path``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import platform
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

T = TypeVar("T")

import torch

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
_UNITS = {"": 1, "B": 1, "K": KIB, "KB": KIB, "KIB": KIB, "M": MIB, "MB": MIB, "MIB": MIB,
          "G": GIB, "GB": GIB, "GIB": GIB}


# ---------------------------------------------------------------- command line


def parser(doc: str | None, *, ranks: int | None = 2,
           op_timeout: float | None = None) -> argparse.ArgumentParser:
    """A benchmark's command line, described by the first paragraph of ``doc`` (the script's
    docstring), with the options the benchmarks share: ``--ranks`` (default ``ranks``; None: the
    script has no such option), ``--markdown FILE`` and, given the collectives' default timeout
    ``op_timeout``, ``--op-timeout`` and ``--timeout`` (the whole run's backstop; default None:
    the script derives it from its work)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if ranks is not None:
        p.add_argument("--ranks", type=int, default=ranks)
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    if op_timeout is not None:
        p.add_argument("--op-timeout", type=float, default=op_timeout,
                       help="collective timeout, s")
        p.add_argument("--timeout", type=float, default=None, help="whole-run backstop, s")
    return p


def parse(p: argparse.ArgumentParser, argv: Sequence[str] | None,
          build: Callable[[argparse.Namespace], T]) -> T:
    """Parse ``argv`` and ``build`` the run's configuration from it; a ``ValueError`` raised while
    building (a bad value) is reported as a usage error naming it (exit status 2)."""
    args = p.parse_args(argv)
    try:
        return build(args)
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


def names(text: str, option: str, known: Sequence[str]) -> tuple[str, ...]:
    """A comma-separated list of names from ``known`` (``--ops a,b``); ``ValueError`` naming
    ``option`` for an empty list or an unknown name."""
    got = tuple(x.strip() for x in text.split(",") if x.strip())
    if not got or any(x not in known for x in got):
        raise ValueError(f"expected {option} from {','.join(known)}, got {text!r}")
    return got


# ---------------------------------------------------------------- sizes


def parse_size(text: str) -> int:
    """``"8"``, ``"4K"``, ``"1MiB"``, ``"256M"`` -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    unit = m.group(2).upper() if m else ""
    if m is None or unit not in _UNITS:
        raise ValueError(f"expected a size such as 8, 4K, 1M, 256MiB; got {text!r}")
    return int(m.group(1)) * _UNITS[unit]


def format_size(nbytes: int) -> str:
    """Bytes as the largest binary unit that divides them: ``8 B``, ``4 KiB``, ``256 MiB``."""
    for unit, scale in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def size_sweep(lo: int, hi: int, factor: int = 4) -> list[int]:
    """``lo, lo*factor, ...`` up to ``hi``; ``hi`` itself is always the last size."""
    if lo <= 0 or lo & (lo - 1):
        raise ValueError(f"expected a power of two for the smallest size, got {lo}")
    if hi < lo:
        raise ValueError(f"expected the largest size >= the smallest ({lo}), got {hi}")
    if factor < 2:
        raise ValueError(f"expected a size step factor >= 2, got {factor}")
    sizes = [lo]
    while sizes[-1] * factor <= hi:
        sizes.append(sizes[-1] * factor)
    if sizes[-1] != hi:
        sizes.append(hi)
    return sizes


# ---------------------------------------------------------------- statistics


def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("expected at least one sample, got none")
    return statistics.median(xs)


def iters_for(seconds_per_call: float, target_s: float, lo: int = 3, hi: int = 1_000_000) -> int:
    """How many back-to-back calls fill ``target_s`` seconds (at least ``lo``)."""
    if seconds_per_call <= 0:
        return hi
    return max(lo, min(hi, int(target_s / seconds_per_call + 0.5)))


# ---------------------------------------------------------------- rank worlds


def run_ranks(n: int, fn: Callable[..., Any], *args: Any, backend: str, timeout: float,
              op_timeout: float, env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(rank, n, *args)`` in ``n`` processes already joined in a ringlet default group.

    Returns each rank's return value; raises ``RuntimeError`` naming the first rank that
    failed.  Warns on stderr if ringlet shared-memory segments were left in /dev/shm.
    """
    from ringlet.testing.procs import raise_first, run_world

    before = _shm_segments()
    results = run_world(n, fn, *args, backend=backend, timeout=timeout, op_timeout=op_timeout,
                        env=env)
    leftovers = _shm_segments() - before
    if leftovers:
        print(f"warning: /dev/shm segments left behind: {sorted(leftovers)}", file=sys.stderr)
    try:
        return raise_first(results)
    except AssertionError as e:
        raise RuntimeError(str(e)) from None


def run_and_report(cfg: Any, rank_main: Callable[..., Any],
                   render: Callable[[Any, Any, bool], str],
                   preamble: Callable[[Any, dict[str, str], bool], str],
                   backend: str = "shm") -> int:
    """The whole of a ranks-beside-gloo benchmark's ``main``: print the preamble, run
    ``rank_main`` on ``cfg.ranks`` ranks (:func:`run_beside_gloo`), print rank 0's result with
    ``render`` and write it as Markdown to ``cfg.markdown`` when given; 1 when the run failed."""
    info = machine_info()
    print(preamble(cfg, info, False), flush=True)
    values = run_beside_gloo(cfg.ranks, rank_main, cfg, backend=backend, timeout=cfg.timeout,
                             op_timeout=cfg.op_timeout)
    if values is None:
        return 1
    emit(lambda md: render(cfg, values[0], md), lambda md: preamble(cfg, info, md),
         cfg.markdown)
    return 0


def run_beside_gloo(n: int, fn: Callable[..., Any], *args: Any, backend: str, timeout: float,
                    op_timeout: float) -> list[Any] | None:
    """:func:`run_ranks` of ``fn(rank, n, *args, gloo_init)``, where ``gloo_init`` lets each rank
    join a torch gloo group too (:func:`gloo_group`: a FileStore in a temporary folder; gloo on
    loopback unless ``GLOO_SOCKET_IFNAME`` says otherwise, as ringlet's shm is host-local).
    Returns every rank's value, or None after printing why the run failed."""
    env = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-") as tmp:
        try:
            return run_ranks(n, fn, *args, f"file://{tmp}/gloo-store", backend=backend,
                             timeout=timeout, op_timeout=op_timeout, env=env)
        except RuntimeError as e:
            print(f"benchmark failed: {e}", file=sys.stderr)
            return None


@contextlib.contextmanager
def gloo_group(init: str, rank: int, n: int, op_timeout: float) -> Iterator[Any]:
    """``torch.distributed``, joined to a gloo group of ``n`` ranks at ``init`` for the block (and
    left after it)."""
    import torch.distributed as tdist

    tdist.init_process_group("gloo", init_method=init, rank=rank, world_size=n,
                             timeout=timedelta(seconds=op_timeout))
    try:
        yield tdist
    finally:
        tdist.destroy_process_group()


def _shm_segments() -> set[str]:
    from ringlet.transport.shm import SHM_DIR, SHM_PREFIX

    try:
        return {f for f in os.listdir(SHM_DIR) if f.startswith(SHM_PREFIX)}
    except OSError:
        return set()


# ---------------------------------------------------------------- tables


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: first column left-aligned, the others right-aligned."""
    widths = [max(len(str(c)) for c in col) for col in zip(headers, *rows)]

    def line(cells: Sequence[str]) -> str:
        parts = [str(c).ljust(w) if i == 0 else str(c).rjust(w)
                 for i, (c, w) in enumerate(zip(cells, widths))]
        return "  ".join(parts).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A GitHub-flavoured Markdown table, numbers right-aligned."""
    head = "| " + " | ".join(headers) + " |"
    align = "|" + "|".join(["---"] + ["---:"] * (len(headers) - 1)) + "|"
    body = ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join([head, align, *body])


# ---------------------------------------------------------------- provenance


def emit(render: Callable[[bool], str], preamble: Callable[[bool], str],
         markdown_path: str | None) -> None:
    """Print the result tables; with ``markdown_path`` also write them as Markdown, headed by the
    provenance ``preamble``.  ``render(markdown)`` / ``preamble(markdown)`` produce the text."""
    print()
    print(render(False))
    if markdown_path:
        with open(markdown_path, "w") as f:
            f.write(preamble(True) + "\n" + render(True))
        print(f"wrote {markdown_path}")


def preamble(title: str, setup: Sequence[str], info: dict[str, str], markdown: bool) -> str:
    """The lines heading a result: the command, date, machine and software (``info``, from
    :func:`machine_info`), then the run's own ``setup`` lines; in Markdown, a list under the
    heading ``title``."""
    lines = [f"command: {command_line()}", f"date: {info['date']}",
             f"machine: nproc {info['nproc']}; {info['cpu']}; {info['os']}",
             f"software: torch {info['torch']}, python {info['python']}", *setup]
    if not markdown:
        return "\n".join(lines) + "\n"
    lines[0] = f"command: `{command_line()}`"
    return f"# {title}\n\n" + "\n".join(f"- {x}" for x in lines) + "\n"


def provenance(setup: str) -> str:
    """One line saying how and where a result was measured: the command, ``setup`` (the run's
    own parameters), the date, the CPU and torch's version."""
    info = machine_info()
    return (f"`{command_line()}` -- {setup}; {info['date']}, {info['cpu']} ({info['nproc']} "
            f"CPUs), torch {info['torch']}\n")


def command_line() -> str:
    """The command as typed, e.g. ``python bench/collectives.py --quick``."""
    return shlex.join(["python", *sys.argv])


def machine_info() -> dict[str, str]:
    """Where a result was measured: date, CPUs, CPU model, Python and torch versions."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 0
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "nproc": f"{usable} usable of {os.cpu_count()}",
        "cpu": _cpu_model(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "os": f"{platform.system()} {platform.release()} {platform.machine()}",
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# ---------------------------------------------------------------- background load

_BUSY = ("import os, signal\nsignal.signal(signal.SIGTERM, lambda *a: os._exit(0))\n"
         "while True:\n    pass\n")


@contextlib.contextmanager
def busy_load(n: int) -> Iterator[list[int]]:
    """``n`` unrelated processes spinning on the CPU while the block runs (``--load N``): what a
    data-loader worker, a second job or a compiler does to a training job's cores.  They are
    terminated (then killed) when the block ends, whatever happens in it."""
    procs = [subprocess.Popen([sys.executable, "-c", _BUSY]) for _ in range(max(0, n))]
    try:
        yield [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
