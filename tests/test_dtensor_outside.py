"""DTensors on ranks outside their mesh ([Note: ranks outside the mesh] in
ringlet/dtensor/_outside.py): torch's submesh tests build DTensors of DeviceMesh([0, 3]) and
DeviceMesh([0, 1, 3]) on every rank of a world of 4.  Outsiders get DTensors of the global shape
holding torch's empty placeholder (shape (0,); a 0-d result holds a zero), move nothing and wait
for no one; members get the usual values; collectives afterwards find every rank in step."""

from __future__ import annotations

from typing import Any

import _outside_workers as ow
import pytest
import torch

from ringlet.testing import run_threads
from ringlet.testing.procs import run_world

M03, M013 = [0, 3], [0, 1, 3]


def _check(rank: int, got: dict[str, Any], rng: bool = True) -> None:
    """``rng``: the ranks drew from generators of their own (processes), so the drawn values can
    be checked; rank threads share one generator, and only the layout is checked then."""
    def local(key: str, mesh: list[int], member: Any) -> None:
        want = member if rank in mesh else []
        assert got[key][4] == want, (rank, key, got[key])
        if rank not in mesh:
            assert got[key][2] == (0,), (rank, key, got[key])

    torch.manual_seed(0)
    drawn = torch.rand(5)
    at03 = {0: 0, 3: 1}.get(rank)
    at013 = {0: 0, 1: 1, 3: 2}.get(rank)
    assert got["zeros"][:2] == ((4, 2), ("Shard(dim=0)",))
    local("zeros", M03, [0.0] * 4)
    assert got["ones"][3] == "torch.float64"
    local("ones", M013, [1.0] * 3)
    assert got["full"][3] == "torch.int64"
    local("full", M03, [7] * (4 if rank == 0 else 2))
    assert got["empty"] == ((6,), (2,) if rank in M013 else (0,), True)
    if rng:
        local("rand", M03, [] if at03 is None else drawn.chunk(2)[at03].tolist())
    else:
        assert got["rand"][2] == ((3,) if rank == 0 else (2,) if rank == 3 else (0,)), got["rand"]
    assert got["randn"][:2] == ((2, 2), ("Partial(sum)",))
    assert got["b"][:2] == ((4, 2), ("Shard(dim=0)",))
    local("b", M03, [3.0] * 4)
    assert got["b.full"] == ([[3.0, 3.0]] * 4 if rank in M03 else [])
    assert got["b.sum"][:3] == ((), ("Partial(sum)",), ())       # 0-d: torch's zero placeholder
    assert got["b.sum.full"] == (24.0 if rank in M03 else 0.0)
    assert got["equal"] == ((True, False) if rank in M03 else (True, True))
    assert got["add_"] is True
    local("c", M013, [] if at013 is None else [2.0 * at013, 2.0 * at013 + 1])
    local("c.rep", M013, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0])
    assert got["d"][0] == (6,)
    local("d", M013, [float(rank)] * 2)
    assert got["d.full"] == ([0.0, 0.0, 1.0, 1.0, 3.0, 3.0] if rank in M013 else [])
    assert [s[0] for s in got["split"]] == [(4,), (2,)]
    if rank in M013:
        assert got["nonzero"][4] == [1, 2, 3, 4, 5], got["nonzero"]
    else:                            # its global shape is the members' secret
        assert got["nonzero"].startswith(f"aten.nonzero.default: rank {rank} is not part of "
                                         "DeviceMesh("), got["nonzero"]
        assert "depends on the members' values" in got["nonzero"], got["nonzero"]
    assert got["world"] == 4.0
    assert got.get("m03") == (3.0 if rank in M03 else None)
    assert got.get("m013") == (4.0 if rank in M013 else None)


def _in_step(results: list[dict[str, Any]]) -> None:
    """rand/randn drew the whole tensor on every rank: the generator is in step everywhere."""
    assert all(r["after"] == results[0]["after"] for r in results), [r["after"] for r in results]


def test_sub_mesh_dtensors_on_every_rank_of_four_threads() -> None:
    got = run_threads(ow.factories_then_ops, 4, op_timeout=30.0)
    for rank, res in enumerate(got):
        _check(rank, res, rng=False)
    # no _in_step here: rank threads share the process's one generator, so which thread draws
    # which numbers depends on scheduling; the processes test checks the generator


@pytest.mark.timeout(120)
def test_sub_mesh_dtensors_on_every_rank_of_four_processes() -> None:
    res = run_world(4, ow.factories_then_ops, op_timeout=60.0, timeout=100)
    for r in res:
        assert r.ok, r.message
        _check(r.rank, r.value)
    _in_step([r.value for r in res])
