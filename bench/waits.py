"""Where the time of small collectives goes on a loaded machine: the arena's waits.

``bench/collectives.py --load N`` gives mean times per call; this script shows what makes them:
per-call times of an 8-byte op (2 ranks, shm), their distribution, the calls that lasted more
than a millisecond (a rank descheduled for a whole time slice of a busy process) and their share
of the total, the ranks' futex sleeps, and where the two ranks ran (one CPU, two CPUs, or moved
during the call).  ``--pinned`` instead pins both ranks to CPU 0 and the busy processes to given
CPUs: the placement that decides whether handing the CPU over by yielding pays
([Note: arena waits] in ``ringlet/transport/arena_wait.py``).

```
python bench/waits.py [--ops all_reduce,all_gather_into_tensor] [--calls 20000] [--load 2]
    [--no-futex] [--pinned [--busy-cpus "1,1;0,1"]]
```

Results: docs/benchmarks.md, "Under load".
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

import _common
import torch

import ringlet.distributed as dist
from ringlet.transport.arena_wait import current_cpu

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
SLICE_S = 1e-3          # a call longer than this had a rank descheduled for a time slice


def _op(name: str) -> Any:
    x, big = torch.ones(2), torch.ones(4)
    calls = {
        "all_reduce": lambda: dist.all_reduce(x),
        "broadcast": lambda: dist.broadcast(x, 0),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(big, x),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(x, big),
    }
    return calls[name]


def _rank(rank: int, n: int, op: str, calls: int, pin: int) -> tuple[list[tuple], int]:
    """``calls`` timed calls: (start, seconds, CPU before, CPU after) each; futex sleeps."""
    torch.set_num_threads(1)
    if pin >= 0:
        os.sched_setaffinity(0, {pin})
    call = _op(op)
    for _ in range(200):
        call()
    arena = dist.group.WORLD.transport.arena
    naps0 = arena.bell.naps if arena.bell is not None else 0
    dist.barrier()
    clock, rec = time.perf_counter, []
    for _ in range(calls):
        cpu, t0 = current_cpu(), clock()
        call()
        rec.append((t0, clock() - t0, cpu, current_cpu()))
    return rec, (arena.bell.naps if arena.bell is not None else 0) - naps0


def _stats(times: list[float]) -> list[str]:
    if not times:
        return ["0", "", "", "", "", "", ""]
    ts, total = sorted(times), sum(times)
    q = lambda p: f"{ts[int(p * (len(ts) - 1))] * 1e6:.1f}"
    slow = [t for t in ts if t > SLICE_S]
    return [str(len(ts)), f"{total / len(ts) * 1e6:.1f}", q(0.5), q(0.9), q(0.99), str(len(slow)),
            f"{sum(slow) / total:.0%}"]


HEAD = ["op", "placement", "calls", "mean us", "p50 us", "p90 us", "p99 us", "calls > 1 ms",
        "their share"]


def _placements(op: str, r0: list[tuple], r1: list[tuple]) -> list[list[str]]:
    """Rows per placement of the ranks.  A call's time is rank 0's (what its caller sees: back to
    back, they add up to its run time; the slower rank's time of each call would count a rank's
    lateness twice)."""
    groups: dict[str, list[float]] = {"all": [], "one CPU": [], "two CPUs": [], "moved": []}
    for a, b in zip(r0, r1):
        t = a[1]
        groups["all"].append(t)
        moved = a[2] != a[3] or b[2] != b[3]
        groups["moved" if moved else "one CPU" if a[2] == b[2] else "two CPUs"].append(t)
    return [[op, name, *_stats(ts)] for name, ts in groups.items() if ts or name == "all"]


def profile(args: argparse.Namespace, env: dict[str, str]) -> list[list[str]]:
    rows = []
    with _common.busy_load(args.load):
        for op in args.ops:
            (r0, naps0), (r1, naps1) = _common.run_ranks(
                2, _rank, op, args.calls, -1, backend="shm", timeout=600, op_timeout=120, env=env)
            rows += _placements(op, r0, r1)
            print(f"{op}: futex sleeps per rank {naps0}, {naps1}", flush=True)
    return rows


def pinned(args: argparse.Namespace, env: dict[str, str]) -> list[list[str]]:
    rows = []
    for busy in args.busy_cpus.split(";"):
        cpus = [int(c) for c in busy.split(",")]
        with _common.busy_load(len(cpus)) as pids:
            for pid, cpu in zip(pids, cpus):
                os.sched_setaffinity(pid, {cpu})
            for op in args.ops:
                (r0, naps0), _ = _common.run_ranks(
                    2, _rank, op, args.calls, 0, backend="shm", timeout=600, op_timeout=120,
                    env=env)
                rows.append([op, f"ranks on CPU 0, busy on CPUs {busy}",
                             *_stats([a[1] for a in r0])])
                print(f"{op}, busy on {busy}: futex sleeps of rank 0: {naps0}", flush=True)
    return rows


def _checked(a: argparse.Namespace) -> argparse.Namespace:
    a.ops = _common.names(a.ops, "--ops", OPS)
    return a


def main(argv: list[str] | None = None) -> None:
    p = _common.parser(__doc__, ranks=None)
    p.add_argument("--ops", default="all_reduce,all_gather_into_tensor")
    p.add_argument("--calls", type=int, default=20000)
    p.add_argument("--load", type=int, default=2, metavar="N", help="busy processes (unpinned)")
    p.add_argument("--no-futex", action="store_true", help="ranks run with RINGLET_NO_FUTEX=1")
    p.add_argument("--pinned", action="store_true", help="ranks pinned to CPU 0")
    p.add_argument("--busy-cpus", default="1,1;0,1",
                   help="with --pinned: the busy processes' CPUs, per run, ';' between runs")
    args = _common.parse(p, argv, _checked)
    if args.pinned and (os.cpu_count() or 1) < 2:
        p.error("--pinned: expected a machine with at least 2 CPUs")
    env = {"RINGLET_NO_FUTEX": "1" if args.no_futex else "0"}
    rows = pinned(args, env) if args.pinned else profile(args, env)
    info = _common.machine_info()

    def preamble(md: bool) -> str:
        return (f"- command: `{_common.command_line()}`\n- date: {info['date']}; "
                f"{info['nproc']} CPUs, {info['cpu']}; torch {info['torch']}\n")

    def render(md: bool) -> str:
        return (_common.markdown_table if md else _common.text_table)(HEAD, rows)

    _common.emit(render, preamble, args.markdown)


if __name__ == "__main__":
    main(sys.argv[1:])
