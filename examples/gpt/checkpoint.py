"""Checkpoints every N steps, and ``--resume`` from the newest complete one.

Layout of ``--out``::

    runs/gpt/checkpoints/step_000500/   ringlet.distributed.checkpoint's files: the model and the
                                        optimizer, each rank writing the shards it holds
                    .../trainer.json    the step, the config and the loss history so far

``dcp.save`` commits its files atomically; ``trainer.json`` is written after it returns on
every rank, so a directory without it is an interrupted save and is skipped on resume.
Because the checkpoint records every tensor's global shape, ``--resume`` works under another
strategy or number of ranks too (the shards are re-cut on load).
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import torch
from torch import nn

import ringlet.distributed as dist
import ringlet.distributed.checkpoint as dcp
from ringlet.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from ringlet.distributed.checkpoint.stateful import Stateful

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class AppState(Stateful):
    """Model + optimizer as one ``Stateful``: ``dcp.save``/``dcp.load`` call these two methods.

    ``get_state_dict`` gives fully-qualified names whatever the wrapping (DDP's ``module.``
    prefix removed), sharded tensors as DTensors and optimizer state keyed by parameter name,
    so a checkpoint written under one strategy loads under another.
    """

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state_dict["model"],
                       optim_state_dict=state_dict["optim"])


def step_dir(out: str, step: int) -> str:
    return os.path.join(out, "checkpoints", f"step_{step:06d}")


def save(out: str, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
         trainer_state: dict[str, Any]) -> str:
    """Save after ``step`` steps (every rank calls it); returns the directory."""
    path = step_dir(out, step)
    os.makedirs(path, exist_ok=True)
    dcp.save({"app": AppState(model, optimizer)}, checkpoint_id=path)   # every rank's shards
    if dist.get_rank() == 0:
        tmp = os.path.join(path, "trainer.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"step": step, **trainer_state}, f)
        os.replace(tmp, os.path.join(path, "trainer.json"))
    dist.barrier()
    return path


def latest(out: str) -> str | None:
    """The newest complete checkpoint under ``out``, or None."""
    root = os.path.join(out, "checkpoints")
    if not os.path.isdir(root):
        return None
    steps = sorted((int(m.group(1)), name) for name in os.listdir(root)
                   if (m := _STEP_DIR.match(name)))
    for _, name in reversed(steps):
        if os.path.exists(os.path.join(root, name, "trainer.json")):
            return os.path.join(root, name)
    return None


def load(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load ``path`` into ``model`` and ``optimizer`` in place; returns the trainer state."""
    dcp.load({"app": AppState(model, optimizer)}, checkpoint_id=path)
    with open(os.path.join(path, "trainer.json")) as f:
        return json.load(f)
