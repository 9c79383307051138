"""Exact resume (golden test): a 2-rank job SIGKILLed at a random step (or inside a save) is
restarted by ``ringlet-run --max-restarts`` from its last committed checkpoint and ends bitwise
equal to an uninterrupted run -- parameters, Adam state, RNG and data position.
scripts/resume_golden.py runs
it 20 times in a row."""

from __future__ import annotations

import random

import _ckpt_golden as G
import pytest

pytestmark = pytest.mark.timeout(240)


def test_killed_job_resumes_bitwise_equal(tmp_path) -> None:
    ref = G.run(tmp_path / "ref")
    assert ref.returncode == 0, ref.stderr[-3000:]
    seed = random.randrange(1 << 30)
    # the second: inside a save
    for i, kill in enumerate([G.draw(seed), (seed % 2, 6, seed % 6400)]):
        out = G.run(tmp_path / f"kill{i}", kill)
        assert out.returncode == 0, (seed, kill, out.stderr[-3000:])
        assert ("restarting workers (1/2)" in out.stderr
                and "SIGKILL" in out.stderr), (seed, kill, out.stderr)
        assert G.differences(tmp_path / "ref", tmp_path / f"kill{i}") == [], (seed, kill)
