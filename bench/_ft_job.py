"""The job bench/ft.py launches: a small MLP trained for ``--steps`` steps, DDP-style (one process
per replica) or HSDP-style (``RINGLET_REPLICA_SIZE`` processes per replica sharding with
``fully_shard``), in one of two modes:

- ``ft``: ringlet.ft under ``ringlet-run --restart-policy replica``; replicas drop out and rejoin.
- ``restart``: a plain world (DDP, or HSDP on a 2-d mesh) that saves a checkpoint every
  ``--ckpt-every`` steps and, restarted by ``ringlet-run --max-restarts``, resumes from it: what
  torchrun users do today.

Every process appends one JSON line per step to ``<out>/r<rank>.jsonl``: the step, wall time,
a hash of its local parameters, the participants and its incarnation; at the end, the loss of
the final model on a fixed held-out batch.  ``--kill R --kill-step S``: the process of global
rank R SIGKILLs itself after the backward of step S, in its first incarnation only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import time

import torch
from torch import nn

WIDTH = 256


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(model: nn.Module) -> str:
    return hashlib.sha256(b"".join(_local(p).detach().numpy().tobytes()
                                   for p in model.parameters())).hexdigest()[:16]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, WIDTH), nn.ReLU(), nn.Linear(WIDTH, WIDTH), nn.ReLU(),
                         nn.Linear(WIDTH, 1))


def _batch(step: int, replica: int, rows: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 * step + replica)
    x = torch.randn(rows, 64, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).sin()


def _final_loss(model: nn.Module) -> float:
    """The loss on a fixed held-out batch (a sharded model gathers itself in its forward)."""
    x, y = _batch(10**6, 0, rows=256)
    with torch.no_grad():
        return float(((model(x) - y) ** 2).mean())


def _shard(model: nn.Module, mesh: object) -> None:
    from ringlet.distributed.fsdp import fully_shard
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def run_ft(a: argparse.Namespace, log: object, rank: int, inc: int) -> float:
    from ringlet import ft
    size = int(os.environ.get("RINGLET_REPLICA_SIZE", "1"))
    model = _model()
    if size > 1:
        from ringlet.distributed.device_mesh import init_device_mesh
        ft.init_replica_group()
        _shard(model, init_device_mesh("cpu", (size,)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    manager = ft.Manager(model, opt, heartbeat=a.heartbeat)
    deadline = time.monotonic() + 120     # past --steps, wait this long for a restarted replica
    while manager.current_step < a.steps or (manager.num_participants() < manager.num_replicas
                                             and time.monotonic() < deadline):
        try:
            manager.start_quorum()
        except ft.JobFinished:
            return float("nan")
        step = manager.current_step
        log.write(json.dumps({"step": step, "t": time.time(), "hash": _digest(model),
                              "members": manager.participants(), "inc": inc}) + "\n")
        log.flush()
        x, y = _batch(step, manager.replica_id)
        ((model(x) - y) ** 2).mean().backward()
        if rank == a.kill and step == a.kill_step and inc == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        manager.allreduce_gradients(model)
        if manager.should_commit():
            opt.step()
        opt.zero_grad()
    manager.close()
    return _final_loss(model)


def run_restart(a: argparse.Namespace, log: object, rank: int, inc: int) -> float:
    import ringlet.distributed as dist
    dist.init_process_group("auto")
    world = dist.get_world_size()
    size = int(os.environ.get("FT_BENCH_REPLICA_SIZE", "1"))
    model = _model()
    if size > 1:
        from ringlet.distributed.device_mesh import init_device_mesh
        _shard(model, init_device_mesh("cpu", (world // size, size), mesh_dim_names=("r", "s")))
        wrapped = model
    else:
        from ringlet.nn.parallel import DistributedDataParallel
        wrapped = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # A checkpoint counts once every rank has written its file: rank 0 then names it in
    # ckpt-latest (after a barrier), so a rank killed while the others save is no problem.
    latest = os.path.join(a.out, "ckpt-latest")
    start = 0
    if os.path.exists(latest):
        with open(latest) as f:
            saved = int(f.read())
        state = torch.load(os.path.join(a.out, f"ckpt-{saved}-rank{rank}.pt"), weights_only=False)
        for p, v in zip(model.parameters(), state["params"], strict=True):
            _local(p).data.copy_(v)
        opt.load_state_dict(state["opt"])
        start = state["step"]
    replica = rank // size
    for step in range(start, a.steps):
        log.write(json.dumps({"step": step, "t": time.time(), "hash": _digest(model),
                              "members": list(range(world // size)), "inc": inc}) + "\n")
        log.flush()
        x, y = _batch(step, replica)
        ((wrapped(x) - y) ** 2).mean().backward()
        if rank == a.kill and step == a.kill_step and inc == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        opt.step()
        opt.zero_grad()
        if (step + 1) % a.ckpt_every == 0:
            torch.save({"params": [_local(p).detach() for p in model.parameters()],
                        "opt": opt.state_dict(), "step": step + 1},
                       os.path.join(a.out, f"ckpt-{step + 1}-rank{rank}.pt"))
            dist.barrier()
            if rank == 0:
                with open(latest + ".tmp", "w") as f:
                    f.write(str(step + 1))
                os.replace(latest + ".tmp", latest)
    loss = _final_loss(model)
    dist.destroy_process_group()
    return loss


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=("ft", "restart"))
    p.add_argument("out")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--ckpt-every", type=int, default=10)
    p.add_argument("--heartbeat", type=float, default=1.0)
    a = p.parse_args()
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    inc = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    with open(os.path.join(a.out, f"r{rank}.jsonl"), "a") as log:
        loss = (run_ft if a.mode == "ft" else run_restart)(a, log, rank, inc)
        log.write(json.dumps({"final_loss": loss, "t": time.time()}) + "\n")


if __name__ == "__main__":
    main()
