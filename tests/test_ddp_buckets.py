"""Pure tests of DDP's bucket planning and GradBucket (no process group)."""

from __future__ import annotations

import pytest
import torch

from ringlet.parallel.ddp import GradBucket
from ringlet.parallel.ddp._buckets import (
    FIRST_BUCKET_BYTES,
    cap_bytes_from_mb,
    complete_order,
    default_order,
    plan_buckets,
)
from ringlet.parallel.ddp._checks import describe, first_difference

F32, F64, BF16 = torch.float32, torch.float64, torch.bfloat16
MIB = 1 << 20


@pytest.mark.timeout(10)
def test_reverse_registration_order_and_cap() -> None:
    numels = [10, 20, 30, 40]                      # 40, 80, 120, 160 bytes in float32
    plan = plan_buckets(numels, [F32] * 4, default_order(4), cap_bytes=200, first_cap_bytes=100,
                        solo_bytes=1000)
    assert [b.indices for b in plan] == [(3,), (2, 1), (0,)]
    assert [b.offsets for b in plan] == [(0,), (0, 30), (0,)]
    assert [b.numel for b in plan] == [40, 50, 10]
    assert plan[1].nbytes == 200 and not plan[1].solo and plan[0].solo


@pytest.mark.timeout(10)
def test_first_bucket_is_small_like_torch() -> None:
    numels = [MIB // 16] * 40                      # 256 KiB each in float32
    plan = plan_buckets(numels, [F32] * 40, default_order(40), cap_bytes=cap_bytes_from_mb(None))
    assert plan[0].indices == (39, 38, 37, 36)     # closes at 1 MiB
    assert plan[1].indices == tuple(range(35, -1, -1))
    assert FIRST_BUCKET_BYTES == MIB and cap_bytes_from_mb(None) == 25 * MIB


@pytest.mark.timeout(10)
def test_one_dtype_per_bucket_each_with_its_own_first_bucket() -> None:
    dtypes = [F32, F64, F32, BF16, F64]
    plan = plan_buckets([4] * 5, dtypes, default_order(5), cap_bytes=1000, first_cap_bytes=8,
                        solo_bytes=1000)
    for b in plan:
        assert all(dtypes[i] == b.dtype for i in b.indices)
    assert sorted(i for b in plan for i in b.indices) == list(range(5))
    # first bucket of each dtype closes at 8 bytes: (4,) f64, (3,) bf16, (2,) f32
    assert [b.indices for b in plan][:3] == [(4,), (3,), (2,)]


@pytest.mark.timeout(10)
def test_large_parameters_get_solo_buckets_in_ready_order() -> None:
    # [Note: solo buckets]: >= solo_bytes alone (closing the open bucket first), small ones packed
    plan = plan_buckets([5, 1000, 5, 5, 300], [F32] * 5, [4, 3, 2, 1, 0], cap_bytes=10_000,
                        first_cap_bytes=10_000, solo_bytes=400)
    assert [b.indices for b in plan] == [(4,), (3, 2), (1,), (0,)]
    assert [b.solo for b in plan] == [True, False, True, True]
    default = plan_buckets([MIB // 4, 100, 100], [F32] * 3, [0, 1, 2],
                           cap_bytes=cap_bytes_from_mb(25))
    assert [b.indices for b in default] == [(0,), (1, 2)]          # 1 MiB: solo by default
    plan0 = plan_buckets([5, 1000, 5], [F32] * 3, [0, 2, 1], cap_bytes=0)
    assert [b.indices for b in plan0] == [(0,), (2,), (1,)]


@pytest.mark.timeout(10)
def test_observed_order_is_followed_and_completed() -> None:
    assert complete_order([1, 3], 4) == [1, 3, 2, 0]
    plan = plan_buckets([1] * 4, [F32] * 4, complete_order([0, 1], 4), cap_bytes=8,
                        first_cap_bytes=8)
    assert [b.indices for b in plan] == [(0, 1), (3, 2)]


@pytest.mark.timeout(10)
def test_bad_orders_and_caps_raise() -> None:
    with pytest.raises(ValueError, match="permutation"):
        plan_buckets([1, 1], [F32, F32], [0, 0], cap_bytes=8)
    with pytest.raises(ValueError, match="one dtype per parameter"):
        plan_buckets([1, 1], [F32], [0, 1], cap_bytes=8)
    with pytest.raises(ValueError, match="twice"):
        complete_order([1, 1], 3)
    with pytest.raises(ValueError, match=r"\[0, 3\)"):
        complete_order([5], 3)
    with pytest.raises(ValueError, match="bucket_cap_mb >= 0"):
        cap_bytes_from_mb(-1)
    assert (repr(plan_buckets([2], [F32], [0], cap_bytes=8)[0])
            == "BucketPlan(float32, params [0], 8 B)")


@pytest.mark.timeout(10)
def test_grad_bucket_api() -> None:
    p, q = torch.zeros(2, 3), torch.zeros(4)
    buf = torch.arange(10.0)
    b = GradBucket(1, buf, [p, q], [0, 6], is_last=True)
    assert b.index() == 1 and b.is_last() and b.buffer() is buf
    g = b.gradients()
    assert g[0].shape == (2, 3) and g[1].tolist() == [6.0, 7.0, 8.0, 9.0]
    assert g[0].data_ptr() == buf.data_ptr()       # views, not copies
    assert b.parameters()[0] is p and b.offsets() == [0, 6]
    b.set_buffer(torch.ones(10))
    assert b.gradients()[1].tolist() == [1.0] * 4
    with pytest.raises(ValueError, match="expected 10 elements, got 3"):
        b.set_buffer(torch.ones(3))
    assert repr(b) == "GradBucket(index 1, 2 params, float32[10], last)"


@pytest.mark.timeout(10)
def test_model_description_differences() -> None:
    a = describe([("w", torch.zeros(4, 4)), ("b", torch.zeros(4))], [("rm", torch.zeros(4))])
    b = describe([("w", torch.zeros(4, 8)), ("b", torch.zeros(4))], [("rm", torch.zeros(4))])
    assert first_difference(a, a) is None
    assert first_difference(b, a) == ("first difference at entry 0: parameter 'w' [4, 8] float32, "
                                      "rank 0 has parameter 'w' [4, 4] float32")
    c = a[:1] + a[2:]
    assert first_difference(c, a).startswith("1 parameters vs 2; first difference at entry 1: "
                                             "buffer 'rm'")
