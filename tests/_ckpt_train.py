"""A small deterministic training job for the exact-resume (golden) test; run it with ringlet-run.

    ringlet-run --nproc-per-node 2 --max-restarts 3 tests/_ckpt_train.py ROOT STEPS [RANK STEP
    [BYTES]]

2 ranks train an MLP with dropout under DDP on a synthetic data set read through a shuffling
DistributedSampler, checkpointing every 3 steps into ROOT/step_<n> (model, Adam state, data
position, every rank's RNG state).  On start it resumes from the newest committed checkpoint.
In the first generation rank RANK SIGKILLs itself after step STEP, or, with BYTES, BYTES bytes into
writing its shard of the checkpoint at step STEP (a multiple of 3).  At the end rank 0
writes ROOT/final.pt (parameters and optimizer state) for a bitwise comparison.
"""

from __future__ import annotations

import os
import signal
import sys
import warnings

import torch
from torch import nn

import ringlet.distributed as dist
import ringlet.distributed.checkpoint as dcp
from ringlet.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from ringlet.distributed.checkpoint.stateful import Stateful
from ringlet.nn.parallel import DistributedDataParallel as DDP
from ringlet.utils.data.distributed import DistributedSampler

EVERY = 3
BATCH = 4


class Job(Stateful):
    """Everything a resumed run needs to continue bit for bit."""

    def __init__(self, model: nn.Module, opt: torch.optim.Optimizer,
                 sampler: DistributedSampler) -> None:
        self.model, self.opt, self.sampler = model, opt, sampler
        self.step = 0
        self.rank = dist.get_rank()

    def state_dict(self) -> dict:
        model_sd, optim_sd = get_state_dict(self.model, self.opt)
        return {"model": model_sd, "optim": optim_sd, "step": self.step,
                "data": {"epoch": self.sampler.epoch},
                f"rng_rank{self.rank}": torch.get_rng_state()}

    def load_state_dict(self, sd: dict) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=sd["model"],
                       optim_state_dict=sd["optim"])
        self.step = sd["step"]
        self.sampler.set_epoch(sd["data"]["epoch"])
        torch.set_rng_state(sd[f"rng_rank{self.rank}"])


def latest(root: str) -> str | None:
    steps = [int(d.split("_")[1]) for d in os.listdir(root)
             if d.startswith("step_") and os.path.exists(os.path.join(root, d, "metadata.json"))]
    return os.path.join(root, f"step_{max(steps)}") if steps else None


def batches(data: torch.Tensor, sampler: DistributedSampler, start: int):
    """The batches of the sampler's epoch from batch ``start`` on (the data position)."""
    idx = list(iter(sampler))
    for b in range(start, len(idx) // BATCH):
        yield data[idx[b * BATCH:(b + 1) * BATCH]]


def main() -> None:
    root, total = sys.argv[1], int(sys.argv[2])
    kill = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else None
    in_save = int(sys.argv[5]) if len(sys.argv) > 5 else None
    first_generation = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    # the other ranks' RNG
    warnings.filterwarnings("ignore", message="load: .* does not ask for: .*rng_rank")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(1234 + rank)                 # per-rank dropout streams
    g = torch.Generator().manual_seed(0)
    data = torch.randn(48, 6, generator=g)
    model = nn.Sequential(nn.Linear(6, 16), nn.Dropout(0.25), nn.Tanh(), nn.Linear(16, 1))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ddp = DDP(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
    sampler = DistributedSampler(range(len(data)), shuffle=True, seed=7)
    job = Job(ddp, opt, sampler)
    found = latest(root)
    if found:
        dcp.load({"job": job}, checkpoint_id=found)
    per_epoch = len(sampler) // BATCH
    while job.step < total:
        sampler.set_epoch(job.step // per_epoch)
        for x in batches(data, sampler, job.step % per_epoch):
            loss = ddp(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            job.step += 1
            if kill == (rank, job.step) and first_generation:
                if in_save is None:
                    os.kill(os.getpid(), signal.SIGKILL)
                os.environ["RINGLET_CKPT_FAULT"] = f"rank={rank};after_bytes={in_save};do=sigkill"
            if job.step % EVERY == 0:
                dcp.save({"job": job}, checkpoint_id=os.path.join(root, f"step_{job.step}"))
            if job.step >= total:
                break
    if rank == 0:
        torch.save({"params": {k: v.detach().clone() for k, v in model.state_dict().items()},
                    "optim": opt.state_dict(), "rng": torch.get_rng_state(), "step": job.step},
                   os.path.join(root, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
