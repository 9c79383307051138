"""Cost of ringlet's always-on collective fingerprint check.

Runs 1,000 small all_reduces (8 B and 4 KiB) on 2 ranks over shm with the check on
(the default) and off (``RINGLET_CHECKS=0``), alternating worlds, and prints the
median time per call of each and the overhead.

    python bench/checks_overhead.py [--repeats 5] [--calls 1000]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])

from ringlet import c10d as dist
from ringlet.testing.procs import raise_first, run_world


def body(rank: int, n: int, calls: int, numel: int) -> float:
    torch.set_num_threads(1)
    t = torch.ones(numel)
    for _ in range(100):
        dist.all_reduce(t)
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        dist.all_reduce(t)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    print(f"command: python bench/checks_overhead.py --repeats {args.repeats} --calls {args.calls}")
    for numel, label in [(2, "8 B"), (1024, "4 KiB")]:
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.repeats):
            for mode in ("on", "off"):
                env = {"RINGLET_CHECKS": "1" if mode == "on" else "0"}
                per_rank = raise_first(run_world(2, body, args.calls, numel, env=env, timeout=120))
                times[mode].append(max(per_rank))
        on, off = statistics.median(times["on"]), statistics.median(times["off"])
        print(f"all_reduce {label}: checks on {on * 1e6:.1f} us, off {off * 1e6:.1f} us, "
              f"overhead {100 * (on / off - 1):+.1f}% (median of {args.repeats})")


if __name__ == "__main__":
    main()
