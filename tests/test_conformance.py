"""torch's own distributed test suite, run against ringlet (``scripts/conformance.py --ci``).

The CI list holds every test of the recorded CPU subset that passes on torch and on ringlet,
less the ones that measure wall-clock time; docs/conformance.md records the whole run.
"""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "conformance.py"


def _ci_tests() -> list[str]:
    spec = importlib.util.spec_from_file_location("conformance_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod           # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.modules.pop(spec.name, None)
    return list(mod.CI_TESTS)


@pytest.mark.timeout(240)
def test_torchs_distributed_suite_passes_on_ringlet() -> None:
    pytest.importorskip("expecttest")          # torch's test helpers need it (dev extra)
    expected = len(_ci_tests())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--impl", "ringlet", "--ci",
                           "--timeout", "60"],
                          capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    out = proc.stdout + proc.stderr
    summary = [ln for ln in out.splitlines() if " passed, " in ln]
    assert proc.returncode == 0, out[-4000:]
    assert (summary
            and summary[-1].startswith(f"{expected} passed, 0 failed, 0 skipped")), (out[-4000:])
