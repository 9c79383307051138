"""Replica-level fault tolerance (ringlet.ft, ringlet-run --restart-policy replica), across real
processes: a replica killed mid-step drops out, the others finish the step and go on, the launcher
restarts only that replica, and it heals from a live one.  Every step, every live replica holds
bitwise-identical parameters (docs/fault_tolerance.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ringlet.ft._quorum import Member, _heal_plan
from ringlet.ft._state import describe_difference
from ringlet.launcher._plan import LaunchConfig

JOB = Path(__file__).with_name("_ft_job.py")


def _run(tmp_path: Path, nproc: int, *args: str, replica_size: int = 1, restarts: int = 3,
         env: dict[str, str] | None = None, timeout: float = 240) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", str(nproc),
           "--restart-policy", "replica", "--replica-size", str(replica_size),
           "--max-restarts", str(restarts), str(JOB), str(tmp_path), *args]
    proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    return proc.returncode, out


def _steps(tmp_path: Path) -> dict[tuple[int, int], dict[int, dict]]:
    """(step, position) -> replica -> that replica's line (the last one written for the step)."""
    out: dict[tuple[int, int], dict[int, dict]] = {}
    for f in tmp_path.glob("replica*.jsonl"):
        rid, pos = (int(x) for x in f.name[len("replica"):-len(".jsonl")].split("."))
        for line in f.read_text().splitlines():
            row = json.loads(line)
            out.setdefault((row["step"], pos), {})[rid] = row
    return out


def _check_identical(steps: dict[tuple[int, int], dict[int, dict]]) -> None:
    for key, rows in steps.items():
        hashes = {r["hash"] for r in rows.values()}
        assert len(hashes) == 1, f"step {key[0]} position {key[1]}: replicas differ: {rows}"
        members = {tuple(r["members"]) for r in rows.values()}
        assert len(members) == 1 and set(rows) == set(next(iter(members))), (key, rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("killed", ["0,2"], ids=["two-at-once"])
def test_ddp_replicas_survive_a_kill_and_the_killed_rejoin(tmp_path: Path, killed: str) -> None:
    code, out = _run(tmp_path, 3, "8", killed, "3")
    assert code == 0, out
    steps = _steps(tmp_path)
    _check_identical(steps)
    dead = {int(r) for r in killed.split(",")}
    live = sorted({0, 1, 2} - dead)
    after = [s for (s, _), rows in steps.items() if s > 3 and sorted(rows) == live]
    assert after, f"no step ran on the survivors {live} alone: {out}"
    last = max(s for s, _ in steps)
    assert sorted(steps[(last, 0)]) == [0, 1, 2], "the killed replicas did not rejoin"
    for r in dead:
        assert f"restarting replica {r} only" in out
        assert f"replica {r}: healed from replica" in out
    assert "retrying over the live ones" in out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("inside", ["fully_shard", "tp"])
def test_replica_of_two_processes_survives_and_rejoins(tmp_path: Path, inside: str) -> None:
    # Each replica is a fully_shard group (HSDP) or a tensor-parallel group of 2 processes.
    code, out = _run(tmp_path, 4, "6", "1", "2", replica_size=2,
                     env={"FT_TEST_TP": "1"} if inside == "tp" else {})
    assert code == 0, out
    steps = _steps(tmp_path)
    _check_identical(steps)
    assert any(sorted(rows) == [0] for (s, _), rows in steps.items() if s > 2), out
    last = max(s for s, _ in steps)
    assert sorted(steps[(last, 0)]) == [0, 1] and sorted(steps[(last, 1)]) == [0, 1]
    assert "restarting replica 1 only" in out


@pytest.mark.timeout(300)
def test_the_source_of_a_heal_dies_while_healing(tmp_path: Path) -> None:
    # Replica 1 dies at step 2; replica 0, sending it the state, dies in the middle of the heal.
    code, out = _run(tmp_path, 3, "8", "1", "2", env={"RINGLET_FT_FAULT": "heal-source:0"})
    assert code == 0, out
    _check_identical(_steps(tmp_path))
    assert "restarting replica 0 only" in out and "restarting replica 1 only" in out
    assert "setting up replicas" in out and "trying again" in out


@pytest.mark.timeout(300)
def test_a_replica_rejoining_with_another_model_is_refused_by_name(tmp_path: Path) -> None:
    code, out = _run(tmp_path, 2, "6", "1", "2", restarts=1,
                     env={"FT_TEST_WRONG_ON_RESTART": "1"})
    assert code != 0
    assert "refused by the live replicas" in out, out
    assert "'0.bias' is torch.float32 of local shape (17,) here, torch.float32 of (16,)" in out


def _member(rid: int, step: int, fresh: bool) -> Member:
    return Member(rid, 0, f"u{rid}", step, fresh, "f")


def test_heal_plan_copies_from_replicas_at_the_newest_step() -> None:
    members = {f"{r}.0": m for r, m in enumerate(
        [_member(0, 5, False), _member(1, 0, True), _member(2, 5, False), _member(3, 4, False)])}
    assert _heal_plan(members, [0, 1, 2, 3], 5) == {1: 0, 3: 2}
    fresh = {f"{r}.0": _member(r, 0, True) for r in range(3)}
    assert _heal_plan(fresh, [0, 1, 2], 0) == {1: 0, 2: 0}    # the job's start: replica 0 leads


def test_layout_difference_is_named() -> None:
    a = {"replica_size": 1, "optimizer": "Adam", "tensors": {"w": [[4, 8], "torch.float32"]}}
    b = {"replica_size": 1, "optimizer": "Adam", "tensors": {"w": [[8, 8], "torch.float32"]}}
    assert describe_difference(a, b) == ("'w' is torch.float32 of local shape (4, 8) here, "
                                         "torch.float32 of (8, 8) on the live replicas")
    c = {**a, "optimizer": "SGD"}
    assert describe_difference(c, a) == "optimizer is 'SGD' here, 'Adam' on the live replicas"


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"nproc_per_node": 3, "replica_size": 2}, "--replica-size dividing"),
    ({"nnodes": 2, "restart_policy": "replica"}, "--nnodes 1 with --restart-policy replica"),
    ({"restart_policy": "worker"}, "--restart-policy job or replica"),
])
def test_launcher_refuses_bad_replica_options(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle.replace("-", r"\-")):
        LaunchConfig(entrypoint="train.py", master_addr="10.0.0.1", **kwargs)


@pytest.mark.timeout(300)
def test_a_frozen_replica_is_dropped_then_heals_without_a_restart(tmp_path: Path) -> None:
    # Replica 1 stops itself (SIGSTOP) for 4 s in step 3: alive, but silent past the 1 s
    # heartbeat. The others abort the step's group, finish it without replica 1 and go on;
    # when it wakes up it finds itself left out and heals at a later step; nobody restarts.
    code, out = _run(tmp_path, 3, "8", env={"FT_TEST_FREEZE": "1:3:4"})
    assert code == 0, out
    steps = _steps(tmp_path)
    _check_identical(steps)
    assert "stopped answering" in out and "left out of the retry" in out, out
    assert "replica 1: healed from replica" in out and "restarting" not in out, out
    assert any(sorted(rows) == [0, 2] for (s, _), rows in steps.items() if s > 3)
