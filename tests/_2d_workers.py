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


TP_PLACEMENTS = {"fc1.weight": Shard(0), "fc1.bias": Shard(0), "fc2.weight": Shard(1),
                 "fc2.bias": R}


def make_ref(seed: int = 0, dims: tuple[int, int, int] = (6, 8, 4)) -> TPMLP:
    with _LOCK:
        torch.manual_seed(seed)
        return TPMLP(dims)


def tensor_parallel(model: TPMLP, mesh: Any, tp_axis: int) -> TPMLP:
    """Make the parameters DTensors: the TP placement on ``tp_axis`` of ``mesh``, Replicate
    elsewhere."""
    model.mesh = mesh
    for name, p in list(model.named_parameters()):
        owner, attr = name.split(".")
        pls = [R] * mesh.ndim
        pls[tp_axis] = TP_PLACEMENTS[name]
        setattr(getattr(model, owner), attr, nn.Parameter(distribute_tensor(p.detach(), mesh, pls)))
    return model


def data(step: int, rows: int,
         dims: tuple[int, int, int] = (6, 8, 4)) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(-3, 4, (rows, dims[0]), generator=g).float() / 4
    y = torch.randint(-3, 4, (rows, dims[2]), generator=g).float() / 4
    return x, y


def reference(steps: int, rows: int, lr: float = 0.05, dims: tuple[int, int, int] = (6, 8, 4),
              adamw: bool = False) -> dict[str, torch.Tensor]:
    model = make_ref(dims=dims)
    opt = make_opt(model.parameters(), adamw)
    for step in range(steps):
        x, y = data(step, rows, dims)
        F.mse_loss(model(x), y).backward()
        if adamw:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def make_opt(params: Any, adamw: bool) -> torch.optim.Optimizer:
    if adamw:
        return torch.optim.AdamW(params, lr=0.05, eps=1e-4, foreach=True)
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def full_state(sd: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    return {k.removeprefix(prefix): (v.full_tensor() if isinstance(v, DTensor)
                                     else v).detach().clone()
            for k, v in sd.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if sorted(a) != sorted(b):
        raise AssertionError(f"keys differ: {sorted(a)} vs {sorted(b)}")
    return max((a[k] - b[k]).abs().max().item() for k in a)


def mesh_2d(dp: int, tp: int) -> Any:
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def ddp_tp_train(rank: int, world: int, variant: str, steps: int = 3,
                 rows: int = 4) -> dict[str, Any]:
    """DDP over "dp" of a 2x2 mesh; ``variant``: tp1d (params on mesh["tp"]), tp2d (params on the
    2-d mesh, Replicate on dp), group (process_group=), manual (_pre_dp_module_transform first),
    options (find_unused_parameters and gradient_as_bucket_view)."""
    from ringlet.distributed.tensor.parallel.ddp import _pre_dp_module_transform
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_2d(2, world // 2)
    dp = mesh.get_local_rank("dp")
    model = tensor_parallel(make_ref(), mesh if variant == "tp2d" else mesh["tp"],
                            1 if variant == "tp2d" else 0)
    if variant == "manual":
        _pre_dp_module_transform(model)
    if variant in ("group", "manual"):
        ddp = DDP(model, process_group=mesh["dp"].get_group())
    else:
        kw = ({"find_unused_parameters": True, "gradient_as_bucket_view": True}
              if variant == "options" else {})
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
        fresh_ddp = DDP(tensor_parallel(fresh, tp_mesh, 1 if variant == "tp2d" else 0),
                        device_mesh=mesh["dp"])
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


# ---------------------------------------------------------------- fully_shard over "dp" (FSDP + TP)


def fsdp_tp_train(rank: int, world: int, variant: str, steps: int = 3,
                  rows: int = 4) -> dict[str, Any]:
    """fully_shard over the data-parallel axes; ``variant``: fsdp (2x2 (dp, tp)), hsdp (2x1x2
    (rep, shard, tp)), tp2d (TP params on the 2x2 mesh itself, Replicate on dp), uneven (sizes
    that split unevenly over dp inside a tp chunk)."""
    from ringlet.distributed.fsdp import fully_shard

    dims = (6, 10, 3) if variant == "uneven" else (6, 8, 4)
    if variant == "hsdp":
        root = init_device_mesh("cpu", (2, 1, 2), mesh_dim_names=("rep", "shard", "tp"))
        dp_mesh, tp_mesh, dp = root["rep", "shard"], root["tp"], root.get_local_rank("rep")
    else:
        root = mesh_2d(2, 2)
        dp_mesh, dp = root["dp"], root.get_local_rank("dp")
        tp_mesh = root if variant == "tp2d" else root["tp"]
    model = tensor_parallel(make_ref(dims=dims), tp_mesh, tp_mesh.ndim - 1)
    fully_shard(model.fc1, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    out: dict[str, Any] = {"placements": {n: "".join(map(str, p.placements))
                                          for n, p in model.named_parameters()},
                           "meshes": sorted({p.device_mesh.mesh_dim_names
                                             for p in model.parameters()})}
    opt = make_opt(model.parameters(), adamw=True)
    dp_pg, tp_pg = dp_mesh.get_group(dp_mesh.ndim - 1), tp_mesh.get_group(tp_mesh.ndim - 1)
    for step in range(steps):
        dp_pg.reset_counts()
        tp_pg.reset_counts()
        x, y = data(step, rows * 2, dims)
        mine = slice(dp * rows, (dp + 1) * rows)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    out["dp_counts"], out["tp_counts"] = dp_pg.counts(), tp_pg.counts()
    sd = model.state_dict()
    out["sd_types"] = sorted({type(v).__name__ for v in sd.values()})
    out["diff"] = max_diff(full_state(sd), reference(steps, rows * 2, dims=dims, adamw=True))
    out["round_trip"] = _fsdp_reload(sd, tp_mesh, dp_mesh, dims)
    return out


def _fsdp_reload(sd: dict[str, Any], tp_mesh: Any, dp_mesh: Any, dims: tuple[int, int, int]
                 ) -> tuple[float, float, float]:
    """Load the 2-d DTensor state dict, the full tensors, and (assign=True) the DTensors again."""
    from ringlet.distributed.fsdp import fully_shard

    want = full_state(sd)
    diffs = []
    for source, assign in ((sd, False), (want, False), (sd, True)):
        fresh = tensor_parallel(make_ref(seed=1, dims=dims), tp_mesh, tp_mesh.ndim - 1)
        fully_shard(fresh.fc1, mesh=dp_mesh)
        fully_shard(fresh, mesh=dp_mesh)
        fresh.load_state_dict(copy.copy(source), assign=assign)
        x, _ = data(0, 2, dims)
        fresh(x).sum().backward()                                  # still trains after loading
        diffs.append(max_diff(full_state(fresh.state_dict()), want))
    return diffs[0], diffs[1], diffs[2]


def fsdp_tp_refusals(rank: int, world: int) -> list[str]:
    """fully_shard over the axis the DTensor is sharded on, and over a mesh without axis names."""
    from ringlet.distributed.device_mesh import DeviceMesh
    from ringlet.distributed.fsdp import fully_shard

    root = mesh_2d(2, 2)
    msgs = []
    unnamed = DeviceMesh("cpu", [[0, 1], [2, 3]])
    for mesh, fsdp_mesh in ((root["tp"], root["tp"]), (unnamed, root["dp"])):
        model = tensor_parallel(make_ref(), mesh, mesh.ndim - 1)
        try:
            fully_shard(model, mesh=fsdp_mesh)
            msgs.append("no error")
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def parallelized_train(rank: int, world: int, mode: str, steps: int = 3) -> float:
    """parallelize_module (Colwise fc1, Rowwise fc2) on "tp", then fully_shard or DDP on "dp":
    AdamW + clip_grad_norm_ vs one process."""
    from ringlet.distributed.fsdp import fully_shard
    from ringlet.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    mesh = mesh_2d(2, world // 2)
    model = make_ref()
    parallelize_module(model, mesh["tp"], {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()})
    net: nn.Module = model
    if mode == "fsdp":
        fully_shard(model.fc1, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
    else:
        net = DDP(model, device_mesh=mesh["dp"])
    opt = make_opt(net.parameters(), adamw=True)
    dp = mesh.get_local_rank("dp")
    for step in range(steps):
        x, y = data(step, 8)
        mine = slice(dp * 4, dp * 4 + 4)
        F.mse_loss(net(x[mine]), y[mine]).backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
    prefix = "module." if mode == "ddp" else ""
    return max_diff(full_state(net.state_dict(), prefix), reference(steps, 8, adamw=True))
