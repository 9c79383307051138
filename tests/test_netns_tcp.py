"""Two simulated hosts x two ranks (network namespaces on a bridge): ``auto`` = shm within a host +
tcp between hosts.  Every collective against a local reference, hierarchical results bit-equal to
the flat tcp path, and a link cut in the middle of an all_reduce (docs/reliability.md, row C2)."""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest
from netns import SimNet, require_netns

REPO = Path(__file__).resolve().parents[1]
WORKER = str(REPO / "tests" / "_tcp_workers.py")


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    env.pop("RINGLET_STORE_TOKEN", None)
    env.pop("RINGLET_STORE_TOKEN_FILE", None)
    return env


def _start_2x2(net: SimNet, mode: str, out: Path, backend: str, timeout: float) -> None:
    for rank in range(4):
        host = rank // 2
        net.start(host, [sys.executable, WORKER, mode, str(rank), "4", str(out),
                         net.addrs[0], backend,
                         str(timeout)], env=_env(), log=str(out / f"log{rank}"))


def _results(out: Path, n: int) -> dict[int, dict]:
    found = {}
    for r in range(n):
        path = out / f"rank{r}.json"
        if path.exists():
            found[r] = json.loads(path.read_text())
    return found


def _logs(out: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(out.glob("log*")))


@pytest.mark.timeout(150)
def test_two_hosts_every_collective_then_a_cut_link(tmp_path: Path) -> None:
    """One start-up, two phases: (1) every collective against a local reference, and hierarchical
    results bit-equal to flat tcp; (2) all_reduce in a loop until host 1's switch port goes down:
    every rank fails within [0.9 T, T + 3 s] naming a rank of the other host and its address."""
    require_netns()
    T = 3.0
    with SimNet(2) as net:
        _start_2x2(net, "both", tmp_path, "auto", T)
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"looping{r}").exists() for r in range(4)):
            if time.monotonic() > deadline or any(p.poll() is not None for p in net.procs):
                pytest.fail(f"ranks did not reach the cut phase: {_results(tmp_path, 4)} "
                            f"{_logs(tmp_path)}")
            time.sleep(0.05)
        net.cut(1)
        net.wait_all(T + 20)
        res = _results(tmp_path, 4)
    assert len(res) == 4, _logs(tmp_path)
    for r, got in res.items():
        assert got["backend"] == "shm+tcp"
        assert got["failures"] == [] and got["count"] > 600, got["failures"]
        assert got["hier_vs_flat"] == [], got["hier_vs_flat"]
        assert got["error"] in ("CollectiveTimeoutError", "GroupAbortedError"), (r, got)
        assert 0.9 * T <= got["elapsed"] <= T + 3.0, (r, got["elapsed"], got["message"])
        other = "10.77.0.2" if r < 2 else "10.77.0.1"
        assert other in got["message"], (r, got["message"])
        named = re.findall(r"rank (\d) \(pid \d+ at (10\.77\.0\.\d)", got["message"])
        assert any(ip == other for _, ip in named), (r, got["message"])
