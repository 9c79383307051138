"""Lightning Fabric and Hugging Face accelerate train over "ringlet" to gloo's losses, each with
its one-line setting (tests/_torch_backend_libs_job.py); skipped where they are not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_torch_backend_launch import _run

pytest.importorskip("lightning_fabric")
pytest.importorskip("accelerate")
pytestmark = pytest.mark.timeout(200)
JOB = Path(__file__).resolve().parent / "_torch_backend_libs_job.py"


def _losses(tmp_path: Path, backend: str) -> list[dict]:
    code, out, err = _run(tmp_path, ["torch.distributed.run", "--standalone", "--nproc-per-node",
                                     "2", str(JOB), backend], timeout=150)
    assert code == 0, err[-3000:]
    dec = json.JSONDecoder()
    return sorted((dec.raw_decode(p)[0] for p in out.split("RESULT ")[1:]),
                  key=lambda r: r["rank"])


def test_fabric_and_accelerate_train_to_gloos_losses(tmp_path: Path) -> None:
    gloo, ours = _losses(tmp_path, "gloo"), _losses(tmp_path, "ringlet")
    assert [r["group"] for r in ours] == ["RingletProcessGroup"] * 2
    assert [r["group"] for r in gloo] == ["ProcessGroup"] * 2
    for g, r in zip(gloo, ours, strict=True):
        assert len(r["fabric"]) == len(r["accelerate"]) == 4
        assert r["fabric"] == g["fabric"]
        assert r["accelerate"] == g["accelerate"]
