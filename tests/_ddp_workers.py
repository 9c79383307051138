"""Models, data and rank bodies for the DDP tests (module level: they also run in processes).

Models are initialised from their own ``torch.Generator`` (never the global RNG, which rank
threads share), so every rank and the single-process reference build identical models.
Parity: DDP on ``world_size`` ranks, each with its slice of the batch, against one process
that averages the per-rank losses of the same slices (the gradient DDP must produce).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from ringlet.parallel.ddp import DistributedDataParallel as DDP

DT = torch.float64      # parity models run in float64: sums in a different order stay ~1e-15 apart


def init_(module: nn.Module, seed: int, scale: float = 0.5) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype) * scale)
    return module


def data(rank: int, step: int, shape: tuple[int, ...], seed: int = 7,
         high: int = 3) -> torch.Tensor:
    """Small integer-valued inputs for one rank and step."""
    g = torch.Generator().manual_seed(seed * 100003 + step * 101 + rank)
    return torch.randint(-high, high + 1, shape, generator=g).to(DT)


def tokens(rank: int, step: int, shape: tuple[int, ...], vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step * 101 + rank)
    return torch.randint(0, vocab, shape, generator=g)


# ---------------------------------------------------------------- models


def mlp(seed: int = 0, dtype: torch.dtype = DT, width: int = 12) -> nn.Module:
    m = nn.Sequential(nn.Linear(6, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                      nn.Linear(width, 3))
    return init_(m.to(dtype), seed)


def mlp_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x = data(rank, step, (4, 6)).to(next(model.parameters()).dtype)
    return model(x).square().mean()


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (self.qkv(self.ln1(x)).view(b, t, 3, self.heads,
                                              d // self.heads).permute(2, 0, 3, 1, 4))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class TinyGPT(nn.Module):
    """Embedding, pre-LN blocks with SDPA, output head tied to the embedding (``tie=True``)."""

    def __init__(self, vocab: int = 17, d: int = 16, heads: int = 2, layers: int = 2, seq: int = 6,
                 tie: bool = False, ckpt: str | None = None) -> None:
        super().__init__()
        self.vocab, self.ckpt = vocab, ckpt
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        if tie:
            self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for blk in self.blocks:
            if self.ckpt is None:
                x = blk(x)
            else:
                x = checkpoint(blk, x, use_reentrant=self.ckpt == "reentrant")
        return self.head(self.ln(x))


def gpt(seed: int = 0, **kw: Any) -> nn.Module:
    return init_(TinyGPT(**kw).to(DT), seed, scale=0.3)


def gpt_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    idx = tokens(rank, step, (2, 6), 17)
    logits = model(idx)
    return F.cross_entropy(logits[:, :-1].reshape(-1, 17), idx[:, 1:].reshape(-1))


class Branchy(nn.Module):
    """A trunk and three heads: ``a`` on even ranks, ``b`` on odd ranks, ``never`` nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.a, self.b, self.never = (nn.Linear(6, 8), nn.Linear(8, 3), nn.Linear(8, 3),
                                                  nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, which: str) -> torch.Tensor:
        return getattr(self, which)(torch.tanh(self.trunk(x)))


def branchy(seed: int = 0) -> nn.Module:
    return init_(Branchy().to(DT), seed)


def branchy_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    # the rank-to-branch map changes over time
    which = "a" if (rank + step // 5) % 2 == 0 else "b"
    return model(data(rank, step, (4, 6)), which).square().mean()


def bn_net(seed: int = 0) -> nn.Module:
    return (init_(nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
                                nn.Linear(8, 3)).to(DT), seed))


def two_forward_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    """The GAN pattern: two forwards (real, fake) before one backward."""
    real, fake = data(rank, step, (4, 6)), data(rank, step, (4, 6), seed=11)
    return model(real).square().mean() + model(fake).abs().mean()


def frozen_mlp(seed: int = 0) -> nn.Module:
    m = mlp(seed)
    for p in m[0].parameters():
        p.requires_grad_(False)
    return m


class MixedDtypes(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 8).double()
        self.b = nn.Linear(8, 3).float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)).float())


def mixed(seed: int = 0) -> nn.Module:
    return init_(MixedDtypes(), seed)


@dataclasses.dataclass
class Out:
    logits: torch.Tensor
    aux: torch.Tensor
    note: str = "x"


class StructOut(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.body, self.aux = nn.Linear(6, 3), nn.Linear(6, 1)

    def forward(self, x: torch.Tensor) -> Any:
        logits, aux = self.body(x), self.aux(x)
        if self.kind == "dict":
            return {"logits": logits, "aux": aux, "n": 3}
        if self.kind == "tuple":
            return (logits, [aux], None)
        return Out(logits, aux)


def struct_loss(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    out = model(data(rank, step, (4, 6)))
    if isinstance(out, dict):
        logits, aux = out["logits"], out["aux"]
    elif isinstance(out, tuple):
        logits, aux = out[0], out[1][0]
    else:
        logits, aux = out.logits, out.aux
    return logits.square().mean() + aux.mean()


class Strided(nn.Module):
    """A transposed (non-contiguous) parameter: its gradient is strided like it."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(12, 6, dtype=DT).t())
        self.out = nn.Linear(12, 3).to(DT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(x @ self.w))


BUILDERS: dict[str, Callable[[], nn.Module]] = {
    "mlp": mlp, "gpt": gpt, "gpt_tied": lambda: gpt(tie=True), "branchy": branchy, "bn": bn_net,
    "frozen": frozen_mlp, "mixed": mixed, "dict": lambda: init_(StructOut("dict").to(DT), 0),
    "tuple": lambda: init_(StructOut("tuple").to(DT), 0),
    "dataclass": lambda: init_(StructOut("dataclass").to(DT), 0),
    "ckpt_reentrant": lambda: gpt(ckpt="reentrant"), "ckpt_plain": lambda: gpt(ckpt="plain"),
    "mlp32": lambda: mlp(dtype=torch.float32), "strided": lambda: init_(Strided(), 0),
}
LOSSES: dict[str, Callable[[nn.Module, int, int], torch.Tensor]] = {
    "mlp": mlp_loss, "gpt": gpt_loss, "branchy": branchy_loss, "two_forward": two_forward_loss,
    "struct": struct_loss,
}


# ---------------------------------------------------------------- parity


def reference_loss(ref: nn.Module, loss_fn: Callable[..., torch.Tensor], world_size: int, step: int
                   ) -> tuple[torch.Tensor, list[float]]:
    """Mean of every rank's loss on one model; buffers end as rank 0's forward leaves them."""
    start = [b.detach().clone() for b in ref.buffers()]
    losses: list[torch.Tensor] = [torch.zeros(())] * world_size
    for r in reversed(range(world_size)):
        with torch.no_grad():
            for b, s in zip(ref.buffers(), start):
                # .data: no version bump (a saved running stat is not read in training)
                b.data.copy_(s)
        losses[r] = loss_fn(ref, r, step)
    return sum(losses) / world_size, [x.item() for x in losses]


def parity(rank: int, world_size: int, model: str, loss: str, ddp_kw: dict[str, Any],
           steps: int = 20,
           lr: float = 0.05, hook: Any = None, eval_every: int = 0, hook_state: Any = None
           ) -> dict[str, Any]:
    """Train DDP and the reference side by side; return the largest differences seen."""
    build, loss_fn = BUILDERS[model], LOSSES[loss]
    net, ref = build(), build()
    ddp = DDP(net, **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(ddp.process_group if hook_state is None else hook_state, hook)
    ddp.process_group.reset_counts()                  # count the training loop's collectives only
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.5)
    ropt = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.5)
    worst_loss = 0.0
    for step in range(steps):
        if eval_every and rank == 0 and step % eval_every == 0:
            ddp.eval()
            with torch.no_grad():
                loss_fn(ddp, rank, step)              # evaluation on rank 0 only
            ddp.train()
        out = loss_fn(ddp, rank, step)
        out.backward()
        opt.step()
        grads_none = [n for n, p in net.named_parameters() if p.grad is None]
        opt.zero_grad()
        ref_total, ref_losses = reference_loss(ref, loss_fn, world_size, step)
        ref_total.backward()
        ropt.step()
        ropt.zero_grad()
        worst_loss = max(worst_loss, abs(out.item() - ref_losses[rank]))
    return {
        "loss": worst_loss,
        "param": max((a - b).abs().max().item()
                     for a, b in zip(net.parameters(), ref.parameters())),
        "buffer": max([(a.double() - b.double()).abs().max().item()
                       for a, b in zip(net.buffers(), ref.buffers())] + [0.0]),
        "grads_none": grads_none,
        "buckets": [b.plan for b in ddp.reducer.layout.buckets],
        "counts": ddp.process_group.counts(),
    }


def proc_parity(rank: int, world_size: int, *args: Any, **kw: Any) -> dict[str, Any]:
    torch.set_num_threads(1)
    out = parity(rank, world_size, *args, **kw)
    out["buckets"] = [list(b.indices) for b in out["buckets"]]
    return out


# ---------------------------------------------------------------- torch's DDP as the oracle


def mlp_vs_torch(rank: int, world_size: int, steps: int,
                 ddp_kw: dict[str, Any]) -> dict[str, float]:
    """ringlet's and torch's DDP (gloo) in one rank process, same data: losses and parameters
    agree."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    # different seeds per rank: init_sync must fix them
    mine, theirs = mlp(seed=rank), mlp(seed=rank)
    a, b = DDP(mine, **ddp_kw), TorchDDP(theirs, **ddp_kw)
    oa = torch.optim.AdamW(a.parameters(), lr=0.01)
    ob = torch.optim.AdamW(b.parameters(), lr=0.01)
    worst = 0.0
    for step in range(steps):
        la, lb = mlp_loss(a, rank, step), mlp_loss(b, rank, step)
        la.backward()
        lb.backward()
        for opt in (oa, ob):
            opt.step()
            opt.zero_grad()
        worst = max(worst, abs(la.item() - lb.item()))
    diff = max((p - q).abs().max().item() for p, q in zip(mine.parameters(), theirs.parameters()))
    return {"loss": worst, "param": diff}


class _Probe(torch.autograd.Function):
    """Identity whose backward calls ``probe()``: a point in the middle of backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, probe: Callable[[], None]) -> torch.Tensor:
        ctx.probe = probe
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        ctx.probe()
        return grad, None


def overlap_probe(rank: int, world_size: int) -> dict[str, Any]:
    """Are buckets all-reduced while backward is still running?  [l0, probe, l1, l2], bucket per
    layer."""
    import time

    torch.manual_seed(0)
    layers = nn.ModuleList([nn.Linear(64, 256), nn.Linear(256, 256), nn.Linear(256, 256)])
    seen: dict[str, Any] = {}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = _Probe.apply(self.layers[0](x), probe)
            return self.layers[2](torch.relu(self.layers[1](torch.relu(h))))

    def probe() -> None:
        buckets = ddp.reducer.layout.buckets
        seen["launched"] = [b.launched for b in buckets]
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline and not buckets[0].handle.is_completed():
            time.sleep(0.001)        # backward is paused here; only the comm thread can progress
        seen["bucket0_done_inside_backward"] = buckets[0].handle.is_completed()

    ddp = DDP(Net(), bucket_cap_mb=0.2)
    for step in range(2):
        ddp(torch.randn(8, 64)).square().mean().backward()
    seen["buckets"] = [list(b.plan.indices) for b in ddp.reducer.layout.buckets]
    stats = ddp.reducer.last_stats
    seen["done_in_backward"] = stats.bytes_done_in_backward if stats else -1
    seen["bucket0_bytes"] = ddp.reducer.layout.plans[0].nbytes
    return seen


def proc_suite(rank: int, world_size: int, rdzv: str) -> dict[str, Any]:
    """Everything the process tier checks, in one world (processes are the slow tier)."""
    import torch.distributed as tdist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    tdist.init_process_group("gloo", init_method=f"file://{rdzv}", rank=rank, world_size=world_size)
    try:
        return {
            "mlp_default": mlp_vs_torch(rank, world_size, 20, {}),
            "mlp_view": mlp_vs_torch(rank, world_size, 20, {"bucket_cap_mb": 0.0005,
                                                            "gradient_as_bucket_view": True}),
            "join": join_vs_torch(rank, world_size, [3, 5], True),
            "overlap": overlap_probe(rank, world_size),
        }
    finally:
        tdist.destroy_process_group()


# ---------------------------------------------------------------- Join (uneven inputs)


def join_train(rank: int, world_size: int, counts: list[int], divide_initial: bool,
               model: str = "mlp",
               ddp_kw: dict[str, Any] | None = None, ddp_cls: Any = DDP) -> list[torch.Tensor]:
    """Rank r trains on ``counts[r]`` batches inside ``ddp.join()``; returns its final
    parameters."""
    net = BUILDERS[model]()
    ddp = ddp_cls(net, **(ddp_kw or {}))
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.5)
    with ddp.join(divide_by_initial_world_size=divide_initial):
        for step in range(counts[rank]):
            mlp_loss(ddp, rank, step).backward()
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in net.parameters()]


def join_reference(world_size: int, counts: list[int], divide_initial: bool, model: str = "mlp"
                   ) -> list[torch.Tensor]:
    """One process: each step averages the losses of the ranks that still have data."""
    ref = BUILDERS[model]()
    opt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.5)
    for step in range(max(counts)):
        active = [r for r in range(world_size) if step < counts[r]]
        total = sum(mlp_loss(ref, r, step) for r in active)
        (total / (world_size if divide_initial else len(active))).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in ref.parameters()]


def join_vs_torch(rank: int, world_size: int, counts: list[int], divide_initial: bool) -> float:
    """ringlet's DDP+Join and torch's DDP+Join on the same uneven data: largest parameter
    difference."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    mine = join_train(rank, world_size, counts, divide_initial)
    theirs = join_train(rank, world_size, counts, divide_initial, ddp_cls=TorchDDP)
    return max((a - b).abs().max().item() for a, b in zip(mine, theirs))
