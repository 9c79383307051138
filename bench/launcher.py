"""``ringlet-run`` against ``torchrun``: wall time of a whole job, start to exit.

Usage::

    python bench/launcher.py [--nproc 2] [--runs 5] [--markdown out.md]

Two jobs, each launched ``--runs`` times by both launchers, alternating (so that a change in the
machine's load hits both alike); the table gives each launcher's median and the ratio:

- ``print``: a script that imports nothing (what the launcher and its worker bootstrap cost);
- ``all_reduce``: ``init_process_group`` (gloo), one ``all_reduce`` of one float,
  ``destroy_process_group`` -- the same script for both, ``torch.distributed`` under torchrun and
  ``ringlet.distributed`` under ringlet-run (imports, rendezvous and exit included).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import _common as common

JOBS = {
    "print": ("print('ok')\n", "print('ok')\n"),
    "all_reduce": tuple(
        f"import torch\nimport {mod}.distributed as dist\ndist.init_process_group('gloo')\n"
        "t = torch.ones(1)\ndist.all_reduce(t)\nassert t.item() == dist.get_world_size()\n"
        "dist.destroy_process_group()\n" for mod in ("torch", "ringlet")),
}
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _launch(launcher: str, nproc: int, script: str, cwd: str) -> float:
    """Seconds from starting ``launcher`` on ``script`` to its exit (which must be 0)."""
    head = ([sys.executable, "-m", "torch.distributed.run"] if launcher == "torchrun"
            else [sys.executable, "-m", "ringlet.launcher.run"])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT,
                                                                    os.environ.get("PYTHONPATH")])))
    started = time.monotonic()
    proc = subprocess.run([*head, "--nproc-per-node", str(nproc), script], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300, check=False)
    elapsed = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} {script} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return elapsed


def main() -> None:
    """Measure, print the table (and write it as Markdown with ``--markdown``)."""
    p = common.parser(__doc__, ranks=None)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for job, (torch_code, ringlet_code) in JOBS.items():
            paths = {}
            for launcher, code in (("torchrun", torch_code), ("ringlet-run", ringlet_code)):
                paths[launcher] = os.path.join(tmp, f"{job}_{launcher}.py")
                with open(paths[launcher], "w") as f:
                    f.write(code)
            times: dict[str, list[float]] = {"torchrun": [], "ringlet-run": []}
            for _ in range(args.runs):
                for launcher, seen in times.items():
                    seen.append(_launch(launcher, args.nproc, paths[launcher], tmp))
            t, r = common.median(times["torchrun"]), common.median(times["ringlet-run"])
            rows.append([job, f"{t:.2f}", f"{r:.2f}", f"{r / t:.2f}"])
            print(f"{job}: torchrun {times['torchrun']}, ringlet-run {times['ringlet-run']}",
                  flush=True)
    headers = ["job", "torchrun s (median)", "ringlet-run s (median)", "ratio"]

    def render(md: bool) -> str:
        return (common.markdown_table if md else common.text_table)(headers, rows)

    setup = f"{args.nproc} processes, {args.runs} runs each, alternating"
    common.emit(render, lambda md: common.provenance(setup), args.markdown)


if __name__ == "__main__":
    main()
