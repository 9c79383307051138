"""What ``import ringlet.distributed`` adds to ``import torch``, against ``torch.distributed``.

Usage::

    python bench/import_time.py [--runs 7] [--ringlet-from DIR] [--markdown out.md]

Each run starts fresh interpreters, alternating between the modules (so that a change in the
machine's load hits all alike).  Each interpreter imports torch, then times the import of one
module with ``time.perf_counter`` (the "added" column: what that module costs on top of torch),
and its whole life is timed from outside (start to exit: interpreter, torch, the module, exit).
Medians over the runs.

ringlet is imported from this checkout (``--ringlet-from``: from another one, e.g. an older commit
unpacked with ``git archive``, for a before/after comparison).  An installed package has its
bytecode compiled once; a checkout run with ``PYTHONDONTWRITEBYTECODE=1`` compiles ringlet's
sources at every start.  Both are measured: "bytecode" gives the interpreters a private, warmed
``PYTHONPYCACHEPREFIX``; "from source" compiles every time.  torch's own bytecode comes with its
wheel in both.
The last column lists the compiler modules (``torch._dynamo``, ``torch._inductor``, sympy, ...)
that the import loaded: none is expected (tests/test_import_light.py pins it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import _common as common

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "matplotlib")
# (row label, module imported after torch, ringlet's bytecode cached?)
CASES = [("torch.distributed", "torch.distributed", True),
         ("ringlet.distributed (bytecode)", "ringlet.distributed", True),
         ("ringlet.distributed (from source)", "ringlet.distributed", False)]
_PROBE = """
import json, sys, time
import torch
t = time.perf_counter()
import {module}
added = time.perf_counter() - t
heavy = {heavy!r}
print(json.dumps([added, sorted(h for h in heavy if h in sys.modules)]))
"""


def _env(pycache: str | None, root: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root,
                                                                    os.environ.get("PYTHONPATH")])))
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.pop("PYTHONPYCACHEPREFIX", None)
    if pycache is None:
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    else:
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


def run_once(module: str, pycache: str | None, root: str = ROOT) -> tuple[float, float, list[str]]:
    """One fresh interpreter: (seconds the import of ``module`` added to torch's, seconds from
    start to exit, compiler modules it loaded)."""
    code = _PROBE.format(module=module, heavy=HEAVY)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], cwd=root, env=_env(pycache, root),
                          capture_output=True, text=True, timeout=300, check=False)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise RuntimeError(f"import {module} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    added, heavy = json.loads(proc.stdout.strip().splitlines()[-1])
    return added, wall, heavy


def measure(runs: int, pycache: str, root: str = ROOT) -> list[list[str]]:
    """The table's rows: per case, median added seconds, median wall seconds, modules seen."""
    run_once("ringlet.distributed", pycache, root)      # writes the bytecode (not measured)
    added: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
    wall: dict[str, list[float]] = {label: [] for label, _, _ in CASES}
    heavy: dict[str, set[str]] = {label: set() for label, _, _ in CASES}
    for _ in range(runs):
        for label, module, cached in CASES:
            a, w, h = run_once(module, pycache if cached else None, root)
            added[label].append(a)
            wall[label].append(w)
            heavy[label].update(h)
        print({label: round(seen[-1], 3) for label, seen in added.items()}, flush=True)
    return [[label, f"{common.median(added[label]):.3f}", f"{common.median(wall[label]):.2f}",
             ", ".join(sorted(heavy[label])) or "none"] for label, _, _ in CASES]


def main() -> None:
    """Measure, print the table (and write it as Markdown with ``--markdown``)."""
    p = common.parser(__doc__, ranks=None)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--ringlet-from", default=ROOT, metavar="DIR",
                   help="the directory holding the ringlet package to import (default: this one)")
    args = p.parse_args()
    if args.runs < 1:
        p.error(f"--runs: expected at least 1, got {args.runs}")
    root = os.path.abspath(args.ringlet_from)
    if not os.path.isfile(os.path.join(root, "ringlet", "__init__.py")):
        p.error(f"--ringlet-from: expected a directory holding ringlet/__init__.py, got {root}")
    with tempfile.TemporaryDirectory() as pycache:
        rows = measure(args.runs, pycache, root)
    headers = ["import after torch", "added s (median)", "interpreter s (median)",
               "compiler modules loaded"]

    def render(md: bool) -> str:
        return (common.markdown_table if md else common.text_table)(headers, rows)

    setup = f"{args.runs} fresh interpreters per row, alternating; ringlet from {root}"
    common.emit(render, lambda md: common.provenance(setup), args.markdown)


if __name__ == "__main__":
    main()
