"""Models, training loops and rank bodies shared by the fully_shard tests (module level: they
pickle)."""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import ringlet.distributed as dist
from ringlet.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

# ---------------------------------------------------------------- models


class MLP(nn.Module):
    def __init__(self, dims: tuple[int, ...] = (8, 33, 16, 4)) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in itertools.pairwise(dims))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


class Block(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim)
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Transformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 2, layers: int = 2,
                 seq: int = 8, tie: bool = False) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


_INIT_LOCK = threading.Lock()   # rank threads share torch's global RNG


def make_model(kind: str, seed: int = 0, **kw: Any) -> nn.Module:
    with _INIT_LOCK:
        torch.manual_seed(seed)
        return MLP(**kw) if kind == "mlp" else Transformer(**kw)


def shard_model(model: nn.Module, mesh: Any = None, **kw: Any) -> nn.Module:
    """fully_shard each layer/block, then the root."""
    units = model.layers if isinstance(model, MLP) else model.blocks  # type: ignore[attr-defined]
    for unit in units:
        fully_shard(unit, mesh=mesh, **kw)
    fully_shard(model, mesh=mesh, **kw)
    return model


# ---------------------------------------------------------------- data and steps


def batch(kind: str, step: int, rows: int,
          model: nn.Module | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic global batch of ``rows`` samples for ``step`` (small values: sums near
    exact)."""
    g = torch.Generator().manual_seed(1000 + step)
    if kind == "mlp":
        x = torch.randint(-3, 4, (rows, 8), generator=g).float() / 4
        y = torch.randint(-3, 4, (rows, 4), generator=g).float() / 4
        return x, y
    idx = torch.randint(0, 32, (rows, 8), generator=g)
    return idx, torch.randint(0, 32, (rows, 8), generator=g)


def loss_fn(kind: str, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if kind == "mlp":
        return F.mse_loss(out.float(), y)
    return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))


def make_opt(params: Any, lr: float = 1e-2) -> torch.optim.Optimizer:
    # eps 1e-4, not 1e-8: the attention key bias has a gradient that is 0 in exact arithmetic
    # (softmax ignores a shift of every score), and Adam would blow its ~1e-9 rounding noise,
    # which depends on summation order, up to lr-sized steps.
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.1, eps=1e-4)


def full_params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().clone()
    return out


def train_pair(rank: int, world: int, kind: str, steps: int = 10, rows: int = 4,
               shard: Callable[[nn.Module], nn.Module] | None = None,
               model_kw: dict[str, Any] | None = None,
               prepare: Callable[[nn.Module], Any] | None = None
               ) -> tuple[list[float], list[float], float]:
    """Train a sharded model and a single-process reference on the same data.

    ``prepare(model)`` runs before the reference is copied (e.g. to freeze parameters).
    Returns (sharded losses averaged over ranks, reference losses, max param difference).
    """
    model = make_model(kind, **(model_kw or {}))
    if prepare is not None:
        prepare(model)
    ref = copy.deepcopy(model)
    (shard or shard_model)(model)
    opt, ref_opt = make_opt(model.parameters()), make_opt(ref.parameters())
    losses, ref_losses = [], []
    for step in range(steps):
        x, y = batch(kind, step, rows * world)
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = loss_fn(kind, model, x[mine], y[mine])
        loss.backward()
        opt.step()
        opt.zero_grad()
        avg = loss.detach().clone()
        dist.all_reduce(avg, op=dist.ReduceOp.AVG)
        losses.append(avg.item())
        ref_loss = loss_fn(kind, ref, x, y)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    got, want = full_params(model), full_params(ref)
    diff = max((got[k] - want[k]).abs().max().item() for k in want)
    return losses, ref_losses, diff


def is_fsdp(m: nn.Module) -> bool:
    return isinstance(m, FSDPModule)


def freeze_some(model: nn.Module) -> None:
    for blk in model.blocks:  # type: ignore[attr-defined]
        blk.fc.weight.requires_grad_(False)
        blk.ln1.bias.requires_grad_(False)


def bf16_policy() -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


# ---------------------------------------------------------------- torch's fully_shard as the oracle


def torch_oracle(rank: int, world: int, gloo_file: str, steps: int = 10,
                 rows: int = 4) -> dict[str, tuple[list[float], list[float], float]]:
    """Train each model with ringlet's fully_shard and torch's (gloo) side by side, fp32 and bf16.

    Returns, per "kind/precision", (ringlet's losses, torch's losses, max difference of the final
    full parameters).  One world for every case: starting processes and gloo costs seconds.
    """
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh as torch_mesh

    tdist.init_process_group("gloo", init_method=f"file://{gloo_file}", rank=rank, world_size=world)
    try:
        mesh = torch_mesh("cpu", (world,))
        return {f"{kind}/{'bf16' if mixed else 'fp32'}": _against_torch(rank, world, mesh, kind,
                                                                        mixed, steps, rows)
                for kind in ("mlp", "transformer") for mixed in (False, True)}
    finally:
        tdist.destroy_process_group()


def _against_torch(rank: int, world: int, mesh: Any, kind: str, mixed: bool, steps: int,
                   rows: int) -> tuple[list[float], list[float], float]:
    from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMP
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = make_model(kind)
    ours = copy.deepcopy(theirs)
    tkw = ({"mp_policy": TorchMP(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}
           if mixed else {})
    for unit in theirs.layers if kind == "mlp" else theirs.blocks:
        torch_fully_shard(unit, mesh=mesh, **tkw)
    torch_fully_shard(theirs, mesh=mesh, **tkw)
    shard_model(ours, **({"mp_policy": bf16_policy()} if mixed else {}))
    results = []
    for model in (ours, theirs):
        opt = make_opt(model.parameters())
        losses = []
        for step in range(steps):
            x, y = batch(kind, step, rows * world)
            mine = slice(rank * rows, (rank + 1) * rows)
            loss = loss_fn(kind, model, x[mine], y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            avg = loss.detach().clone()
            dist.all_reduce(avg)
            losses.append(avg.item() / world)
        results.append(losses)
    got, want = full_params(ours), full_params(theirs)
    return results[0], results[1], max((got[k] - want[k]).abs().max().item() for k in want)
