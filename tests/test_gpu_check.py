"""scripts/gpu_check.py, the GPU acceptance run, rehearsed on the CPU (``--rehearse``).

The GPU run is rare and short, so a plain bug of the script (a wrong name, signature or
assumption about ``run_world``) must show here first: a subset of the rows runs on the CPU with the
same rank bodies, the same backend names and the same torch baseline child (on gloo), and the
table's failure path runs in this process.  The full rehearsal (every row, ~15 s on 2 cores) is
``python scripts/gpu_check.py --rehearse``.
"""

from __future__ import annotations

import importlib.util
import pathlib
import subprocess
import sys
from types import ModuleType

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
ROWS = ["collectives slow-kernel staged 2 ranks (gloo, shared GPU)",
        "fully_shard offload 3 steps staged 2 ranks vs single process",
        "speed ddp vs torch (1 rank nccl)"]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    me = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(me)
    return me


@pytest.mark.timeout(90)
def test_rehearsal_runs_rows_on_the_cpu_and_says_so() -> None:
    only = [arg for row in ROWS for arg in ("--only", row)]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--rehearse", "--steps", "3", *only],
                          capture_output=True, text=True, timeout=80, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    lines = proc.stdout.strip().splitlines()
    assert "REHEARSAL ON THE CPU" in lines[1] and "NOT the GPU" in lines[1], out
    assert "REHEARSAL ON THE CPU" in lines[-2], out            # top and bottom
    for row in ROWS:
        assert any(line.startswith(f"PASS  {row}  (") for line in lines), (row, out)
    assert "ratio" in out and "the limit 1.05 is not checked" in out, out
    assert "3 passed, 0 failed" in out and "FAIL" not in out, out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a host without CUDA")
def test_without_rehearse_or_cuda_nothing_is_checked() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "ddp"], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "no CUDA device here: nothing checked"


def test_a_failing_row_is_a_fail_line_with_its_whole_report(capsys) -> None:
    me = _script()

    def bad() -> str:
        raise AssertionError("rank 1 failed first (ValueError, exit 0): expected 3, got 4\n"
                             "Traceback (most recent call last):\n  File \"x.py\", line 9")

    results = me._run([("good row", lambda: "fine"), ("bad row", bad)])
    assert [(name, ok) for name, ok, _, _ in results] == [("good row", True), ("bad row", False)]
    assert results[1][3] == ("AssertionError: rank 1 failed first (ValueError, exit 0): "
                             "expected 3, got 4")
    out = capsys.readouterr().out
    assert "PASS  good row" in out and "FAIL  bad row" in out
    assert "    | Traceback (most recent call last):" in out and '    |   File "x.py"' in out


def test_the_rehearsal_has_the_gpu_rows_and_names() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0 and "--only" in proc.stdout and "--max-ratio" in proc.stdout
    me = _script()
    gpu = [name for name, _ in me.rows(me, 10, 1.05)]
    cpu = [name for name, _ in me.rows(me, 10, 1.05, "cpu")]
    assert cpu == gpu == [
        "collectives nccl 1 rank", "collectives staged 2 ranks (gloo, shared GPU)",
        "collectives slow-kernel nccl 1 rank",
        "collectives slow-kernel staged 2 ranks (gloo, shared GPU)",
        "ddp 10 steps nccl 1 rank vs single process",
        "ddp 10 steps staged 2 ranks vs single process",
        "fully_shard 10 steps nccl 1 rank vs single process",
        "fully_shard 10 steps staged 2 ranks vs single process",
        "fully_shard offload 10 steps nccl 1 rank vs single process",
        "fully_shard offload 10 steps staged 2 ranks vs single process",
        "tensor parallel 10 steps nccl 1 rank vs single process",
        "tensor parallel 10 steps staged 2 ranks vs single process",
        "fully_shard + tensor parallel 2x2 10 steps staged 4 ranks vs single process",
        "fully_shard memory per rank falls with 2 ranks",
        "adapter overhead per all_reduce vs torch's NCCL (1 rank)",
        "speed ddp vs torch (1 rank nccl)", "speed fully_shard vs torch (1 rank nccl)"]


def test_the_device_helpers_make_the_cuda_calls_on_a_gpu(monkeypatch) -> None:
    """The GPU branches, which the rehearsal does not run: the CUDA calls they make, by name."""
    me = _script()
    calls: list[tuple] = []
    for name in ("synchronize", "_sleep", "get_device_name"):
        assert callable(getattr(torch.cuda, name)), name        # still torch's API
        monkeypatch.setattr(torch.cuda, name, lambda *a, name=name: calls.append((name, *a)) or "H")
    me._sync("cuda:0")
    me._slow_kernel("cuda:0")
    assert me._device_name("cuda:0") == "H"
    assert calls == [("synchronize",), ("_sleep", 200_000_000),
                     ("get_device_name", torch.device("cuda", 0))]
    me._sync("cpu")
    assert me._device_name("cpu").startswith("CPU") and len(calls) == 3
    assert me._ddp_devices("cuda:0") == [0] and me._ddp_devices("cpu") is None
    plain = torch.zeros(2)
    assert me._offloaded(plain, "cpu") and not me._offloaded(plain, "cuda:0")   # not pinned
    assert not me._offloaded(torch.zeros(2, device="meta"), "cpu")


def test_the_torch_baseline_child_runs_where_the_rows_run(monkeypatch) -> None:
    me = _script()
    cmds: list[list[str]] = []

    def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        assert kwargs["timeout"] > 0
        cmds.append(cmd)
        return subprocess.CompletedProcess(cmd, 0, stdout='{"seconds": 0.5}\n', stderr="")

    monkeypatch.setattr(me.subprocess, "run", run)
    assert me._torch_baseline("ddp", "cuda:0") == 0.5
    assert me._torch_baseline("fully_shard", "cpu") == 0.5
    assert cmds[0][-2:] == ["--torch-baseline", "ddp"]
    assert cmds[1][-3:] == ["--torch-baseline", "fully_shard", "--rehearse"]
