"""Fuzz (issue 10.2): every public tensor-taking API of ringlet.distributed, random bad and odd
inputs, on threads and on 2 real processes.  Never a crash, never a hang, never a silently wrong
value, and the group stays usable after a refused call (tests/_fuzz_cases.py says how).

This is the short version for CI; ``scripts/fuzz.py --minutes M`` runs the long one.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import pytest
from _fuzz_apis import run_cases
from _fuzz_cases import cases
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from ringlet.testing import run_threads
from ringlet.testing.procs import run_world

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::UserWarning")
_SETTINGS: dict[str, Any] = {"deadline": None, "suppress_health_check": list(HealthCheck),
                             "database": None}


def assert_clean(results: list[dict[str, Any]]) -> None:
    failures = [f for r in results for f in r["failures"]]
    assert not failures, "\n".join(failures[:5])
    # A refusal is local, and every rank made the same call: the ranks' verdicts agree.
    assert results[0]["counts"] == results[1]["counts"], [r["counts"] for r in results]


@pytest.mark.timeout(120)
@settings(max_examples=120, **_SETTINGS)
@given(st.lists(cases(), min_size=1, max_size=10))
def test_fuzz_threads(batch: list[dict[str, Any]]) -> None:
    assert_clean(run_threads(run_cases, 2, batch, timeout=60.0, op_timeout=5.0))


def _crashed_case(progress: str, rank: int) -> str:
    try:
        with open(f"{progress}.{rank}") as f:
            return f.read().strip()
    except OSError:
        return "(before the first case)"


def run_in_processes(batch: list[dict[str, Any]], backend: str = "shm") -> list[dict[str, Any]]:
    """Run ``batch`` on 2 processes; fail naming the case a rank died or hung in."""
    with tempfile.TemporaryDirectory(prefix="ringlet-fuzz-") as d:
        progress = os.path.join(d, "progress")
        results = run_world(2, run_cases, batch, progress, backend=backend, timeout=240.0,
                            op_timeout=5.0)
        for r in results:
            if r.exitcode != 0 or r.exc_type is not None:
                raise AssertionError(f"rank {r.rank}: {r.exc_type}, exit code {r.exitcode}, in "
                                     f"case {_crashed_case(progress, r.rank)}: {r.message[:2000]}")
        return [r.value for r in results]


@pytest.mark.timeout(300)
@settings(max_examples=2, phases=[Phase.generate], **_SETTINGS)
@given(st.lists(cases(), min_size=100, max_size=100))
def test_fuzz_processes_shm(batch: list[dict[str, Any]]) -> None:
    assert_clean(run_in_processes(batch, "shm"))


@pytest.mark.timeout(300)
@settings(max_examples=1, phases=[Phase.generate], **_SETTINGS)
@given(st.lists(cases(), min_size=100, max_size=100))
def test_fuzz_processes_tcp(batch: list[dict[str, Any]]) -> None:
    assert_clean(run_in_processes(batch, "tcp"))
