"""A small fault-tolerant DDP-style job for tests/test_ft.py (run under ringlet-run).

argv: out_dir steps [kill_replicas kill_step] (kill_replicas: ids separated by commas).
Each process writes one line per step: the step, a hash of its (local) parameters and the
participants; the first process of each replica in ``kill_replicas`` SIGKILLs itself in its
first incarnation after the backward of step ``kill_step``.  With ``RINGLET_REPLICA_SIZE`` > 1
each replica shards the model with ``fully_shard`` over its own processes (HSDP: the Manager
carries the replica dimension), or with tensor parallelism (``FT_TEST_TP=1``).
"""

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import torch
from torch import nn

from ringlet import ft


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def main() -> None:
    out, steps = sys.argv[1], int(sys.argv[2])
    kill = ({int(r) for r in sys.argv[3].split(",")}, int(sys.argv[4])) if len(sys.argv) > 4 \
        else (set(), -1)
    # FT_TEST_FREEZE="replica:step:seconds": that replica stops itself mid-step (not killed).
    freeze = tuple(int(x) for x in os.environ["FT_TEST_FREEZE"].split(":")) \
        if os.environ.get("FT_TEST_FREEZE") else None
    rank = int(os.environ["RANK"])
    sharded = int(os.environ.get("RINGLET_REPLICA_SIZE", "1")) > 1
    torch.manual_seed(rank)          # different on purpose: the first quorum makes them equal
    # FT_TEST_WRONG_ON_RESTART: a restarted replica builds a different model (to be refused).
    restarted = os.environ.get("RINGLET_REPLICA_RESTART", "0") != "0"
    hidden = 17 if restarted and os.environ.get("FT_TEST_WRONG_ON_RESTART") else 16
    model = nn.Sequential(nn.Linear(8, hidden), nn.ReLU(), nn.Linear(hidden, 1))
    if sharded:
        from ringlet.distributed.device_mesh import init_device_mesh
        ft.init_replica_group()
        mesh = init_device_mesh("cpu", (int(os.environ["RINGLET_REPLICA_SIZE"]),))
        if os.environ.get("FT_TEST_TP"):        # each replica a tensor-parallel group
            from ringlet.distributed.tensor.parallel import (
                ColwiseParallel,
                RowwiseParallel,
                parallelize_module,
            )
            parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        else:                                   # each replica a fully_shard group (HSDP)
            from ringlet.distributed.fsdp import fully_shard
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    manager = ft.Manager(model, opt, heartbeat=1.0)
    inc = int(os.environ.get("RINGLET_REPLICA_RESTART", "0"))
    name = f"replica{manager.replica_id}.{manager.position}.jsonl"
    with open(os.path.join(out, name), "a") as log:
        # Go on past ``steps`` while a replica is missing, so that a restarted one rejoins
        # (for at most two minutes: the test then finds the missing replica and fails).
        deadline = time.monotonic() + 120
        while manager.current_step < steps or (manager.num_participants() < manager.num_replicas
                                               and time.monotonic() < deadline):
            try:
                manager.start_quorum()
            except ft.JobFinished:
                print("rejoined too late: the job had finished", flush=True)
                return
            step = manager.current_step
            digest = hashlib.sha256(b"".join(_local(p).detach().numpy().tobytes()
                                             for p in model.parameters())).hexdigest()[:16]
            log.write(json.dumps({"step": step, "hash": digest, "inc": inc, "t": time.time(),
                                  "members": manager.participants()}) + "\n")
            log.flush()
            g = torch.Generator().manual_seed(1000 * step + manager.replica_id)
            x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
            ((model(x) - y) ** 2).mean().backward()
            if manager.replica_id in kill[0] and step == kill[1] and inc == 0 \
                    and manager.position == 0:
                os.kill(os.getpid(), signal.SIGKILL)
            if freeze and freeze[:2] == (manager.replica_id, step):
                # Frozen (SIGSTOP) for freeze[2] s: alive, but past every deadline.
                subprocess.Popen(["sh", "-c", f"sleep {freeze[2]}; kill -CONT {os.getpid()}"])
                os.kill(os.getpid(), signal.SIGSTOP)
            time.sleep(0.05)
            manager.allreduce_gradients(model)
            if manager.should_commit():
                opt.step()
            opt.zero_grad()
        manager.close()
    print(f"replica {manager.replica_id} done at step {manager.current_step}: "
          f"{manager.report.committed} committed, {manager.report.heals_received} heal(s)",
          flush=True)


if __name__ == "__main__":
    main()
