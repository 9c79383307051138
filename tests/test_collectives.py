"""Every collective x dtype x reduce op, on threads (inproc) and on processes (shm) against gloo."""

from __future__ import annotations

import os

import _cases
import _workers
import pytest
import torch

import ringlet.distributed as dist
from ringlet.testing import RankFailure, run_threads
from ringlet.testing.procs import raise_first, run_world


@pytest.mark.parametrize("n", [2, 3])
def test_all_cases_on_threads(n: int) -> None:
    for count, failures in run_threads(_cases.run_all, n, timeout=120):
        assert not failures, "\n".join(failures[:20])
        assert count > 500


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n", [2, 3])
def test_all_cases_on_processes_against_gloo(n: int, tmp_gloo: str) -> None:
    for count, failures in raise_first(run_world(n, _cases.run_all, tmp_gloo, timeout=200)):
        assert not failures, "\n".join(failures[:20])
        assert count > 600


def test_subgroups_and_non_members() -> None:
    def body(rank: int, n: int) -> list[int]:
        g = dist.new_group([1, 2])
        evens, subgroups = dist.new_subgroups(group_size=2)
        assert len(subgroups) == 2
        t = torch.tensor([float(rank)])
        ret = dist.all_reduce(t, group=g)
        assert ret is None
        if rank in (0, 3):
            assert g is dist.GroupMember.NON_GROUP_MEMBER
            assert dist.get_rank(g) == -1 and dist.get_world_size(g) == -1
            assert t.item() == float(rank)  # untouched: not a member
        else:
            assert t.item() == 3.0
            assert dist.get_process_group_ranks(g) == [1, 2]
            assert dist.get_group_rank(g, 2) == 1 and dist.get_global_rank(g, 0) == 1
            b = torch.tensor([float(rank)])
            dist.broadcast(b, src=2, group=g)       # src is a global rank
            assert b.item() == 2.0
            c = torch.tensor([float(rank)])
            dist.broadcast(c, group=g, group_src=0)  # group_src is a group rank
            assert c.item() == 1.0
        s = torch.tensor([1.0])
        dist.all_reduce(s, group=evens)
        assert s.item() == 2.0
        assert repr(dist.group.WORLD).startswith("ProcessGroup(rank")
        return dist.get_process_group_ranks(evens)
    assert run_threads(body, 4) == [[0, 1], [0, 1], [2, 3], [2, 3]]


def test_async_work_and_future() -> None:
    def body(rank: int, n: int) -> float:
        t = torch.ones(1000)
        works = [dist.all_reduce(t, async_op=True) for _ in range(5)]
        fut = works[-1].get_future()
        for w in works:
            assert w.wait() is True
        assert all(w.is_completed() and w.is_success() for w in works)
        assert fut.wait()[0] is t
        assert t[0].item() == n ** 5
        w = dist.barrier(async_op=True)
        w.wait()
        w.wait()   # twice is fine
        many = [dist.all_reduce(torch.ones(1), async_op=True) for _ in range(300)]
        for w in many:
            w.wait()
        return float(t[0])
    assert run_threads(body, 2) == [32.0, 32.0]


def test_bad_local_arguments_raise_before_sending_and_group_stays_usable() -> None:
    def body(rank: int, n: int) -> float:
        bad = [
            (ValueError, lambda: dist.broadcast(torch.ones(2), src=5)),
            (ValueError, lambda: dist.broadcast(torch.ones(2), src=-1)),
            (ValueError, lambda: dist.all_gather([torch.ones(2)], torch.ones(2))),
            (TypeError,
             lambda: dist.all_gather([torch.ones(2), torch.ones(2, dtype=torch.int64)],
                                     torch.ones(2))),
            (ValueError, lambda: dist.all_gather_into_tensor(torch.empty(3), torch.ones(2))),
            (ValueError, lambda: dist.reduce_scatter_tensor(torch.empty(2), torch.ones(3))),
            (TypeError, lambda: dist.all_reduce([1, 2])),
            (ValueError, lambda: dist.all_reduce(torch.ones(2, device="meta"))),
            (ValueError, lambda: dist.all_reduce(torch.ones(3).to_sparse(), op=dist.ReduceOp.MAX)),
            (TypeError, lambda: dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)),
            (ValueError, lambda: dist.all_reduce(torch.ones(1).expand(4))),
            (ValueError, lambda: dist.send(torch.ones(1), dst=rank)),
            (ValueError, lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3))),
            (ValueError, lambda: dist.gather(torch.ones(1), [torch.ones(1)] * 2, dst=1 - rank)),
        ]
        for i, (exc, call) in enumerate(bad):
            try:
                call()
            except exc as e:
                assert str(e), i
            else:
                raise AssertionError(f"case {i} did not raise {exc.__name__}")
        t = torch.ones(2)
        dist.all_reduce(t)
        return float(t[0])
    assert run_threads(body, 2) == [2.0, 2.0]


def test_error_message_names_op_and_argument() -> None:
    def body(rank: int, n: int) -> str:
        try:
            dist.broadcast(torch.ones(2), src=7)
        except ValueError as e:
            return str(e)
        return ""
    msgs = run_threads(body, 2)
    assert "broadcast" in msgs[0] and "src" in msgs[0] and "7" in msgs[0]


def test_reduce_op_api() -> None:
    assert dist.ReduceOp.SUM == dist.ReduceOp.RedOpType.SUM
    assert dist.ReduceOp(dist.ReduceOp.MAX) == dist.ReduceOp.MAX
    assert repr(dist._make_nccl_premul_sum(2.0)) == "ReduceOp.PREMUL_SUM(2.0)"
    assert dist.reduce_op.SUM == dist.ReduceOp.SUM
    with pytest.raises(ValueError):
        dist.all_reduce(torch.ones(1), op=dist.ReduceOp.PREMUL_SUM)


def test_objects_safe_mode_refuses_code(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    sentinel = tmp_path / "pwned"
    monkeypatch.setenv("RINGLET_SAFE_OBJECTS", "1")
    with pytest.raises(RankFailure) as info:
        run_threads(_workers.send_evil_object, 2, str(sentinel))
    assert "refuses" in str(info.value)
    assert not sentinel.exists()


def test_unpicklable_object_is_reported_to_peers() -> None:
    def body(rank: int, n: int) -> str:
        obj = (lambda: 1) if rank == 1 else "fine"
        try:
            dist.all_gather_object([None] * n, obj)
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"
    msgs = run_threads(body, 2)
    assert "rank 1 failed to serialize" in msgs[0]
    assert "no error" not in msgs[1]


def test_all_cases_on_processes_without_env_pollution() -> None:
    assert "RINGLET_SAFE_OBJECTS" not in os.environ


def test_object_size_announced_by_a_peer_is_capped_before_allocating() -> None:
    from ringlet.c10d import collectives as C

    def body(rank: int, n: int) -> str:
        if rank == 1:    # a hostile or corrupted peer announces 1 TiB
            sizes = torch.zeros(n, dtype=torch.int64)
            C.all_gather_into_tensor(sizes, torch.tensor([1 << 40]))
            return ""
        try:
            dist.all_gather_object([None] * n, "small")
        except ValueError as e:
            return str(e)
        return "accepted"
    msg = run_threads(body, 2)[0]
    assert ("announced an object of 1099511627776 bytes" in msg
            and "refused before allocating" in msg)


def test_object_from_another_runtime_version_is_named() -> None:
    from ringlet.c10d import collectives as C

    def body(rank: int, n: int) -> str:
        if rank == 1:
            payload = b"XXXX" + b"\x80\x05N."
            sizes = torch.zeros(n, dtype=torch.int64)
            C.all_gather_into_tensor(sizes, torch.tensor([len(payload)]))
            width = int(sizes.max())
            buf = torch.zeros(width, dtype=torch.uint8)
            buf[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            C.all_gather_into_tensor(torch.empty(n * width, dtype=torch.uint8), buf)
            return ""
        try:
            dist.all_gather_object([None] * n, "x")
        except ValueError as e:
            return str(e)
        return "accepted"
    assert "different ringlet version" in run_threads(body, 2)[0]


@pytest.mark.timeout(60)
def test_operations_on_a_group_this_rank_is_not_in_warn_as_torchs() -> None:
    got = raise_first(run_world(3, _workers.non_member_warnings, timeout=50))
    assert got[0] == got[1] == []
    assert got[2] == [f"Running {op} on global rank 2 which does not belong to the given group."
                      for op in ("all_reduce", "broadcast_object_list", "barrier")]
