"""init_process_group's checks (docs/reliability.md, row S5) and the group helpers, with ranks
as threads."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

import ringlet.distributed as dist
from ringlet.c10d import _current
from ringlet.store import HashStore, PrefixStore


def _join_all(specs: list[tuple[int, int]], timeout: float = 2.0) -> list[str]:
    """Run init_process_group for each (rank, world_size) on a thread; return each outcome."""
    store = HashStore()
    out: list[str] = [""] * len(specs)

    def body(i: int, rank: int, ws: int) -> None:
        _current._thread_mode.set(True)
        try:
            # One store object per "process", sharing the data (like TCPStore clients of one
            # server).
            dist.init_process_group("inproc", store=PrefixStore("job", store), rank=rank,
                                    world_size=ws, timeout=timedelta(seconds=timeout))
            out[i] = "ok"
        except Exception as e:
            out[i] = f"{type(e).__name__}: {e}"
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    threads = [threading.Thread(target=body, args=(i, r, w)) for i, (r, w) in enumerate(specs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 10)
    assert not any(t.is_alive() for t in threads)
    return out


def test_local_nonsense_raises_at_once() -> None:
    for rank, ws in [(2, 2), (-1, 2), (0, 0)]:
        with pytest.raises(ValueError, match="rank|world_size"):
            dist.init_process_group("inproc", store=HashStore(), rank=rank, world_size=ws)


def test_rank_claimed_twice_fails_every_rank() -> None:
    out = _join_all([(0, 2), (0, 2)])
    assert all("claimed twice" in o for o in out), out


def test_world_sizes_that_differ_are_named() -> None:
    out = _join_all([(0, 2), (1, 3)])
    assert all("world_size" in o and "rank 0" in o and "rank 1" in o for o in out), out


def test_missing_rank_is_named_after_the_timeout() -> None:
    out = _join_all([(0, 3), (1, 3)], timeout=0.5)
    assert all("2/3 ranks joined" in o and "missing ranks [2]" in o for o in out), out


def test_env_init_errors_name_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MASTER_PORT", raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ValueError, match="MASTER_PORT"):
        dist.init_process_group()
    with pytest.raises(ValueError, match="init_method"):
        dist.init_process_group(init_method="udp://x:1", rank=0, world_size=1)


def test_single_rank_world_over_tcp_init_method() -> None:
    import torch

    # rank 0 hosts the store (port 0: a one-rank world needs no one to find it)
    dist.init_process_group(init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        assert dist.get_backend() == "shm" and dist.get_world_size() == 1
        with pytest.raises(ValueError, match="twice"):
            dist.init_process_group(init_method="env://")
    finally:
        dist.destroy_process_group()
    assert not dist.is_initialized()


def test_file_init_method(tmp_path) -> None:
    import torch

    dist.init_process_group(init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        t = torch.arange(4.0)
        dist.broadcast(t, src=0)
        assert t.tolist() == [0.0, 1.0, 2.0, 3.0]
    finally:
        dist.destroy_process_group()


def test_backend_names() -> None:
    assert dist.get_default_backend_for_device("cpu") == "gloo"
    assert dist.get_default_backend_for_device("cuda:0") == "nccl"
    dist.init_process_group("nccl", store=HashStore(), rank=0, world_size=1)   # docs/gpu.md
    try:
        assert dist.get_backend() == "nccl"
        t = torch.ones(2)
        dist.all_reduce(t)              # CPU tensors run on ringlet's auto transport
        assert t.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()
    assert dist.is_available()
