"""Unmodified torch programs launched two ways onto the "ringlet" backend: ``ringlet-run
--torch-backend`` for a program that names no backend (torch's default CPU backend becomes
"ringlet" and torch's env:// rendezvous joins ringlet-run's store), and torchrun for a program
that names "ringlet"."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(150)
REPO = Path(__file__).resolve().parents[1]

PROGRAM = textwrap.dedent("""
    import json, sys, torch
    import torch.distributed as dist
    {imports}
    dist.init_process_group({backend})
    t = torch.ones(2) * (dist.get_rank() + 1)
    dist.all_reduce(t)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
    model(torch.ones(2, 3) * dist.get_rank()).sum().backward()
    print("RESULT " + json.dumps({{"rank": dist.get_rank(), "sum": t.tolist(),
          "group": type(dist.group.WORLD).__name__,
          "grad": model.module.weight.grad.tolist()}}), flush=True)
    dist.destroy_process_group()
""")


def _run(tmp_path: Path, argv: list[str], timeout: float = 120) -> tuple[int, str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("RINGLET_TORCH_DEFAULT", None)
    proc = subprocess.Popen([sys.executable, "-m", *argv], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)     # the launcher's whole session, workers too
        except ProcessLookupError:
            pass
        proc.communicate()
    return proc.returncode, out, err


def _results(out: str) -> list[dict]:
    # torchrun may interleave two workers' lines: decode each record where it starts
    dec = json.JSONDecoder()
    rows = [dec.raw_decode(piece)[0] for piece in out.split("RESULT ")[1:]]
    return sorted(rows, key=lambda r: r["rank"])


def _check(rows: list[dict]) -> None:
    assert [r["rank"] for r in rows] == [0, 1]
    for r in rows:
        assert r["sum"] == [3.0, 3.0]
        assert r["group"] == "RingletProcessGroup"
        assert r["grad"] == [[1.0, 1.0, 1.0]]   # rank r: 2 rows of r; the mean of 0 and 2


def test_ringlet_run_torch_backend_runs_a_program_that_names_no_backend(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(PROGRAM.format(imports="", backend=""))
    code, out, err = _run(tmp_path, ["ringlet.launcher.run", "--torch-backend",
                                     "--nproc-per-node", "2", str(script)])
    assert code == 0, err[-3000:]
    _check(_results(out))


def test_torchrun_runs_a_program_that_names_ringlet(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(PROGRAM.format(imports="import ringlet", backend='"ringlet"'))
    code, out, err = _run(tmp_path, ["torch.distributed.run", "--standalone",
                                     "--nproc-per-node", "2", str(script)])
    assert code == 0, err[-3000:]
    _check(_results(out))
