"""The long fuzz run (issue 10.2), by hand: the engine of tests/test_fuzz.py for minutes.

    .venv/bin/python scripts/fuzz.py --minutes 10            # threads, shm and tcp in turn
    .venv/bin/python scripts/fuzz.py --examples 5000 --tiers threads

Cases are drawn by hypothesis (tests/_fuzz_cases.py) in batches of ``--batch``; each batch
runs on 2 ranks, as threads (``inproc``) or as processes over ``shm`` or ``tcp``.  Stops at
the first failure (printing it, and the case a crashed rank was in) or when ``--examples``
cases ran or ``--minutes`` passed; prints the counts: cases run, refused, passed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from _fuzz_apis import run_cases
from _fuzz_cases import cases
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from test_fuzz import run_in_processes

from ringlet.testing import run_threads


def draw_batches(count: int, size: int) -> list[list[dict[str, Any]]]:
    """``count`` fresh batches of ``size`` cases from the hypothesis strategy."""
    out: list[list[dict[str, Any]]] = []

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(st.lists(cases(), min_size=size, max_size=size))
    def collect(batch: list[dict[str, Any]]) -> None:
        out.append(batch)
    collect()
    return out


def run_batch(tier: str, batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if tier == "threads":
        return run_threads(run_cases, 2, batch, timeout=120.0, op_timeout=5.0)
    return run_in_processes(batch, backend=tier)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--examples", type=int, default=0,
                   help="stop after this many cases (0: no limit)")
    p.add_argument("--minutes", type=float, default=1.0, help="stop after this long")
    p.add_argument("--batch", type=int, default=100, help="cases per world")
    p.add_argument("--tiers", default="threads,shm,tcp", help="comma-separated: threads, shm, tcp")
    args = p.parse_args(argv)
    warnings.simplefilter("ignore")
    os.environ["PYTHONWARNINGS"] = "ignore"      # the ranks' deprecation warnings are expected
    tiers = args.tiers.split(",")
    totals = {t: {"run": 0, "rejected": 0, "passed": 0, "worlds": 0} for t in tiers}
    t0 = time.monotonic()
    deadline = t0 + 60 * args.minutes
    done, failed = 0, False
    while time.monotonic() < deadline and not failed and (not args.examples
                                                          or done < args.examples):
        for batch in draw_batches(len(tiers) * 4, args.batch):
            tier = min(tiers, key=lambda t: totals[t]["worlds"])     # the tiers take turns
            try:
                results = run_batch(tier, batch)
            except AssertionError as e:      # a rank crashed, hung or raised outside a case
                print(f"FAILED on {tier}: {e}", flush=True)
                failed = True
                break
            failures = [f for r in results for f in r["failures"]]
            for k in ("run", "rejected", "passed"):
                totals[tier][k] += results[0]["counts"][k]
            totals[tier]["worlds"] += 1
            done += results[0]["counts"]["run"]
            if failures or results[0]["counts"] != results[1]["counts"]:
                print(f"FAILED on {tier}:\n" + "\n".join(failures[:10]), flush=True)
                failed = True
                break
            if time.monotonic() >= deadline or (args.examples and done >= args.examples):
                break
    elapsed = time.monotonic() - t0
    for tier, c in totals.items():
        print(f"{tier:8s} worlds {c['worlds']:5d}  cases {c['run']:7d}  refused "
              f"{c['rejected']:7d}  passed {c['passed']:7d}")
    total = {k: sum(c[k] for c in totals.values()) for k in ("run", "rejected", "passed")}
    print(f"total    cases {total['run']} (refused {total['rejected']}, passed {total['passed']}) "
          f"in {elapsed / 60:.1f} min: "
          f"{'FAILED' if failed else 'no crash, hang, wrong value or unusable group'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
