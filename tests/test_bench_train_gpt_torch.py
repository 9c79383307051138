"""bench/train_gpt_torch.py, the main job against torch's stack, in its --tiny mode: every strategy
runs on both stacks, and the two train the same model to the same losses."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "bench", "train_gpt_torch.py")
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "ddp+tp")


def _run(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def _rows(markdown: str) -> dict[str, list[str]]:
    rows = {}
    for line in markdown.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and cells[0] in STRATEGIES:
            rows[cells[0]] = cells
    return rows


def test_tiny_run_times_every_strategy_on_both_stacks(tmp_path) -> None:
    out = tmp_path / "out.md"
    proc = _run("--tiny", "--markdown", str(out))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    rows = _rows(out.read_text())
    assert sorted(rows) == sorted(STRATEGIES), out.read_text()
    for name, cells in rows.items():
        # strategy, mesh, ringlet ms, torch ms, ringlet tok/s, torch tok/s, ratio, max |dloss|
        assert float(cells[2]) > 0 and float(cells[3]) > 0, cells
        assert cells[6].endswith("x") and float(cells[6][:-1]) > 0, cells
        # the same model, batches and schedule on both stacks: only float rounding may differ
        assert float(cells[7]) < 1e-4, f"{name}: the stacks' losses differ: {cells}"


def test_unknown_strategy_is_refused_by_name() -> None:
    proc = _run("--strategies", "ddp,zero3", timeout=60.0)
    assert proc.returncode == 2
    assert "expected --strategies from ddp,fsdp,hsdp,tp,fsdp+tp,ddp+tp" in proc.stderr
    assert "zero3" in proc.stderr
