"""Rank bodies of tests/test_gpu.py (module level so that they pickle by reference).

The CUDA ones run only where a GPU is present; they compare a distributed run with the same
training in one process, on the same device.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

import ringlet.distributed as dist
from ringlet.nn.parallel import DistributedDataParallel

STEPS = 5


def nccl_names_on_cpu(rank: int, n: int) -> dict[str, Any]:
    """The world is 'nccl'; groups made with torch's other spellings; CPU tensors on each."""
    groups = {"nccl": dist.group.WORLD,
              "cuda:nccl": dist.new_group(backend="cuda:nccl"),
              "cpu:gloo,cuda:nccl": dist.new_group(backend="cpu:gloo,cuda:nccl")}
    out = {}
    for name, g in groups.items():
        t = torch.full((4,), float(rank + 1))
        dist.all_reduce(t, group=g)
        out[name] = (dist.get_backend(g), float(t[0]), g.transport_name)
    return out


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).to(device)


def _batches(n: int, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The whole batch of every step for ``n`` ranks (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4 * n, 8, generator=g).to(device),
             torch.randn(4 * n, 4, generator=g).to(device)) for _ in range(STEPS)]


def _train(model: nn.Module, batches: list[Any], rank: int, n: int) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for x, y in batches:
        rows = slice(4 * rank, 4 * rank + 4) if n > 1 else slice(None)
        loss = nn.functional.mse_loss(model(x[rows]), y[rows])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _compare_ddp(rank: int, n: int, device: torch.device, **ddp_kwargs: Any) -> None:
    local = _model(device)
    ddp = DistributedDataParallel(copy.deepcopy(local), **ddp_kwargs)
    _train(ddp, _batches(n, device), rank, n)
    _train(local, _batches(n, device), 0, 1)          # the whole batch in one process
    for (name, a), b in zip(ddp.module.named_parameters(), local.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=f"rank {rank}: {name}")


def ddp_vs_local(rank: int, n: int) -> str:
    """DDP on cuda:0 with device_ids, against the same training without DDP."""
    device = torch.device("cuda", 0)
    _compare_ddp(rank, n, device, device_ids=[0])
    return "ok"


def shared_gpu(rank: int, n: int) -> str:
    """2 ranks on cuda:0 ('gloo': staged): collectives after a slow kernel, then DDP."""
    device = torch.device("cuda", 0)
    t = torch.full((1 << 16,), float(rank + 1), device=device)
    torch.cuda._sleep(50_000_000)                 # the collective must wait for this kernel
    t.mul_(2)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    expect = 2.0 * sum(range(1, n + 1))
    torch.testing.assert_close(t, torch.full_like(t, expect))
    out = torch.empty(n * 4, device=device)
    dist.all_gather_into_tensor(out, torch.full((4,), float(rank), device=device))
    assert out.cpu().tolist() == [float(r) for r in range(n) for _ in range(4)], out
    _compare_ddp(rank, n, device)
    return "ok"


def fsdp_vs_local(rank: int, n: int, how: str = "cuda") -> str:
    """fully_shard on CUDA against the same training without it.

    ``how``: ``"cuda"`` a CUDA model, the default mesh (a CUDA one); ``"offload"`` the same
    under ``CPUOffloadPolicy`` (shards and grads in pinned CPU memory); ``"cpu-model"`` a CPU
    model on an explicit CUDA mesh (moved to the GPU as shards); ``"cpu-default"`` a CPU model
    and no mesh (the default mesh is a CUDA one whenever CUDA is available, as torch's).
    """
    from ringlet.distributed.device_mesh import init_device_mesh
    from ringlet.distributed.fsdp import CPUOffloadPolicy, fully_shard

    device = torch.device("cuda", 0)
    local = _model(device)
    sharded = copy.deepcopy(local)
    kw: dict[str, Any] = {}
    if how == "offload":
        kw["offload_policy"] = CPUOffloadPolicy()
    elif how == "cpu-model":
        sharded, kw["mesh"] = sharded.cpu(), init_device_mesh("cuda", (n,))
    elif how == "cpu-default":
        sharded = sharded.cpu()
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, **kw)
    fully_shard(sharded, **kw)
    got = _train(sharded, _batches(n, device), rank, n)
    want = _train(local, _batches(n, device), 0, 1)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=1e-4, atol=1e-5)
    for p in sharded.parameters():
        shard, grad = p.to_local(), p.grad.to_local()
        if how == "offload":
            assert shard.device.type == grad.device.type == "cpu", (shard.device, grad.device)
            assert shard.is_pinned() and grad.is_pinned()
        else:
            assert shard.device == grad.device == device, (shard.device, grad.device)
    return "ok"


def _device(device_type: str) -> torch.device:
    """cuda:0 for ``"cuda"`` (every rank shares it), else the CPU."""
    return torch.device("cuda", 0) if device_type == "cuda" else torch.device("cpu")


def _hooked(hook: str) -> tuple[Any, Any]:
    """torch's (state, hook) pair for ``hook``: fp16 / bf16 compression or PowerSGD (rank 1,
    compressing from the second step, with error feedback and warm start)."""
    from ringlet.distributed.algorithms.ddp_comm_hooks import default_hooks
    from ringlet.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as ps

    if hook == "fp16":
        return None, default_hooks.fp16_compress_hook
    if hook == "bf16":
        return None, default_hooks.bf16_compress_hook
    state = ps.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                             start_powerSGD_iter=2, min_compression_rate=0.5, random_seed=7)
    return state, ps.powerSGD_hook


def hooks_vs_cpu(rank: int, n: int, hook: str, device_type: str = "cuda") -> list[float]:
    """DDP with a comm hook on ``device_type`` against the same DDP and hook on the CPU, in the
    same group (its CPU tensors travel on ringlet's transport): the hooks are device-blind, so
    the losses agree to rounding.  Returns the device's losses."""
    runs = []
    for device in (_device(device_type), torch.device("cpu")):
        ids = [0] if device.type == "cuda" else None
        ddp = DistributedDataParallel(_model(device), device_ids=ids)
        ddp.register_comm_hook(*_hooked(hook))
        runs.append(_train(ddp, _batches(n, device), rank, n))
    torch.testing.assert_close(torch.tensor(runs[0]), torch.tensor(runs[1]), rtol=1e-3, atol=1e-4,
                               msg=f"rank {rank}: {hook} on {device_type} vs CPU")
    return runs[0]


def sync_batchnorm_vs_local(rank: int, n: int, device_type: str = "cuda") -> str:
    """SyncBatchNorm over each rank's rows equals BatchNorm over the whole batch: outputs, input
    gradients, running statistics and weight gradients (the latter summed by DDP-less
    all-reduce, as a data-parallel step would)."""
    from ringlet.nn import SyncBatchNorm

    device = _device(device_type)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4 * n, 3, 5, generator=g).to(device)
    local = nn.BatchNorm1d(3).to(device)
    sync = SyncBatchNorm.convert_sync_batchnorm(copy.deepcopy(local))
    mine = x[4 * rank:4 * rank + 4].clone().requires_grad_()
    whole = x.clone().requires_grad_()
    out = sync(mine)
    want = local(whole)
    torch.testing.assert_close(out, want[4 * rank:4 * rank + 4], rtol=1e-4, atol=1e-5)
    (out * out).sum().backward()
    (want * want).sum().backward()
    torch.testing.assert_close(mine.grad, whole.grad[4 * rank:4 * rank + 4], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(sync.running_mean, local.running_mean, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(sync.running_var, local.running_var, rtol=1e-4, atol=1e-6)
    grad = sync.weight.grad.clone()
    dist.all_reduce(grad)
    torch.testing.assert_close(grad, local.weight.grad, rtol=1e-4, atol=1e-5)
    return "ok"


def cpu_twins(rank: int, n: int) -> list[list[float]]:
    """``hooks_vs_cpu`` for each hook and ``sync_batchnorm_vs_local`` with CPU tensors."""
    if sync_batchnorm_vs_local(rank, n, "cpu") != "ok":
        raise AssertionError("sync_batchnorm_vs_local")
    return [hooks_vs_cpu(rank, n, h, "cpu") for h in ("fp16", "bf16", "powersgd")]


def fsdp_amp_vs_local(rank: int, n: int) -> str:
    """fully_shard on CUDA with what GPU scripts add: float16 autocast, torch's GradScaler,
    fused AdamW (and the foreach default of clip_grad_norm_), against one process."""
    from ringlet.distributed.fsdp import fully_shard

    device = torch.device("cuda", 0)
    local = _model(device)
    sharded = copy.deepcopy(local)
    fully_shard(sharded[0])
    fully_shard(sharded)
    runs = []
    for model, r, k in ((sharded, rank, n), (local, 0, 1)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        scaler = torch.amp.GradScaler("cuda", init_scale=1024.0)
        for x, y in _batches(n, device):
            rows = slice(4 * r, 4 * r + 4) if k > 1 else slice(None)
            with torch.autocast("cuda", dtype=torch.float16):
                loss = nn.functional.mse_loss(model(x[rows]).float(), y[rows])
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        runs.append(scaler.get_scale())
    assert runs[0] == runs[1], runs
    for (name, a), b in zip(sharded.named_parameters(), local.parameters()):
        torch.testing.assert_close(a.full_tensor(), b, rtol=1e-2, atol=1e-3,
                                   msg=f"rank {rank}: {name}")
    return "ok"


def fsdp_mixed_precision(rank: int, n: int, device_type: str = "cuda") -> str:
    """fully_shard with MixedPrecisionPolicy(bf16 params, fp32 reduce) on ``device_type``:
    forward computes in bf16 (the unsharded weights seen by the layers are bf16), sharded
    parameters and their gradients stay fp32, and the trained parameters follow fp32 training of
    the same model in one process within bf16's precision."""
    from ringlet.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = _device(device_type)
    local = _model(device)
    sharded = copy.deepcopy(local)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    seen: list[torch.dtype] = []
    for layer in sharded:
        if isinstance(layer, nn.Linear):
            layer.register_forward_pre_hook(lambda m, a: seen.append(m.weight.dtype))
            fully_shard(layer, mp_policy=mp)
    fully_shard(sharded, mp_policy=mp)
    _train(sharded, _batches(n, device), rank, n)
    _train(local, _batches(n, device), 0, 1)          # the whole batch in one process, fp32
    for (name, a), b in zip(sharded.named_parameters(), local.parameters()):
        torch.testing.assert_close(a.full_tensor(), b, rtol=2e-2, atol=1e-2,
                                   msg=f"rank {rank}: {name}")
    assert set(seen) == {torch.bfloat16}, seen
    for p in sharded.parameters():
        shard, grad = p.to_local(), p.grad.to_local()
        assert shard.dtype == grad.dtype == torch.float32, (shard.dtype, grad.dtype)
        assert shard.device.type == grad.device.type == device.type, (shard.device, grad.device)
    return "ok"
