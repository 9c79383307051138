"""Reductions decided once ([Note: reductions] in ringlet/transport/reduce.py): what each reduce op
resolves to per dtype, the fold kernels (torch and numpy, in place or not, host-major order), the
chunker every transport shares, and the refusal of rank subsets by transports without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringlet.transport.base import chunks, whole_group
from ringlet.transport.reduce import RedOpType, reduction


@pytest.mark.timeout(30)
def test_each_op_resolves_to_a_fold_a_pre_scale_and_a_post_scale() -> None:
    avg = reduction(RedOpType.AVG, None, torch.float32, 4)
    assert (avg.fold, avg.pre, avg.post, avg.exact) == (RedOpType.SUM, None, 4, True)
    assert reduction(RedOpType.AVG, None, torch.int64, 4).post == 4
    assert reduction(RedOpType.AVG, None, torch.bool, 4).post == 1        # AVG of bools is an OR
    assert reduction(RedOpType.AVG, None, torch.float32, 1).post == 1
    pre = reduction(RedOpType.PREMUL_SUM, 0.5, torch.float64, 3)
    assert (pre.fold, pre.pre, pre.post, pre.exact) == (RedOpType.SUM, 0.5, 1, False)
    one = reduction(RedOpType.PREMUL_SUM, 1.0, torch.float32, 1)       # 1/world of one rank
    assert (one.fold, one.pre, one.post, one.exact) == (RedOpType.SUM, None, 1, True)
    assert reduction(RedOpType.PREMUL_SUM, 1.0 - 2 ** -24, torch.float32, 2).pre is not None
    mx = reduction(RedOpType.MAX, None, torch.float32, 2)
    assert mx is reduction(RedOpType.MAX, None, torch.float32, 2)        # looked up, not rebuilt
    assert reduction(avg, None, torch.float64, 9) is avg                  # resolved once, passed on
    # stages of a composed reduction: scale and fold; then fold and divide
    assert (avg.partial().post, avg.partial().pre, avg.completing().post) == (1, None, 4)
    assert (pre.partial().pre, pre.completing().pre) == (0.5, None)
    # the numpy kernel serves exact contributions of numpy's dtypes, AVG on floats only
    assert avg.ufunc is np.add and pre.ufunc is None
    assert reduction(RedOpType.AVG, None, torch.int32, 2).ufunc is None
    assert reduction(RedOpType.SUM, None, torch.bfloat16, 2).ufunc is None


@pytest.mark.timeout(30)
def test_fold_kernels_agree_and_fold_in_place_in_rank_order() -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(257, generator=g) * 1e3 for _ in range(4)]
    ref = ((xs[0] + xs[1]) + xs[2]) + xs[3]
    red = reduction(RedOpType.AVG, None, torch.float32, 4)
    out = torch.empty(257)
    red.fold_(out, xs)
    assert torch.equal(out, ref / 4)
    for k in range(4):                     # the output may be any contribution (k >= 2 is copied)
        parts = [x.clone() for x in xs]
        red.fold_(parts[k], parts)
        assert torch.equal(parts[k], ref / 4), k
    npout = np.empty(257, np.float32)
    red.np_fold(npout, [x.numpy() for x in xs])
    assert torch.equal(torch.from_numpy(npout), ref / 4)
    red.fold_(out, xs, groups=[[0, 1], [2, 3]])                              # host-major
    assert torch.equal(out, ((xs[0] + xs[1]) + (xs[2] + xs[3])) / 4)
    ints = reduction(RedOpType.AVG, None, torch.int64, 2)
    t = torch.tensor([7, -7])
    ints.fold_(t, [t, torch.tensor([0, 0])])
    assert t.tolist() == [3, -3]                                             # truncated, as torch
    flags = reduction(RedOpType.SUM, None, torch.bool, 2)
    f = torch.tensor([True, False])
    flags.fold_(f, [f, torch.tensor([False, False])])
    assert f.tolist() == [True, False]
    pre = reduction(RedOpType.PREMUL_SUM, 0.5, torch.float32, 2)
    assert torch.equal(pre.contribution(torch.full((2,), 4.0)), torch.full((2,), 2.0))


@pytest.mark.timeout(30)
def test_one_chunker_and_subsets_refused_where_unsupported() -> None:
    assert chunks(10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert chunks(4, 4) == [(0, 4)] and chunks(0, 4) == [(0, 0)]       # an empty message: one piece
    assert chunks(3, 0) == [(0, 1), (1, 1), (2, 1)]

    class Whole:
        world_size = 3
    whole_group(Whole(), None)              # type: ignore[arg-type]
    whole_group(Whole(), [0, 1, 2])         # type: ignore[arg-type]
    with pytest.raises(NotImplementedError, match=r"subset \[0, 2\]"):
        whole_group(Whole(), [0, 2])        # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_unsigned_dtypes_fold_exactly_and_avg_needs_floats() -> None:
    # torch has no add/min/max kernels for uint16/32/64: they fold on signed views
    from ringlet.transport.reduce import check_op_dtype
    for dtype, bits in ((torch.uint16, 16), (torch.uint32, 32)):
        top = 2**bits - 1
        parts = [torch.tensor([top, 1], dtype=dtype), torch.tensor([2, top], dtype=dtype),
                 torch.tensor([1, 1], dtype=dtype)]
        for op, want in ((RedOpType.SUM, [2, 1]), (RedOpType.MAX, [top, top]),
                         (RedOpType.MIN, [1, 1]), (RedOpType.PRODUCT, [top - 1, top])):
            out = torch.empty(2, dtype=dtype)
            reduction(op, None, dtype, 3).fold_(out, parts)
            assert out.tolist() == want, (dtype, op)
    big = torch.tensor([-1, 5]).view(torch.uint64)            # [2**64 - 1, 5]
    out = torch.empty(2, dtype=torch.uint64)
    reduction(RedOpType.MAX, None, torch.uint64, 2).fold_(out, [big, torch.tensor([7, 3]).view(
        torch.uint64)])
    assert out.tolist() == [2**64 - 1, 5]
    for dtype in (torch.int64, torch.uint8, torch.bool):
        with pytest.raises(TypeError, match="ReduceOp.AVG expects a floating-point"):
            check_op_dtype(RedOpType.AVG, dtype, "all_reduce")
    check_op_dtype(RedOpType.AVG, torch.bfloat16, "all_reduce")
