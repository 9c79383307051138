"""Data-parallel training over ringlet: the README's main job.

Each rank trains a replica of a small character-level language model on its
share of every global batch.  By default the model is wrapped in ringlet's
``DistributedDataParallel`` (bucketed gradient all-reduce overlapped with
backward, over the shared-memory transport); ``--manual`` averages the
gradients with plain ``all_reduce`` calls instead.  Rank 0 also trains a
1-process reference on the whole global batch and prints both losses side by
side: they match, step for step.

Run (2 processes on this host, no server to install)::

    ringlet-run --nproc-per-node 2 examples/train_dp.py --steps 60

Text: the Python standard library's own sources (every machine has them), or
``--text FILE``.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

import ringlet.distributed as dist
from ringlet.nn.parallel import DistributedDataParallel as DDP

CONTEXT = 8
VOCAB = 128


class CharMLP(nn.Module):
    """Predicts the next byte from the previous ``CONTEXT`` bytes."""

    def __init__(self, dim: int = 32, hidden: int = 256) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, dim)
        self.net = nn.Sequential(nn.Linear(CONTEXT * dim, hidden), nn.GELU(),
                                 nn.Linear(hidden, VOCAB))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(self.embed(x).flatten(1))


def load_text(path: str | None) -> torch.Tensor:
    if path is None:
        path = os.path.join(os.path.dirname(os.__file__), "argparse.py")
    with open(path, "rb") as f:
        data = f.read()
    return torch.tensor(list(data), dtype=torch.int64).clamp_(max=VOCAB - 1)


def global_batch(text: torch.Tensor, step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same global batch on every rank (seeded by the step)."""
    g = torch.Generator().manual_seed(1000 + step)
    starts = torch.randint(0, text.numel() - CONTEXT - 1, (size,), generator=g)
    idx = starts[:, None] + torch.arange(CONTEXT + 1)
    window = text[idx]
    return window[:, :CONTEXT], window[:, CONTEXT]


def sgd_step(model: nn.Module, lr: float) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
            p.grad = None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=256, help="global batch size")
    ap.add_argument("--lr", type=float, default=0.5)
    ap.add_argument("--text", default=None)
    ap.add_argument("--manual", action="store_true",
                    help="average gradients with all_reduce, no DDP")
    args = ap.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group()              # env:// from ringlet-run; shm among local ranks
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.batch % world:
        raise SystemExit(f"--batch {args.batch} must divide by the world size {world}")
    torch.manual_seed(0)
    model = CharMLP()
    reference = copy.deepcopy(model) if rank == 0 else None
    if not args.manual:
        model = DDP(model)                 # broadcasts rank 0's parameters, hooks the gradients
    text = load_text(args.text)
    if rank == 0:
        mode = "plain all_reduce" if args.manual else "DistributedDataParallel"
        print(f"data-parallel training ({mode}) on {world} ranks over '{dist.get_backend()}', "
              f"{sum(p.numel() for p in model.parameters())} parameters, global batch {args.batch}",
              flush=True)
    t0 = time.perf_counter()
    for step in range(args.steps):
        x, y = global_batch(text, step, args.batch)
        xs, ys = x[rank::world], y[rank::world]           # this rank's share
        loss = F.cross_entropy(model(xs), ys)
        loss.backward()                                   # DDP averages gradients during backward
        if args.manual:
            for p in model.parameters():                  # average gradients across ranks by hand
                dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
        sgd_step(model, args.lr)
        mean_loss = loss.detach().clone()
        dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
        if reference is not None:
            ref_loss = F.cross_entropy(reference(x), y)
            ref_loss.backward()
            sgd_step(reference, args.lr)
            if step % 10 == 0 or step == args.steps - 1:
                print(f"step {step:3d}  loss {mean_loss.item():.5f}  1-process reference "
                      f"{ref_loss.item():.5f}  "
                      f"({(time.perf_counter() - t0) / (step + 1) * 1e3:.1f} ms/step)", flush=True)
    status = 0
    if reference is not None:
        diff = max((p - q).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters()))
        ok = diff < 1e-4
        print(f"max |parameter - reference| = {diff:.2e}: "
              f"{'matches the 1-process run' if ok else 'DIVERGED from the 1-process run'}",
              flush=True)
        status = 0 if ok else 1
    dist.destroy_process_group()
    return status


if __name__ == "__main__":
    sys.exit(main())
