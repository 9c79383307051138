"""Rank bodies for checkpoint tests that need real processes (importable by the forkserver)."""

from __future__ import annotations

import time

import torch

import ringlet.distributed.checkpoint as dcp
from ringlet.distributed.tensor import Shard, distribute_tensor, init_device_mesh


def state(world: int, value: float) -> dict:
    """A small sharded + replicated state whose every element equals ``value``."""
    mesh = init_device_mesh("cpu", (world,))
    return {"w": distribute_tensor(torch.full((64, 1024), value), mesh, [Shard(0)]),
            "b": torch.full((4096,), value), "step": int(value)}


def save(rank: int, world: int, path: str, value: float) -> float:
    """Save ``state(value)``; returns the seconds the call took (raises like dcp.save)."""
    start = time.monotonic()
    dcp.save(state(world, value), checkpoint_id=path)
    return time.monotonic() - start


def load_values(rank: int, world: int, path: str) -> list:
    """The distinct values found in the checkpoint after loading it (and its step)."""
    sd = state(world, -1.0)
    dcp.load(sd, checkpoint_id=path)
    return (sorted(set(sd["w"].full_tensor().unique().tolist()) | set(sd["b"].unique().tolist()))
            + [sd["step"]])


def big_save(rank: int, world: int, path: str) -> None:
    """A save too large for a 1 MiB disk (each rank writes 2 MiB)."""
    mesh = init_device_mesh("cpu", (world,))
    dcp.save({"w": distribute_tensor(torch.full((1024, 1024), 5.0), mesh, [Shard(0)]),
              "b": torch.full((4096,), 5.0), "step": 5}, checkpoint_id=path)


def async_save(rank: int, world: int, path: str, value: float,
               kill_bytes: int | None = None) -> tuple:
    """``async_save`` then wait; rank 1 SIGKILLs itself ``kill_bytes`` into its shard if given."""
    import os

    if kill_bytes is not None and rank == 1:
        os.environ["RINGLET_CKPT_FAULT"] = f"rank=1;after_bytes={kill_bytes};do=sigkill"
    future = dcp.async_save(state(world, value), checkpoint_id=path)
    start = time.monotonic()
    try:
        future.result(timeout=60)
        return "ok", time.monotonic() - start
    except dcp.CheckpointException as e:
        return "failed", time.monotonic() - start, str(e)
