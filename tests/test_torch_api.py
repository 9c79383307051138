"""torch.distributed's names that migrating scripts reach for (issues 10.3 and 18): Backend and
custom transports, ProcessGroup methods, debug levels, torch's error texts, coalesced dtypes,
sparse all_reduce, profiler events, environment variables.  Ranks are threads unless a real
transport matters."""

from __future__ import annotations

import logging
import time
from datetime import timedelta
from typing import Any

import _api_workers
import pytest
import torch

import ringlet.distributed as dist
from ringlet import _env
from ringlet.distributed import distributed_c10d as c10d
from ringlet.testing import RankFailure, run_threads
from ringlet.testing.procs import raise_first, run_world
from ringlet.transport import selection
from ringlet.transport.inproc import InprocTransport


def test_backend_names_and_availability() -> None:
    assert dist.Backend("GLOO") == "gloo" and dist.Backend.GLOO == "gloo"
    assert dist.Backend("MyThing") == "mything"        # unknown names pass through, lower case
    for bad in (None, 3, ["gloo"]):
        with pytest.raises(ValueError, match="must be a string"):
            dist.Backend(bad)  # type: ignore[arg-type]
    assert dist.is_gloo_available() and not dist.is_mpi_available() and not dist.is_ucc_available()
    assert not dist.is_xccl_available()
    assert dist.is_nccl_available() == hasattr(torch._C, "_nccl_version")
    assert dist.is_backend_available("gloo") and dist.is_backend_available("tcp")
    assert not dist.is_backend_available("nope")


_registered: list[str] = []


def _register_wrapping_inproc() -> str:
    name = "testwrap"
    if name not in _registered:
        def make(store: Any, rank: int, size: int, timeout: timedelta) -> InprocTransport:
            assert isinstance(timeout, timedelta)
            return InprocTransport.create(store, rank, size, timeout.total_seconds(), "testwrap")
        dist.Backend.register_backend(name, make, devices=["cpu"])
        _registered.append(name)
    return name


def test_register_backend_plugs_a_user_transport_into_new_group() -> None:
    name = _register_wrapping_inproc()
    assert dist.Backend.TESTWRAP == name and dist.is_backend_available(name)
    with pytest.raises(ValueError, match="already registered"):
        dist.Backend.register_backend(name, lambda *a: None)
    with pytest.raises(ValueError, match="built-in"):
        dist.Backend.register_backend("gloo", lambda *a: None)

    def body(rank: int, n: int) -> tuple[str, str, float]:
        g = dist.new_group(backend=name)
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, group=g)
        return dist.get_backend(g), g.transport_name, float(t[0])
    assert run_threads(body, 2) == [(name, name, 3.0)] * 2


def test_a_registered_creator_must_return_a_transport() -> None:
    selection.register_transport("testbogus", lambda store, rank, size, timeout: object())

    def body(rank: int, n: int) -> None:
        dist.new_group(backend="testbogus")
    with pytest.raises(RankFailure, match="expected a ringlet.transport.base.Transport"):
        run_threads(body, 1)


def test_get_backend_answers_the_name_given_and_repr_shows_the_transport() -> None:
    got = raise_first(run_world(2, _api_workers.backend_names, backend="gloo", timeout=60))
    for g in got:
        assert g["backend"] == g["name"] == g["config"] == "gloo"
        assert g["transport"] == "shm" and g["repr"].endswith("gloo on shm)"), g


def test_process_group_methods_torch_style() -> None:
    def body(rank: int, n: int) -> dict[str, Any]:
        pg = c10d._get_default_group()
        assert repr(pg) == repr(dist.group.WORLD)
        t = torch.tensor([float(rank + 1)])
        fut = pg.allreduce([t]).get_future()
        summed = fut.wait()[0].item()
        b = torch.tensor([float(rank)])
        pg.broadcast([b], dist.BroadcastOptions(rootRank=1)).wait()
        outs = [torch.empty(1) for _ in range(n)]
        pg.allgather([outs], [torch.tensor([float(rank)])]).wait()
        rs = torch.empty(1)
        pg.reduce_scatter([rs], [[torch.ones(1) * (r + 1) for r in range(n)]]).wait()
        pg.barrier().wait()
        pg.monitored_barrier(timedelta(seconds=5), wait_all_ranks=True)
        got = torch.empty(1)
        if rank == 0:
            pg.send([torch.tensor([7.0])], 1, 0).wait()
        else:
            w = pg.recv_anysource([got], 0)
            w.wait()
            assert w._source_rank() == 0
        return {"sum": summed, "b": b.item(), "outs": [o.item() for o in outs], "rs": rs.item(),
                "got": got.item() if rank else None, "size": pg.size(), "rank": pg.rank(),
                "name": pg.name(), "count": dist.get_pg_count()}
    a, b = run_threads(body, 2)
    assert a["sum"] == b["sum"] == 3.0 and a["b"] == b["b"] == 1.0
    assert (a["outs"] == b["outs"] == [0.0, 1.0] and (a["rs"], b["rs"]) == (2.0, 4.0)
            and b["got"] == 7.0)
    assert (a["rank"], b["rank"], a["size"], a["name"], a["count"]) == (0, 1, 2, "inproc", 1)


def test_process_group_methods_refuse_several_tensors_per_process() -> None:
    def body(rank: int, n: int) -> None:
        c10d._get_default_group().allreduce([torch.ones(1), torch.ones(1)])
    with pytest.raises(RankFailure, match="expected a tensor or a list of one tensor"):
        run_threads(body, 1)


def test_private_paths_published_code_uses() -> None:
    def body(rank: int, n: int) -> tuple[bool, bool, list[int], str]:
        sub = dist.new_group([0])
        return (c10d._rank_not_in_group(sub), c10d._rank_not_in_group(None),
                c10d._get_pg_config()["ranks"], c10d._get_process_group_name(dist.group.WORLD))
    assert run_threads(body, 2) == [(False, False, [0, 1], "default_pg"),
                                    (True, False, [0, 1], "default_pg")]


def test_debug_level_switches_the_detail_check_on_live_groups(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGLET_DEBUG", raising=False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "INFO")

    def body(rank: int, n: int) -> list[Any]:
        pg = c10d._get_default_group()
        seen = [dist.get_debug_level(), pg.detail_check is None]
        dist.barrier()                         # the level is per process: every rank sets it
        dist.set_debug_level(dist.DebugLevel.DETAIL)
        dist.barrier()
        seen += [dist.get_debug_level(), pg.detail_check is not None]
        dist.all_reduce(torch.ones(1))          # runs with the cross-rank check
        dist.barrier()
        dist.set_debug_level_from_env()
        dist.barrier()
        seen += [dist.get_debug_level(), pg.detail_check is None]
        return seen
    try:
        got = run_threads(body, 2)
    finally:
        dist.set_debug_level_from_env()
    D = dist.DebugLevel
    assert got[0] == [D.INFO, True, D.DETAIL, True, D.INFO, True]
    with pytest.raises(ValueError, match="OFF, INFO or DETAIL"):
        dist.set_debug_level("LOUD")


def test_monitored_barrier_errors_start_with_torchs_text() -> None:
    def body(rank: int, n: int, wait_all: bool) -> str:
        if rank == 2:
            time.sleep(0.8)
            return ""
        try:
            dist.monitored_barrier(timeout=timedelta(seconds=0.3), wait_all_ranks=wait_all)
        except dist.CollectiveTimeoutError as e:
            return str(e)
        return "passed"
    first = run_threads(body, 3, False, op_timeout=5.0)
    assert first[0].startswith("Rank 2 failed to pass monitoredBarrier in 300 ms\n"), first[0]
    assert "ranks [2]" in first[0]             # ringlet's own report follows
    assert first[1].startswith("Rank 1 successfully reached monitoredBarrier, but received errors "
                               "while waiting for send/recv from rank 0"), first[1]
    assert run_threads(body, 3, True, op_timeout=5.0)[0].startswith("Ranks 2 failed to pass "
                                                                    "monitoredBarrier")


def test_complex_reductions_coalesced_dtypes_and_sparse_sum() -> None:
    def body(rank: int, n: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for op in (dist.ReduceOp.MAX, dist.ReduceOp.BAND):
            with pytest.raises(ValueError, match="^all_reduce does not support"):
                dist.all_reduce(torch.ones(2, dtype=torch.cfloat), op)
            with pytest.raises(ValueError, match="^all_reduce does not support"):
                dist.all_reduce_coalesced([torch.ones(1, dtype=torch.cfloat)], op)
        ts = [torch.full((2,), rank + 1.0), torch.full((3,), complex(rank, 1)),
              torch.full((1,), rank + 1, dtype=torch.int64), torch.full((2,), 2.0 * rank)]
        dist.all_reduce_coalesced(ts)
        out["coalesced"] = [t.tolist() for t in ts]
        idx = torch.tensor([[rank, 2]])
        sp = torch.sparse_coo_tensor(idx, torch.ones(2, 2), (3, 2))
        dist.all_reduce(sp)
        out["sparse"] = (sp.is_sparse, sp.to_dense().tolist())
        with pytest.raises(ValueError, match="ReduceOp.SUM only"):
            dist.all_reduce(sp, dist.ReduceOp.MAX)
        return out
    for got in run_threads(body, 2):
        assert got["coalesced"] == [[3.0, 3.0], [complex(1, 2)] * 3, [3], [2.0, 2.0]]
        assert got["sparse"] == (True, [[1.0, 1.0], [1.0, 1.0], [2.0, 2.0]])


def test_sparse_all_reduce_refuses_ranks_with_different_shapes() -> None:
    def body(rank: int, n: int) -> None:
        sp = torch.sparse_coo_tensor(torch.tensor([[0]]), torch.ones(1), (3 + rank,))
        dist.all_reduce(sp)
    with pytest.raises(RankFailure, match="same sparse layout"):
        run_threads(body, 2)


def test_collectives_are_asynchronous_profiler_events_named_like_torchs() -> None:
    def body(rank: int, n: int) -> list[tuple[str, bool, list[Any]]]:
        t = torch.ones(2, 3, dtype=torch.cfloat)
        outs = [torch.empty(4) for _ in range(n)]
        with torch.autograd.profiler.profile(record_shapes=True) as prof:
            dist.all_reduce(t)
            dist.all_gather(outs, torch.ones(4))
        return [(e.name, e.is_async, e.input_shapes) for e in prof.function_events if ":" in e.name
                and "::" not in e.name and not e.name.startswith("ringlet:group")]
    got = run_threads(body, 1)[0]
    assert (got
            == [("inproc:all_reduce", True, [[2, 3, 2]]),
                ("inproc:all_gather", True, [[4]])]), got


def test_launch_environment_helpers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    assert not dist.is_torchelastic_launched() and dist.get_node_local_rank(fallback_rank=3) == 3
    with pytest.raises(RuntimeError, match="LOCAL_RANK"):
        dist.get_node_local_rank()
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    assert dist.is_torchelastic_launched() and dist.get_node_local_rank() == 1
    assert dist.default_pg_timeout == timedelta(seconds=_env.DEFAULT_TIMEOUT_S)


def test_torch_environment_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RINGLET_IFNAME", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth7,eth8")
    assert _env.ifname() == "eth7"
    monkeypatch.setenv("RINGLET_IFNAME", "lo")
    assert _env.ifname() == "lo"
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "warning")
    assert _env.log_level() == logging.WARNING
    monkeypatch.setenv("TORCH_CPP_LOG_LEVEL", "chatty")
    with pytest.raises(ValueError, match="TORCH_CPP_LOG_LEVEL"):
        _env.log_level()
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    assert _env.show_stacktraces()
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "0")
    assert not _env.show_stacktraces()


def test_hang_reports_carry_full_stacks_with_torch_show_cpp_stacktraces(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from ringlet.c10d import debug

    pg = SimpleNamespace(group_desc="g", group_name="g", ranks=[0, 1], size=lambda: 2)
    states = {1: {"pid": 9, "host": "h", "where": "train.py:3 in step()",
                  "stack": "  File a\n  File b",
                  "groups": {"g": {"seq": 4, "done": 3, "history": [[4, "all_reduce #4"]]}}}}
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "0")
    assert "stack of rank 1" not in debug.format_report(pg, states, [0])
    monkeypatch.setenv("TORCH_SHOW_CPP_STACKTRACES", "1")
    assert "stack of rank 1:\n      File a\n      File b" in debug.format_report(pg, states, [0])


def test_new_subgroups_splits_a_given_group_and_refuses_bad_ranks() -> None:
    def body(rank: int, n: int) -> dict[str, Any]:
        mine, _ = dist.new_subgroups_by_enumeration([[0, 2], [1, 3]])
        sub, subs = dist.new_subgroups(group_size=1, group=mine)
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=mine)
        refused = []
        for bad in ([True, 1], [0.0, 1]):
            try:
                dist.new_group(bad)
            except ValueError as e:
                refused.append("expected ints" in str(e))
        try:
            dist.new_subgroups(group_size=3, group=mine)
        except ValueError as e:
            refused.append("must not exceed" in str(e))
        return {"subs": len(subs), "size": sub.size(), "ranks": dist.get_process_group_ranks(sub),
                "sum": t.item(), "refused": refused}
    for rank, got in enumerate(run_threads(body, 4)):
        assert got["subs"] == 2 and got["size"] == 1 and got["ranks"] == [rank]
        assert got["sum"] == (2.0 if rank % 2 == 0 else 4.0)
        assert got["refused"] == [True, True, True]


def test_sparse_all_reduce_refuses_indices_outside_the_shape() -> None:
    def body(rank: int, n: int) -> str:
        bad = torch.sparse_coo_tensor(torch.tensor([[0, 10**6]]), torch.ones(2), (3,),
                                      check_invariants=False)
        try:
            dist.all_reduce(bad)
        except ValueError as e:
            return str(e)
        return "accepted"
    for msg in run_threads(body, 2):
        assert "expected a valid sparse COO tensor" in msg, msg
