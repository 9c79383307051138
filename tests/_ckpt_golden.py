"""The exact-resume (golden) experiment: run ``_ckpt_train.py`` under ringlet-run with and without a
SIGKILL and compare the final states bit for bit (used by tests/test_checkpoint_resume.py and
scripts/resume_golden.py)."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import torch

TRAIN = Path(__file__).resolve().parent / "_ckpt_train.py"
STEPS = 20


def run(root: Path, kill: tuple[int, ...] = (), restarts: int = 2,
        timeout: float = 120) -> subprocess.CompletedProcess:
    """One launcher run into ``root``; ``kill`` = (rank, step) or (rank, step, bytes into the
    save)."""
    root.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RINGLET_", "TORCHELASTIC_"))}
    cmd = [sys.executable, "-m", "ringlet.distributed.run", "--nproc-per-node", "2",
           "--max-restarts", str(restarts), str(TRAIN), str(root), str(STEPS), *map(str, kill)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def draw(seed: int) -> tuple[int, ...]:
    """A random fault: a rank killed after a random step, or (one case in three) inside a save."""
    rng = random.Random(seed)
    rank = rng.randrange(2)
    if rng.randrange(3) == 0:
        return rank, rng.choice(range(3, STEPS, 3)), rng.randrange(0, 6400)   # a shard is ~6.5 KB
    return rank, rng.randrange(1, STEPS)


def differences(a: Path, b: Path) -> list[str]:
    """What differs between two final.pt files (empty: bitwise equal)."""
    x = torch.load(a / "final.pt", weights_only=True)
    y = torch.load(b / "final.pt", weights_only=True)
    out = [f"param {k}" for k in x["params"] if not torch.equal(x["params"][k], y["params"][k])]
    for i, st in x["optim"]["state"].items():
        out += [f"optim state {i}.{k}" for k, v in st.items()
                if not torch.equal(v, y["optim"]["state"][i][k])]
    if x["optim"]["param_groups"] != y["optim"]["param_groups"]:
        out.append("optim param_groups")
    if not torch.equal(x["rng"], y["rng"]) or x["step"] != y["step"]:
        out.append("rng state or step")
    return out
