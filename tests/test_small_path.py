"""The latency path of small collectives (issue 14.5): what it caches must never change a result.

The small all_reduce/reduce copies through views of the user's memory cached per (address,
dtype, elements), and the validation gate caches the memory verdict of storages torch's
allocator did not make.  These tests reuse addresses with other dtypes and sizes, views at
offsets, freed and reallocated tensors, and check every result and the bytes around it.
"""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import torch

import ringlet.distributed as dist
from ringlet.c10d import _memory, checks
from ringlet.testing import run_threads


def _reused_addresses(rank: int, n: int) -> list[str]:
    bad: list[str] = []

    def check(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
        if not torch.equal(got, want):
            bad.append(f"{name}: got {got.tolist()}, expected {want.tolist()}")

    base = torch.zeros(16, dtype=torch.float64)
    for dtype in (torch.float64, torch.int64, torch.float32, torch.int32, torch.uint8):
        # the same address seen with another dtype and element count each time
        t = base.view(dtype)[:4]
        t.fill_(rank + 1)
        dist.all_reduce(t)
        check(f"{dtype} view", t, torch.full((4,), float(sum(range(1, n + 1)))).to(dtype))
    for k in (1, 3, 7, 2):
        # views at offsets: only their own elements change
        big = torch.arange(12, dtype=torch.float32) + rank
        before = big.clone()
        dist.all_reduce(big[k:k + 3], op=dist.ReduceOp.MAX)
        want = before.clone()
        want[k:k + 3] = torch.arange(k, k + 3, dtype=torch.float32) + n - 1
        check(f"offset {k}", big, want)
    for i in range(20):
        # fresh tensors: the allocator hands out the addresses of freed ones again
        t = torch.full((1 + i % 5,), float(rank + i), dtype=torch.float32)
        dist.all_reduce(t, op=dist.ReduceOp.AVG)
        check(f"fresh {i}", t, torch.full_like(t, sum(r + i for r in range(n)) / n))
    t = torch.full((3,), rank + 2, dtype=torch.int64)
    dist.reduce(t, dst=0, op=dist.ReduceOp.PRODUCT)
    want = torch.full((3,), int(np.prod([r + 2 for r in range(n)])) if rank == 0 else rank + 2)
    check("reduce", t, want)
    flags = torch.tensor([rank == 0, False, True])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    check("bool", flags, torch.tensor([True, False, True]))
    for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.complex64, torch.int8)):
        # broadcast moves bytes: dtypes numpy lacks too, on the address the reduces used
        src = i % n
        t = base.view(dtype)[1:4]
        t.copy_(torch.arange(3).to(dtype) + 10 * rank)
        dist.broadcast(t, src=src)
        check(f"broadcast {dtype}", t, torch.arange(3).to(dtype) + 10 * src)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        # gathers and reduce-scatters, apart and in place (the input a block of the output)
        want = torch.cat([torch.arange(3).to(dtype) + 10 * r for r in range(n)])
        out = base.view(torch.uint8)[:3 * n * dtype.itemsize].view(dtype)
        dist.all_gather_into_tensor(out, torch.arange(3).to(dtype) + 10 * rank)
        check(f"all_gather {dtype}", out, want)
        out.zero_()
        out[3 * rank:3 * rank + 3] = torch.arange(3).to(dtype) + 10 * rank
        dist.all_gather_into_tensor(out, out[3 * rank:3 * rank + 3])
        check(f"all_gather in place {dtype}", out, want)
        if dtype is torch.bfloat16:
            continue
        inp = torch.arange(2 * n).to(dtype) * (rank + 1)
        sums = torch.arange(2 * n).to(dtype) * sum(range(1, n + 1))
        res = torch.full((2,), -1).to(dtype)
        dist.reduce_scatter_tensor(res, inp)
        check(f"reduce_scatter {dtype}", res, sums[2 * rank:2 * rank + 2])
        dist.reduce_scatter_tensor(inp[2 * rank:2 * rank + 2], inp)
        check(f"reduce_scatter in place {dtype}", inp[2 * rank:2 * rank + 2],
              sums[2 * rank:2 * rank + 2])
    return bad


def test_small_all_reduce_on_reused_addresses_dtypes_and_offsets() -> None:
    for n in (2, 3):
        assert run_threads(_reused_addresses, n) == [[]] * n


def test_memory_verdicts_die_with_their_storage() -> None:
    arrays = [np.arange(4, dtype=np.float32) for _ in range(3)]
    before = len(_memory._verdicts)
    tensors = [torch.from_numpy(a) for a in arrays]
    for t in tensors:
        assert not t.untyped_storage().resizable()
        assert checks.dense(t, "all_reduce", "tensor", out=True) == (t, True)
    assert len(_memory._verdicts) == before + 3
    storage: Any = tensors[0].untyped_storage()
    assert _memory.refusal(storage, True) == ""
    del tensors, storage, arrays, t
    gc.collect()
    assert len(_memory._verdicts) == before


def test_dense_agrees_with_tensor_and_plain() -> None:
    cases = [torch.ones(3), torch.ones(()), torch.ones(0), torch.ones(4, 2).t(),
             torch.ones(3, 1).expand(3, 1), torch.ones(2, 2)[:, :1],
             torch.ones(2, dtype=torch.complex64).conj(),
             torch.ones(2, dtype=torch.complex64).conj().imag,     # a real tensor, negative bit
             torch.ones(6)[::2], torch.nn.Parameter(torch.ones(2))]
    for t in cases:
        got, flat = checks.dense(t, "op", "tensor")
        assert got is checks.tensor(t, "op", "tensor") or type(t) is torch.nn.Parameter
        assert flat == checks.plain(got), (t.shape, t.stride())


def _one_rank_async(rank: int, n: int) -> list[Any]:
    """A one-rank group's asynchronous ops run on the caller's thread: complete when returned,
    with the right values, futures and errors as on the communication thread."""
    t = torch.full((5,), 3.0)
    work = dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5), async_op=True)
    done_at_return = work.is_completed()
    fut = dist.all_reduce(t, op=dist.ReduceOp.AVG, async_op=True).get_future()
    out = torch.empty(5)
    gathered = dist.all_gather_into_tensor(out, t, async_op=True)
    sub = dist.new_group([0])
    on_sub = dist.broadcast(t, src=0, group=sub, async_op=True)
    return [done_at_return, work.wait(), t.tolist(), fut.done(), gathered.is_completed(),
            out.tolist(), on_sub.is_completed()]


def test_one_rank_async_ops_complete_on_the_callers_thread() -> None:
    [got] = run_threads(_one_rank_async, 1)
    assert got == [True, True, [1.5] * 5, True, True, [1.5] * 5, True]
