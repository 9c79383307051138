"""Pure tests (no process group): placements, shard arithmetic, redistribution plans, view
grouping."""

from __future__ import annotations

import math

import pytest
import torch

from ringlet.dtensor import _shard_math as sm
from ringlet.dtensor._ops.view import view_groups
from ringlet.dtensor._redistribute import plan
from ringlet.dtensor.placements import Partial, Replicate, Shard, _NormPartial

pytestmark = pytest.mark.timeout(30)

R, S0, S1, P = Replicate(), Shard(0), Shard(1), Partial()


def test_placements_print_compare_and_hash() -> None:
    # repr and str as torch prints them (tests/test_torch_reprs.py compares with torch's objects)
    placements = (S0, Shard(2), R, P, Partial("max"), _NormPartial(norm_type=2.0))
    assert [repr(p) for p in placements] == ["Shard(dim=0)", "Shard(dim=2)", "Replicate()",
                                             "Partial(sum)", "Partial(max)", "_NormPartial(2.0)"]
    assert [str(p) for p in placements] == ["S(0)", "S(2)", "R", "P(sum)", "P(max)", "_NormP(2.0)"]
    assert str(S1) == "S(1)" and repr(_NormPartial(norm_type=math.inf)) == "_NormPartial(inf)"
    assert repr([S0, R]) == "[Shard(dim=0), Replicate()]"
    assert Shard(0) == S0 and Shard(0) != S1 and Replicate() == R and Partial("sum") == P
    assert P != Partial("avg") and _NormPartial() != P and S0 != R
    assert len({Shard(0), Shard(0), Replicate(), Replicate(), Partial(), Partial("sum")}) == 3
    assert S0.is_shard() and S0.is_shard(0) and not S0.is_shard(1) and not S0.is_replicate()
    assert R.is_replicate() and P.is_partial() and P.is_partial("sum") and not P.is_partial("max")


def test_placements_reject_bad_arguments() -> None:
    with pytest.raises(ValueError, match="reduce_op: expected one of"):
        Partial("prod")
    with pytest.raises(TypeError, match="dim: expected an int"):
        Shard("0")  # type: ignore[arg-type]


def test_chunk_sizes_follow_torch_chunk() -> None:
    assert sm.chunk_sizes(33, 2) == [17, 16] and sm.chunk_sizes(3, 4) == [1, 1, 1, 0]
    assert sm.chunk_sizes(5, 4) == [2, 2, 1, 0] and sm.chunk_sizes(0, 3) == [0, 0, 0]
    for size in range(40):
        for n in range(1, 6):
            want = sm.chunk_sizes(size, n)
            pieces = [c.shape[0] for c in torch.arange(size).chunk(n)] if size else []
            assert want == pieces + [0] * (n - len(pieces)), (size, n)
            assert [sm.chunk_size(size, n, i) for i in range(n)] == want
            assert ([sm.chunk_offset(size, n, i) for i in range(n)]
                    == [min(sum(want[:i]), size) for i in range(n)])
    with pytest.raises(ValueError, match="expected a positive number of shards"):
        sm.chunk_sizes(4, 0)


def test_shard_local_chunk_and_partial_partition() -> None:
    t = torch.arange(10).reshape(5, 2)
    assert Shard(0).local_chunk(t, 4, 2).tolist() == [[8, 9]]
    assert Shard(0).local_chunk(t, 4, 3).shape == (0, 2)
    assert Shard(1).local_chunk(t, 2, 1).tolist() == [[1], [3], [5], [7], [9]]
    assert P.partition(t, 0) is t and P.partition(t, 1).abs().sum() == 0
    assert Partial("max").partition(t, 1) is t and Partial("avg").partition(t, 2) is t
    norm = _NormPartial(norm_type=2.0)
    x = torch.tensor([3.0, 4.0])
    assert torch.equal(norm.after_reduce(norm.before_reduce(x), x.dtype), x)


def test_local_shape_and_offset_nests_shards_in_mesh_order() -> None:
    # 5 rows over a 2x2 mesh, both axes on dim 0: 5 -> (3, 2) -> (2, 1), (1, 1)
    got = {c: sm.local_shape_and_offset([5, 3], [2, 2], c, [S0, S0])
           for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert got == {(0, 0): ([2, 3], [0, 0]), (0, 1): ([1, 3], [2, 0]),
                   (1, 0): ([1, 3], [3, 0]), (1, 1): ([1, 3], [4, 0])}
    assert sm.local_shape_and_offset([5, 3], [2, 2], (1, 1), [S1, S0]) == ([2, 1], [3, 2])
    assert sm.size_seen_by_axis([5, 3], [2, 2], (1, 0), [S0, S0], 1, 0) == 2


def test_strides_like_keeps_layout_order() -> None:
    assert sm.strides_like(torch.empty(2, 3), [4, 3]) == (3, 1)
    assert sm.strides_like(torch.empty(3, 2).t(), [4, 3]) == (1, 4)
    assert sm.pad_dim(torch.ones(2, 3), 0, 4).tolist()[2:] == [[0, 0, 0], [0, 0, 0]]


PLANS = [
    ((S0,), (R,), ["all_gather"]), ((R,), (S1,), ["chunk"]), ((P,), (R,), ["all_reduce"]),
    ((P,), (S0,), ["reduce_scatter"]), ((S0,), (S1,), ["all_to_all"]), ((R,), (P,), ["partition"]),
    ((S0,), (P,), ["all_gather", "partition"]),
    ((P,), (Partial("max"),), ["all_reduce", "partition"]),
    ((S0, S1), (R, R), ["all_gather", "all_gather"]), ((S0, R), (S0, R), []),
    ((R, S0), (S0, R), ["all_gather", "chunk"]),
]


def test_plan_picks_one_collective_per_changed_axis() -> None:
    for src, dst, kinds in PLANS:
        steps = plan(src, dst)
        assert [s.kind for s in steps] == kinds, (src, dst, steps)
        cur = list(src)
        for s in steps:
            assert cur[s.axis] == s.src
            cur[s.axis] = s.dst
        assert tuple(cur) == dst
    with pytest.raises(ValueError, match="expected placements for 1 mesh axes"):
        plan((S0,), (R, R))


def test_plan_unshards_inner_axes_before_outer_ones() -> None:
    # [S(0), S(0)] -> [R, S(0)]: the inner axis must gather before the outer one, then split again.
    steps = plan((S0, S0), (R, S0))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "all_gather"), (1, "chunk")]
    # [R, S(1)] -> [S(1), S(1)]: axis 0 must split dim 1 before axis 1 does.
    steps = plan((R, S1), (S1, S1))
    assert [(s.axis, s.kind) for s in steps] == [(1, "all_gather"), (0, "chunk"), (1, "chunk")]
    # Unrelated dims do not force anything.
    assert [s.kind for s in plan((R, S1), (S0, S1))] == ["chunk"]
    assert repr(plan((S0,), (R,))[0]) == "axis 0: S(0)->R (all_gather)"


def test_view_groups_pair_equal_products() -> None:
    assert view_groups([2, 3, 4], [6, 4]) == [([0, 1], [0]), ([2], [1])]
    assert view_groups([6, 4], [2, 3, 4]) == [([0], [0, 1]), ([1], [2])]
    assert view_groups([1, 4], [4]) == [([0, 1], [0])]
    assert view_groups([4], [4, 1]) == [([0], [0]), ([], [1])]
