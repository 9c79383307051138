"""ringlet as a torch.distributed backend: torch's own API, DDP, fully_shard, tensor parallel and
checkpoints over ``init_process_group("ringlet")`` give exactly what they give over torch's gloo,
in the same processes; faults come back as ringlet reports them."""

from __future__ import annotations

import _torch_backend_workers as W
import pytest

from ringlet.testing.procs import raise_first, run_world

pytestmark = pytest.mark.timeout(120)


def _same(a: object, b: object, where: str) -> None:
    if isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _same(x, y, f"{where}[{i}]")
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), where
        for k in a:
            _same(a[k], b[k], f"{where}.{k}")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def test_registered_with_torch_and_gloo_left_alone() -> None:
    import torch.distributed as tdist

    import ringlet  # noqa: F401

    assert "ringlet" in tdist.Backend.backend_list
    assert tdist.Backend.default_device_backend_map["cpu"] == "gloo"
    assert tdist.Backend.backend_capability["ringlet"] == ["cpu", "cuda"]


def test_every_collective_equals_gloo(tmp_path) -> None:
    for rank, got in enumerate(raise_first(run_world(2, W.collectives, str(tmp_path / "init"),
                                                     timeout=100))):
        assert got["gloo"]["backend"] == "gloo" and got["ringlet"]["backend"] == "ringlet"
        got["gloo"].pop("backend")
        got["ringlet"].pop("backend")
        _same(got["gloo"], got["ringlet"], f"rank {rank}")


def test_torch_ddp_fsdp_tp_and_dcp_equal_gloo(tmp_path) -> None:
    per_rank = raise_first(run_world(2, W.strategies, str(tmp_path / "init"),
                                     str(tmp_path / "ckpt"), timeout=110))
    for rank, got in enumerate(per_rank):
        for what in ("ddp", "ddp/comm_hook", "fully_shard", "tensor_parallel", "dcp", "trained"):
            _same(got["gloo"][what], got["ringlet"][what], f"rank {rank} {what}")
        _same(got["ringlet"]["dcp"], got["ringlet"]["trained"], f"rank {rank} dcp round trip")


def test_mismatch_is_reported_by_ringlet_on_every_rank(tmp_path) -> None:
    res = raise_first(run_world(2, W.mismatch, str(tmp_path / "init"), timeout=60,
                                env={"RINGLET_DEBUG": "DETAIL"}))
    for kind, text in res:
        assert kind == "CollectiveMismatchError", text
        assert "all_reduce" in text and "broadcast" in text, text


def test_a_missing_rank_is_a_timeout_with_a_hang_report(tmp_path) -> None:
    kind, text, took = raise_first(run_world(2, W.skipped, str(tmp_path / "init"), timeout=60))[0]
    assert kind == "CollectiveTimeoutError", text
    assert "all_reduce" in text and "rank 1" in text, text
    assert took < 20


def test_torch_ddp_names_a_dead_peer(tmp_path) -> None:
    res = run_world(2, W.ddp_peer_dies, str(tmp_path / "init"), timeout=60)
    kind, text = raise_first([res[0]])[0]
    assert kind != "none", "rank 0 trained on after its peer died"
    assert "rank 1" in text or "peer" in text.lower(), text


def _one_rank(where, **kwargs: object) -> None:
    from datetime import timedelta

    import torch.distributed as tdist

    where.mkdir(parents=True, exist_ok=True)
    tdist.init_process_group("ringlet", init_method=f"file://{where}/init", rank=0,
                             world_size=1, timeout=timedelta(seconds=20), **kwargs)


def test_options_torch_cannot_carry_are_refused_by_name(tmp_path, monkeypatch) -> None:
    import torch.distributed as tdist

    with pytest.raises(ValueError, match="pg_options: torch's options objects cannot carry"):
        _one_rank(tmp_path / "a", pg_options=tdist.ProcessGroupGloo._Options())
    assert not tdist.is_initialized()
    monkeypatch.setenv("RINGLET_TORCH_TRANSPORT", "inproc")
    with pytest.raises(ValueError, match="RINGLET_TORCH_TRANSPORT='inproc': expected one of"):
        _one_rank(tmp_path / "b")
    assert not tdist.is_initialized()


def test_one_rank_group_runs_inline_and_repr_names_ringlet(tmp_path) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as tdist

    _one_rank(tmp_path / "c")
    try:
        pg = tdist.group.WORLD
        assert type(pg).__name__ == "RingletProcessGroup" and tdist.get_backend() == "ringlet"
        assert "ringlet" in repr(pg) and pg.ringlet_group.size() == 1
        t = torch.ones(3)
        w = tdist.all_reduce(t, op=tdist.ReduceOp.AVG, async_op=True)
        assert w.is_completed() and w.wait() and w.get_future().value() == [t]
        assert pg.ringlet_group.counts()["all_reduce"] == 1
        pg.monitored_barrier(timedelta(seconds=5), wait_all_ranks=True)   # docs/torch_backend.md
    finally:
        tdist.destroy_process_group()


def test_torch_2d_layouts_equal_gloo_on_four_ranks(tmp_path) -> None:
    per_rank = raise_first(run_world(4, W.two_d, str(tmp_path / "init"), timeout=110))
    for rank, got in enumerate(per_rank):
        _same(got["gloo"], got["ringlet"], f"rank {rank}")


def test_a_stalled_rank_inside_torch_fully_shard_is_named(tmp_path) -> None:
    res = run_world(2, W.fsdp_rank_stalls, str(tmp_path / "init"), timeout=60)
    kind, text, took = raise_first([res[0]])[0]
    assert kind == "CollectiveTimeoutError", text
    assert "rank 1" in text, text
    # the hang report: every rank answered, and rank 1's line names where it is
    assert "no answer" not in text and "in fsdp_rank_stalls()" in text, text
    assert took < 30
