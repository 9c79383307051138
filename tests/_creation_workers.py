"""Rank bodies for tests/test_group_creation.py (module level: real processes pickle them by
reference).  [Note: group creation] in ringlet/c10d/_creation.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from typing import Any

import torch

import ringlet.distributed as dist
from ringlet.distributed.device_mesh import DeviceMesh

# Overlapping groups of a world of 4, each made by one kind of creation call; a step returns
# (the ranks of every group it made that holds this rank, those groups).
Step = Callable[[int], list[Any]]


def _mesh(ranks: Any) -> Step:
    def make(rank: int) -> list[Any]:
        mesh = DeviceMesh("cpu", ranks)
        return [g for g in mesh.get_all_groups() if g is not dist.GroupMember.NON_GROUP_MEMBER]
    return make


def _group(ranks: list[int]) -> Step:
    def make(rank: int) -> list[Any]:
        g = dist.new_group(ranks)
        return [] if g is dist.GroupMember.NON_GROUP_MEMBER else [g]
    return make


def _split(splits: list[list[int]]) -> Step:
    def make(rank: int) -> list[Any]:
        g = dist.split_group(split_ranks=splits)
        return [] if g is None else [g]
    return make


STEPS: dict[str, Step] = {
    "mesh[0,3]": _mesh([0, 3]),
    "mesh[0,1,3]": _mesh([0, 1, 3]),
    "mesh[[0],[3]]": _mesh([[0], [3]]),
    "mesh[[0,1],[2,3]]": _mesh([[0, 1], [2, 3]]),
    "group[1,2]": _group([1, 2]),
    "group[0,2,3]": _group([0, 2, 3]),
    "split[[0,3],[1,2]]": _split([[0, 3], [1, 2]]),
}


Made = list[tuple[list[int], float]]


def create_in_order(rank: int, n: int, orders: list[list[str]]) -> list[Made]:
    """For each order: create its steps' groups in that order, then all_reduce on every group this
    rank holds (after all are made, so a late creation cannot hide behind an early collective);
    returns, per order, (group ranks, sum of the members' rank + 1) per group."""
    out = []
    for order in orders:
        groups = [g for name in order for g in STEPS[name](rank)]
        got = []
        for g in groups:
            t = torch.tensor([float(rank + 1)])
            dist.all_reduce(t, group=g)
            got.append((dist.get_process_group_ranks(g), float(t[0])))
        out.append(got)
    return out


def differing_lists(rank: int, n: int) -> str:
    """Ranks 0, 1 ask for [0, 1] while ranks 2, 3 ask for [2, 3]: torch's contract says the same
    list everywhere; each rank reports what it raised."""
    try:
        dist.new_group([0, 1] if rank < 2 else [2, 3])
    except ValueError as e:
        g = dist.new_group([0, 1, 2, 3])          # the world goes on: the next creation works
        t = torch.ones(1)
        dist.all_reduce(t, group=g)
        return f"{e} || then {float(t[0])}"
    return "no error"


def swapped_order(rank: int, n: int) -> str:
    """Rank 0 creates [0, 1] then [0, 1, 2]; the others the other way round (before: each waited
    for the other in a different group until the timeout)."""
    lists = [[0, 1], [0, 1, 2]]
    try:
        for ranks in lists if rank == 0 else lists[::-1]:
            dist.new_group(ranks)
    except ValueError as e:
        return str(e)
    return "no error"


def leaves_before_mesh(rank: int, n: int, how: str) -> str:
    """Rank 1 gives up before the second mesh (an exception, or SIGKILL); the others must be
    told so at once, not at the timeout."""
    DeviceMesh("cpu", [0, 3])
    if rank == 1:
        if how == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("rank 1 gives up")
    try:
        DeviceMesh("cpu", [0, 1, 3])
    except dist.PeerFailureError as e:
        return f"{type(e).__name__}: {e}"
    return "no error"
