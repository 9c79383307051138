"""Communication buffers in shared memory (comm_buffer) and the in-place collectives on them:
the allocator alone, then ranks as threads (inproc) and as processes (shm), world sizes 2 and 3."""

from __future__ import annotations

import gc
import itertools
import mmap

import _buffer_workers as bw
import pytest
import torch
from _workers import survivors_failed_fast

import ringlet.distributed as dist
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport.arena_buffers import RELEASE_BYTES, BufferHeap, anonymous_heap
from ringlet.transport.arena_inplace import blocks, fold_into
from ringlet.transport.reduce import RedOpType, reduction

REGION = 64 << 20


def _heap(healthy: list[bool] | None = None, n: int = 2, rank: int = 0) -> BufferHeap:
    flag = healthy if healthy is not None else [True]
    return BufferHeap(anonymous_heap(n, REGION), REGION, rank, n, commit=None,
                      healthy=lambda: flag[0])


# -- the allocator, without any group -----------------------------------------------------------
def test_blocks_are_aligned_disjoint_and_reused_after_the_last_view_dies() -> None:
    heap = _heap()
    a, b = heap.allocate(100), heap.allocate(1 << 20)
    assert a is not None and b is not None
    oa, ob = heap.offset_of(a), heap.offset_of(b)
    assert oa % 64 == 0 and ob % mmap.PAGESIZE == 0 and oa + 100 <= ob
    view = b[8:16].view(torch.int32)
    del b
    gc.collect()
    assert heap.live_bytes() == 64 * 2 + (1 << 20), "a view keeps its block"
    del view
    gc.collect()
    c = heap.allocate(1 << 20)
    assert c is not None and heap.offset_of(c) == ob, "the freed block is reused"
    del a, c
    gc.collect()
    assert heap.live_bytes() == 0 and heap._free == [(0, REGION)], "free blocks merge again"


def test_a_full_region_gives_none_and_big_frees_release_pages() -> None:
    heap = _heap()
    big = heap.allocate(REGION - 4096)
    assert big is not None and heap.allocate(8192) is None
    big.fill_(1)
    del big
    gc.collect()
    assert REGION - 4096 >= RELEASE_BYTES
    again = heap.allocate(REGION)
    assert again is not None and int(again[:4096].sum()) == 0, "released pages read as zeros"


def test_after_an_abort_freed_blocks_are_quarantined_and_close_keeps_live_memory() -> None:
    healthy = [True]
    heap = _heap(healthy)
    a = heap.allocate(4096)
    healthy[0] = False
    del a
    gc.collect()
    assert heap.quarantined == 4096 and heap.allocate(1) is not None
    b = heap.allocate(64)
    heap.close()
    assert heap.allocate(64) is None and heap.offset_of(b) == -1
    b.fill_(7)                                   # the mapping outlives the heap while b lives
    assert int(b.sum()) == 7 * 64


def test_peer_views_are_bounds_checked() -> None:
    heap = _heap(n=2, rank=1)
    assert heap.view(0, 128, 10, torch.float32).numel() == 10
    with pytest.raises(ValueError, match="outside"):
        heap.view(0, REGION - 8, 4, torch.float32)
    with pytest.raises(ValueError, match="outside"):
        heap.view(2, 0, 1, torch.float32)


@pytest.mark.parametrize("own", [-1, 0, 1, 2, 3])
def test_the_ordered_fold_gives_the_ordinary_bits_whichever_part_is_the_output(own: int) -> None:
    parts = [torch.randn(1000, dtype=torch.float32) * 10 ** k for k in range(4)]
    red = reduction(RedOpType.AVG, None, torch.float32, 4)
    want = torch.empty(1000)
    red.fold_(want, [p.clone() for p in parts])
    out = parts[own] if own >= 0 else torch.empty(1000)
    fold_into(red, out, parts, own, torch.empty(300))
    assert torch.equal(out, want)


def test_blocks_cover_the_chunk_on_cache_lines() -> None:
    bl = blocks(100, 1000, 3, 4)
    assert bl[0][0] == 100 and bl[-1][1] == 1100
    assert all(b[1] == c[0] for b, c in itertools.pairwise(bl))
    assert all((b - a) % 16 == 0 for a, b in bl[:-1])


# -- ranks as threads (inproc) ---------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 3])
def test_in_place_results_equal_the_ordinary_path_on_threads(n: int) -> None:
    assert run_threads(bw.parity, n, timeout=60) == [10] * n


@pytest.mark.parametrize("n", [2, 3])
def test_mixed_buffers_and_ordinary_tensors_on_threads(n: int) -> None:
    assert run_threads(bw.mixed, n, timeout=60) == [2 ** n] * n


def test_reuse_and_frees_on_threads() -> None:
    for stats in run_threads(bw.reuse, 2, timeout=60):
        assert stats == {"live": 0, "quarantined": 0}


# -- ranks as processes (shm) ----------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("n", [2, 3])
def test_in_place_parity_mixed_and_reuse_on_processes(n: int) -> None:
    assert raise_first(run_world(n, bw.parity, timeout=90)) == [10] * n
    assert raise_first(run_world(n, bw.mixed, timeout=90)) == [2 ** n] * n
    if n == 2:
        assert (raise_first(run_world(n, bw.reuse, timeout=90))
                == [{"live": 0, "quarantined": 0}] * n)


@pytest.mark.timeout(60)
def test_a_buffer_outlives_its_group() -> None:
    assert raise_first(run_world(2, bw.outlives_group, timeout=40)) == [6.0, 6.0]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["kill", "interrupt"])
def test_a_peer_failing_inside_an_in_place_op_fails_the_others_fast(how: str) -> None:
    res = run_world(3, bw.peer_fails_mid_op, how, op_timeout=10.0, timeout=60)
    for got in survivors_failed_fast(res, (0, 2), dead=1, within=3.0):
        assert got["quarantined"] > 0, "buffers freed after an abort must not be reused"
    if how == "kill":
        assert res[1].exitcode != 0
    else:
        assert res[1].value["error"].startswith("KeyboardInterrupt"), res[1].value


@pytest.mark.timeout(60)
def test_without_a_heap_comm_buffer_is_an_ordinary_tensor() -> None:
    env = {"RINGLET_SHM_BUFFER_BYTES": "0"}
    assert raise_first(run_world(2, bw.tcp_gives_plain, env=env, timeout=40)) == [False, False]
    assert (raise_first(run_world(2, bw.tcp_gives_plain, backend="tcp", timeout=40))
            == [False, False])


def test_bad_arguments_are_refused() -> None:
    def body(rank: int, n: int) -> None:
        with pytest.raises(TypeError, match="shape"):
            dist.comm_buffer((2, -1))
        with pytest.raises(TypeError, match="dtype"):
            dist.comm_buffer(4, dtype="float32")   # type: ignore[arg-type]
        assert dist.comm_buffer(0).numel() == 0
    run_threads(body, 2, timeout=30)


# -- DDP keeps its buckets in shared memory
# ---------------------------------------------------------
@pytest.mark.parametrize("as_view", [True, False])
def test_ddp_buckets_in_shared_memory_match_the_reference_on_threads(as_view: bool) -> None:
    for got in run_threads(bw.ddp_parity, 2, as_view, timeout=120):
        assert got["param"] < 1e-12, got
        # Without bucket views a solo bucket reduces .grad itself (no copy in or out).
        assert True in got["solo"] and all(shared
                                           for shared, solo in zip(got["shared"], got["solo"])
                                           if as_view or not solo), got


@pytest.mark.timeout(120)
def test_ddp_buckets_in_shared_memory_on_processes() -> None:
    for got in raise_first(run_world(3, bw.ddp_parity, True, timeout=100)):
        assert got["param"] < 1e-12 and all(got["shared"]), got
