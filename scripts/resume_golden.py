"""Run the exact-resume golden experiment N times in a row (default 20) and report.

    .venv/bin/python scripts/resume_golden.py [N] [--seed S]

Each run starts a 2-rank training job under ``ringlet-run --max-restarts 2``, SIGKILLs a random
rank at a random step (one run in three: a random number of bytes into writing its checkpoint
shard), lets the launcher restart it from the last committed checkpoint, and compares the final
parameters, Adam state, RNG state and step with an uninterrupted run, bit for bit.  Exit code 0
only if every run matches.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _ckpt_golden as G


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=20)
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    print(f"resume_golden: {args.n} runs, seed {seed}")
    rng = random.Random(seed)
    with tempfile.TemporaryDirectory(prefix="ringlet-golden-") as tmp:
        root = Path(tmp)
        ref = G.run(root / "ref")
        if ref.returncode != 0:
            print(ref.stderr[-3000:])
            return 1
        ok = 0
        for i in range(args.n):
            kill = G.draw(rng.randrange(1 << 30))
            start = time.monotonic()
            out = G.run(root / f"run{i}", kill)
            diff = (G.differences(root / "ref", root / f"run{i}") if out.returncode == 0
                    else ["launcher failed"])
            restarted = "restarting workers (1/2)" in out.stderr
            good = not diff and restarted
            ok += good
            where = f"rank {kill[0]} step {kill[1]}" + (f" ({kill[2]} bytes into its shard)"
                                                        if len(kill) > 2 else "")
            print(f"run {i + 1:2d}: kill {where:<40} "
                  f"{'bitwise equal' if good else 'DIFFERS: ' + str(diff)} "
                  f"({time.monotonic() - start:.1f} s)", flush=True)
            if out.returncode != 0:
                print(out.stderr[-2000:])
    print(f"resume_golden: {ok}/{args.n} runs bitwise equal to the uninterrupted run (seed {seed})")
    return 0 if ok == args.n else 1


if __name__ == "__main__":
    sys.exit(main())
