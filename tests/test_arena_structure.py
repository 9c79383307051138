"""The shared-memory transport's layering (docs/architecture.md, "Shared-memory transport"): the
in-place algorithms are an object the transport holds and reach it only through ``Rounds`` (its
round counter and ``sync_round``), and the start-of-collective fast check has one home."""

from __future__ import annotations

import ast
import pathlib
from typing import Any

import pytest
import torch

import ringlet.distributed as dist
from ringlet.c10d.world import resolve_group
from ringlet.testing import run_threads
from ringlet.transport.arena_algos import ArenaTransport
from ringlet.transport.arena_inplace import INPLACE_MIN_BYTES, InplaceCollectives

TRANSPORT = pathlib.Path(__file__).resolve().parents[1] / "ringlet" / "transport"

pytestmark = pytest.mark.timeout(60)


class _OnlyRounds:
    """Forwards exactly the ``Rounds`` interface to the transport and counts the rounds."""

    def __init__(self, transport: Any) -> None:
        self._t = transport
        self.rounds = 0

    @property
    def step(self) -> int:
        return self._t.step

    def sync_round(self, *args: Any) -> None:
        self.rounds += 1
        self._t.sync_round(*args)


def _through_rounds_only(rank: int, n: int) -> tuple[bool, int]:
    tr = resolve_group(None).transport
    if isinstance(tr, InplaceCollectives) or tr.inplace.rounds is not tr:
        raise AssertionError("the transport must hold its in-place algorithms, not be them")
    spy = _OnlyRounds(tr)
    tr.inplace.rounds = spy
    buf = dist.comm_buffer(INPLACE_MIN_BYTES // 4 + 1).fill_(rank + 1.0)
    dist.all_reduce(buf)
    tr.inplace.rounds = tr
    return bool(torch.equal(buf, torch.full_like(buf, n * (n + 1) / 2))), spy.rounds


def test_in_place_algorithms_use_the_transport_only_through_rounds() -> None:
    assert InplaceCollectives not in ArenaTransport.__mro__
    for exact, rounds in run_threads(_through_rounds_only, 2, timeout=30):
        assert exact
        assert rounds == 2          # the descriptor round and the completion round


def test_the_in_place_module_reads_no_other_attribute_of_its_transport() -> None:
    tree = ast.parse((TRANSPORT / "arena_inplace.py").read_text())
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Attribute) and node.value.attr == "rounds"}
    assert used == {"step", "sync_round"}


def test_the_small_path_threshold_is_checked_in_one_helper() -> None:
    """Outside the constructor (which derives ``_small_max`` from it) ``FAST_BYTES`` is compared
    nowhere: the collectives ask ``_small``, or compare with the one threshold, ``_small_max``."""
    tree = ast.parse((TRANSPORT / "arena_algos.py").read_text())
    methods = [f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name != "__init__"]
    compared = [node.lineno for f in methods for node in ast.walk(f)
                if isinstance(node, ast.Compare)
                and any(isinstance(x, ast.Name) and x.id == "FAST_BYTES" for x in ast.walk(node))]
    assert compared == []
    calls = [node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call)
             and isinstance(node.func, ast.Attribute) and node.func.attr == "_small"]
    assert len(calls) == 3          # all_reduce, reduce_scatter, all_gather
