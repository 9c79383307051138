"""Group creation cannot stall ([Note: group creation] in ringlet/c10d/_creation.py): meshes,
new_group and split_group in any order give working groups; ranks that disagree on a creation
all raise naming each rank's lists; a rank that leaves, dies or fails its set-up is named at
once by the ranks waiting for it."""

from __future__ import annotations

import time
from typing import Any

import _creation_workers as cw
import pytest

from ringlet.testing import run_threads
from ringlet.testing.procs import run_world

# Several orders of the same overlapping creations: forwards, backwards, and interleavings where
# a creation whose members differ from the previous one's comes first.
ORDERS = [
    ["mesh[0,3]", "mesh[0,1,3]", "group[1,2]", "mesh[[0],[3]]", "split[[0,3],[1,2]]"],
    ["split[[0,3],[1,2]]", "mesh[[0],[3]]", "group[1,2]", "mesh[0,1,3]", "mesh[0,3]"],
    ["mesh[0,1,3]", "mesh[0,3]", "mesh[[0,1],[2,3]]", "group[0,2,3]"],
    ["group[0,2,3]", "mesh[[0,1],[2,3]]", "mesh[0,3]", "group[1,2]", "mesh[0,1,3]"],
]


def _expected(rank: int, order: list[str]) -> list[tuple[list[int], float]]:
    """What create_in_order must return on ``rank``: each group holding it, with the sum of
    (member + 1)."""
    groups = {
        "mesh[0,3]": [[0, 3]], "mesh[0,1,3]": [[0, 1, 3]], "mesh[[0],[3]]": [[0, 3], [0], [3]],
        "mesh[[0,1],[2,3]]": [[0, 2], [1, 3], [0, 1], [2, 3]], "group[1,2]": [[1, 2]],
        "group[0,2,3]": [[0, 2, 3]], "split[[0,3],[1,2]]": [[0, 3], [1, 2]],
    }
    out = []
    for name in order:
        for ranks in groups[name]:
            if rank in ranks:
                out.append((ranks, float(sum(r + 1 for r in ranks))))
    return out


@pytest.mark.timeout(120)
def test_overlapping_meshes_and_groups_in_every_order_work_on_processes() -> None:
    res = run_world(4, cw.create_in_order, ORDERS, op_timeout=60.0, timeout=100)
    for r in res:
        assert r.ok, r.message
        assert r.value == [_expected(r.rank, order) for order in ORDERS], (r.rank, r.value)


def test_overlapping_meshes_and_groups_in_every_order_work_on_threads() -> None:
    got = run_threads(cw.create_in_order, 4, ORDERS, op_timeout=30.0)
    assert got == [[_expected(rank, order) for order in ORDERS] for rank in range(4)]


def test_ranks_that_pass_different_lists_all_raise_naming_each_list() -> None:
    got = run_threads(cw.differing_lists, 4, op_timeout=30.0)
    for text in got:
        assert "ranks disagree on the groups of group creation #0" in text, text
        for rank, ranks in ((0, [0, 1]), (1, [0, 1]), (2, [2, 3]), (3, [2, 3])):
            assert f"rank {rank}: new_group [{ranks}]" in text, text
        assert text.endswith("|| then 4.0"), text


def test_ranks_that_create_in_different_orders_are_told_instead_of_waiting() -> None:
    t0 = time.monotonic()
    got = run_threads(cw.swapped_order, 3, op_timeout=60.0)
    assert time.monotonic() - t0 < 50.0          # not the timeout
    for text in got:
        assert ("rank 0: new_group [[0, 1]]" in text and "rank 1: new_group [[0, 1, 2]]" in text
                and "rank 2: new_group [[0, 1, 2]]" in text), text


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["raise", "kill"])
def test_a_rank_that_leaves_before_a_mesh_is_named_by_the_others(how: str) -> None:
    """torch's submesh test ran DeviceMesh([0, 3]) then DeviceMesh([0, 1, 3]); a rank that left
    between them made the others wait for the whole timeout in the shared-memory set-up."""
    res = {r.rank: r for r in run_world(4, cw.leaves_before_mesh, how, op_timeout=60.0,
                                        timeout=100)}
    assert res[1].exc_type == ("RuntimeError" if how == "raise" else "died"), res[1]
    why = ("rank 1 left the world (destroy_process_group) before joining" if how == "raise"
           else f"rank 1 (pid {res[1].value}) exited or died before joining")
    for r in (0, 2, 3):
        assert res[r].ok, res[r].message
        text = res[r].value
        assert text.startswith("PeerFailureError: ") and "DeviceMesh([0, 1, 3])" in text, text
        assert why.split(" (pid")[0] in text and why.split(") ")[-1] in text, text


def test_a_member_whose_set_up_fails_is_named_by_the_other_members() -> None:
    from ringlet.transport import selection

    def factory(store: Any, rank: int, size: int, timeout: Any) -> Any:
        if rank == 0:
            raise RuntimeError("no such device here")
        store.get("never-set")           # what a transport's set-up waits for from rank 0
        raise AssertionError("unreachable: rank 0 never publishes")

    def body(rank: int, n: int) -> str:
        try:
            cw.dist.new_group([0, 1], backend="h5failing")
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    selection.register_transport("h5failing", factory)
    try:
        got = run_threads(body, 2, op_timeout=60.0)
    finally:
        selection._registry.pop("h5failing", None)
    assert got[0] == "RuntimeError: no such device here", got
    assert got[1].startswith("PeerFailureError: "), got
    assert "rank 0 failed to set up the group: RuntimeError: no such device here" in got[1], got


def test_a_mesh_is_one_creation_and_a_whole_world_mesh_none() -> None:
    """The agreement is cheap: one exchange for all of a mesh's groups, none for a 1-d mesh of
    the whole world (it reuses the default group)."""
    from ringlet.c10d.world import current_world

    def body(rank: int, n: int) -> list[int]:
        w = current_world()
        world = tuple(range(n))
        counts = [w.creations.get(world, 0)]
        cw.DeviceMesh("cpu", [[0, 1], [2, 3]])            # 4 groups
        counts.append(w.creations.get(world, 0))
        cw.DeviceMesh("cpu", list(range(n)))              # the default group
        counts.append(w.creations.get(world, 0))
        return counts
    assert run_threads(body, 4, op_timeout=30.0) == [[0, 1, 1]] * 4
