"""Rank bodies for 2-d (data parallel x tensor parallel) tests: DDP or fully_shard over "dp",
DTensor parameters made by hand on "tp" (module level: they pickle for real processes).

The model is a two-layer MLP in Megatron's layout: ``fc1`` column-parallel (weight and bias
``Shard(0)`` on tp), ``fc2`` row-parallel (weight ``Shard(1)``, bias ``Replicate``).  Inputs are
split by dp row; the reference is one process training the same model on the whole batch.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

R = Replicate()
_LOCK = threading.Lock()        # rank threads share torch's global RNG


class TPMLP(nn.Module):
    """Megatron MLP; with ``mesh`` set, forward wraps its input as a Replicate DTensor."""

    def __init__(self, dims: tuple[int, int, int] = (6, 8, 4)) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dims[0], dims[1])
        self.fc2 = nn.Linear(dims[1], dims[2])
        self.mesh: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mesh is not None:
            x = DTensor.from_local(x, self.mesh, [R] * self.mesh.ndim)
        y = self.fc2(torch.relu(self.fc1(x)))
        return y.full_tensor() if isinstance(y, DTensor) else y


TP_PLACEMENTS = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1), "fc2.bias": R}


def make_ref(seed: int = 0, dims: tuple[int, int, int] = (6, 8, 4)) -> TPMLP:
    with _LOCK:
        torch.manual_seed(seed)
        return TPMLP(dims)


def tensor_parallel(model: TPMLP, mesh: Any, tp_axis: int) -> TPMLP:
    """Make the parameters DTensors: the TP placement on ``tp_axis`` of ``mesh``, Replicate elsewhere."""
    model.mesh = mesh
    for name, p in list(model.named_parameters()):
        owner, attr = name.split(".")
        pls = [R] * mesh.ndim
        pls[tp_axis] = TP_PLACEMENTS[name]
        setattr(getattr(model, owner), attr, nn.Parameter(distribute_tensor(p.detach(), mesh, pls)))
    return model


def data(step: int, rows: int, dims: tuple[int, int, int] = (6, 8, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(-3, 4, (rows, dims[0]), generator=g).float() / 4
    y = torch.randint(-3, 4, (rows, dims[2]), generator=g).float() / 4
    return x, y


def reference(steps: int, rows: int, lr: float = 0.05) -> dict[str, torch.Tensor]:
    model = make_ref()
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        x, y = data(step, rows)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def full_state(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in sd.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        raise AssertionError(f"keys differ: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def mesh_2d(dp: int, tp: int) -> Any:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def ddp_tp_train(rank: int, world: int, variant: str, steps: int = 3, rows: int = 4) -> dict[str, Any]:
    """DDP over "dp" of a 2x2 mesh; ``variant``: tp1d (params on mesh["tp"]), tp2d (params on the
    2-d mesh, Replicate on dp), group (process_group=), manual (_pre_dp_module_transform first),
    options (find_unused_parameters and gradient_as_bucket_view)."""
    from ringlet.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_2d(2, world // 2)
    dp = mesh.get_local_rank("dp")
    model = tensor_parallel(make_ref(), mesh if variant == "tp2d" else mesh["tp"], 1 if variant == "tp2d" else 0)
    if variant == "manual":
        _pre_dp_module_transform(model)
    if variant in ("group", "manual"):
        ddp = DDP(model, process_group=mesh["dp"].get_group())
    else:
        kw = {"find_unused_parameters": True, "gradient_as_bucket_view": True} if variant == "options" else {}
        ddp = DDP(model, device_mesh=mesh["dp"], **kw)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    types = sorted({type(p).__name__ for p in ddp.parameters()})
    for step in range(steps):
        x, y = data(step, rows * 2)
        mine = slice(dp * rows, (dp + 1) * rows)
        F.mse_loss(ddp(x[mine]), y[mine]).backward()
        opt.step()
        opt.zero_grad()
    sd = ddp.state_dict()
    out = {"types": types, "sd_types": sorted({type(v).__name__ for v in sd.values()}),
           "diff": max_diff(full_state(sd, "module."), reference(steps, rows * 2))}
    out["round_trip"] = _ddp_reload(sd, mesh, variant)
    return out


def _ddp_reload(sd: dict[str, Any], mesh: Any, variant: str) -> tuple[float, float]:
    """Load the DTensor state dict, then the full-tensor one, into fresh DDP models."""
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    want = full_state(sd, "module.")
    diffs = []
    for source in (sd, {f"module.{k}": v for k, v in want.items()}):
        fresh = make_ref(seed=1)
        tp_mesh = mesh if variant == "tp2d" else mesh["tp"]
        fresh_ddp = DDP(tensor_parallel(fresh, tp_mesh, 1 if variant == "tp2d" else 0), device_mesh=mesh["dp"])
        fresh_ddp.load_state_dict(copy.copy(source))
        diffs.append(max_diff(full_state(fresh_ddp.state_dict(), "module."), want))
    return diffs[0], diffs[1]


def ddp_overlap_refused(rank: int, world: int) -> str:
    """DDP over the whole world of a model whose parameter is sharded over that same world."""
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    mesh = init_device_mesh("cpu", (world,))
    model = nn.Linear(4, 4, bias=False)
    model.weight = nn.Parameter(distribute_tensor(model.weight.detach(), mesh, [Shard(0)]))
    try:
        DDP(model)
    except ValueError as e:
        return str(e)
    return ""
