"""init_process_group under a launcher (issue 27, "Mistakes a new user makes"): an explicit
world_size or rank that contradicts the launcher's fails at once instead of waiting the whole
timeout; "nccl" on a machine without CUDA says, once on rank 0, that the job runs on the CPU."""

from __future__ import annotations

import time
import warnings

import pytest
import torch

import ringlet.distributed as dist
from ringlet.c10d import rendezvous
from ringlet.store import HashStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch) -> None:
    """The environment ringlet-run gives rank 0 of a 2-process job (no store behind the port)."""
    for key, value in {"RINGLET_AGENT_STORE": "1", "WORLD_SIZE": "2", "RANK": "0",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "9"}.items():
        monkeypatch.setenv(key, value)


def test_world_size_that_contradicts_the_launcher_fails_at_once(launched: None) -> None:
    started = time.monotonic()
    with pytest.raises(ValueError, match=r"init_process_group: world_size: expected 2 \(WORLD_SIZE"
                                         r", set by the launcher .*\), got 4"):
        dist.init_process_group("gloo", world_size=4, timeout=30)
    with pytest.raises(ValueError, match=r"rank: expected 0 \(RANK, set by the launcher"):
        dist.init_process_group("gloo", world_size=2, rank=1, timeout=30)
    assert time.monotonic() - started < 10 and not dist.is_initialized()


def test_explicit_values_without_a_launcher_are_taken(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in ("RINGLET_AGENT_STORE", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "2")
    rendezvous._check_launcher_agrees(0, 4)        # a hand-made job may say what it likes
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")  # torchrun's workers are checked too
    with pytest.raises(ValueError, match="world_size: expected 2"):
        rendezvous._check_launcher_agrees(0, 4)
    rendezvous._check_launcher_agrees(-1, -1)       # nothing given: the launcher's values


@pytest.mark.skipif(torch.cuda.is_available(), reason="the warning is for machines without CUDA")
def test_nccl_without_cuda_says_once_that_it_runs_on_the_cpu(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rendezvous, "_told_nccl", False)
    for _ in range(2):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)
            try:
                t = torch.ones(2)
                dist.all_reduce(t)
            finally:
                dist.destroy_process_group()
        said = [str(w.message) for w in seen if "NCCL" in str(w.message)]
        if _ == 0:
            assert len(said) == 1 and "no usable CUDA device" in said[0], said
            assert "runs on ringlet's CPU transport" in said[0]
        else:
            assert said == []                       # once per process
    rendezvous.warn_nccl_without_cuda("auto")      # other backends never warn
    monkeypatch.setattr(rendezvous, "_told_nccl", False)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        rendezvous.warn_nccl_without_cuda("shm")
    assert seen == []
