"""Cost of ringlet's always-on collective fingerprint check.

Runs 1,000 small all_reduces (8 B and 4 KiB) on 2 ranks over shm with the check on
(the default) and off (``RINGLET_CHECKS=0``), alternating worlds, and prints the
median time per call of each and the overhead.

    python bench/checks_overhead.py [--repeats 5] [--calls 1000] [--markdown FILE]
"""

from __future__ import annotations

import time

import _common as common
import torch

from ringlet import c10d as dist


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
    ap = common.parser(__doc__, ranks=None)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--calls", type=int, default=1000)
    args = ap.parse_args()
    print(f"command: python bench/checks_overhead.py --repeats {args.repeats} --calls {args.calls}")
    lines = []
    for numel, label in [(2, "8 B"), (1024, "4 KiB")]:
        times: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(args.repeats):
            for mode in ("on", "off"):
                env = {"RINGLET_CHECKS": "1" if mode == "on" else "0"}
                per_rank = common.run_ranks(2, body, args.calls, numel, backend="shm", env=env,
                                            timeout=120, op_timeout=60)
                times[mode].append(max(per_rank))
        on, off = common.median(times["on"]), common.median(times["off"])
        lines.append(f"all_reduce {label}: checks on {on * 1e6:.1f} us, off {off * 1e6:.1f} us, "
                     f"overhead {100 * (on / off - 1):+.1f}% (median of {args.repeats})")
        print(lines[-1], flush=True)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(common.provenance(f"{args.repeats} repeats of {args.calls} calls") + "\n"
                    + "\n".join(f"- {x}" for x in lines) + "\n")


if __name__ == "__main__":
    main()
