"""torch's stack on the "ringlet" backend with CUDA tensors (skipped without a GPU): one process,
CUDA tensors staged through host memory under the default transport, or handed to torch's NCCL with
RINGLET_TORCH_TRANSPORT=nccl; torch's DDP on a CUDA model equal to plain training."""

from __future__ import annotations

import copy
from datetime import timedelta

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.timeout(120)]


@pytest.mark.parametrize("transport", ["auto", "nccl"])
def test_cuda_tensors_and_ddp_on_the_ringlet_backend(tmp_path, monkeypatch, transport) -> None:
    import torch.distributed as tdist
    from torch.nn.parallel import DistributedDataParallel as DDP

    import ringlet  # noqa: F401

    monkeypatch.setenv("RINGLET_TORCH_TRANSPORT", transport)
    tdist.init_process_group("ringlet", init_method=f"file://{tmp_path}/init", rank=0,
                             world_size=1, timeout=timedelta(seconds=60))
    try:
        t = torch.arange(4, dtype=torch.float32, device="cuda")
        tdist.all_reduce(t)
        assert t.device.type == "cuda" and t.tolist() == [0.0, 1.0, 2.0, 3.0]
        torch.manual_seed(0)
        plain = torch.nn.Linear(8, 2).cuda()
        wrapped = DDP(copy.deepcopy(plain), device_ids=[0])
        x = torch.randn(4, 8, device="cuda")
        plain(x).sum().backward()
        wrapped(x).sum().backward()
        assert torch.allclose(plain.weight.grad, wrapped.module.weight.grad)
    finally:
        tdist.destroy_process_group()
