"""The torch-engine adapter: torch's gloo (CPU) and NCCL (CUDA) process groups under ringlet's API.

NCCL needs a GPU: on a machine without one, asking for it fails with a clear message and the NCCL
tests are skipped, saying so."""

from __future__ import annotations

import _tcp_workers
import pytest
import torch

import ringlet.distributed as dist
from ringlet.store import HashStore
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.torch_engine import engines_for

NO_CUDA = "no CUDA device here: torch's NCCL engine cannot run (the adapter refuses it with a clear error)"


@pytest.mark.timeout(30)
def test_engine_specs() -> None:
    assert engines_for("torch:gloo") == {"cpu": "gloo"}
    assert engines_for("torch:nccl") == {"cuda": "nccl"}
    assert engines_for("torch:gloo,nccl") == {"cpu": "gloo", "cuda": "nccl"}
    with pytest.raises(ValueError, match="expected gloo or nccl"):
        engines_for("torch:mpi")


@pytest.mark.timeout(120)
def test_collectives_on_torchs_gloo_through_ringlets_api() -> None:
    for got in raise_first(run_world(2, _tcp_workers.engine_cases, backend="torch:gloo", timeout=90)):
        assert got["backend"] == "torch:gloo"
        assert got["bad"] == [], got["bad"]


@pytest.mark.timeout(60)
def test_torchs_timeout_becomes_a_collective_timeout_error() -> None:
    res = raise_first(run_world(2, _tcp_workers.engine_timeout, backend="torch:gloo", op_timeout=1.5,
                                timeout=30))
    assert res[0][0] == "CollectiveTimeoutError" and "gloo" in res[0][1], res[0]


@pytest.mark.timeout(30)
@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the NCCL tests below run")
def test_nccl_without_cuda_is_refused_clearly() -> None:
    with pytest.raises(ValueError, match="needs CUDA"):
        dist.init_process_group("torch:nccl", store=HashStore(), rank=0, world_size=1)
    assert not dist.is_initialized()


@pytest.mark.timeout(120)
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)
@pytest.mark.parametrize("spec", ["torch:nccl", "torch:gloo,nccl"])
def test_nccl_engine_on_one_gpu(spec: str) -> None:
    """World of one (one GPU), in a child process: NCCL keeps process-wide listeners alive."""
    assert raise_first(run_world(1, _tcp_workers.nccl_one_gpu, spec, backend="tcp", timeout=100)) == ["ok"]
