"""Shared fixtures: the leak audit (docs/reliability.md, row H1) runs after every test, pass
or fail."""

from __future__ import annotations

import os
import sys
import threading
import time

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from leaks import snapshot, wait_clean


@pytest.fixture(autouse=True)
def leak_audit(request: pytest.FixtureRequest):
    """Fail a test that leaves child processes, threads, ringlet /dev/shm segments or listeners
    behind."""
    before = snapshot()
    yield
    leaked = wait_clean(before, grace=5.0)
    if leaked:
        pytest.fail(f"{request.node.nodeid} leaked: {leaked}", pytrace=False)


@pytest.fixture
def tmp_gloo(tmp_path):
    """A file:// rendezvous path for torch's gloo (the oracle)."""
    return str(tmp_path / "gloo_rdzv")


_ = (threading, time)
