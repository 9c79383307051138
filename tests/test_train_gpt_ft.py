"""examples/train_gpt.py --fault-tolerant (issue 32): a replica killed mid-run drops out, the
others train on, it rejoins by healing; the summary, metrics.json and the plot say what happened;
without a failure the losses are those of the plain run on as many ranks."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from test_train_gpt import EXAMPLES, REPO, TINY, _gpt

SCRIPT = os.path.join(EXAMPLES, "train_gpt.py")
# TINY's model with a batch every split divides (3 replicas; 2 x 2 for hsdp).
FLAGS = {**TINY, "batch_size": 12, "eval_every": 20, "checkpoint_every": 1000,
         "breakdown_every": 1000, "log_every": 5, "progress": "lines"}


def _launch(out: Path, nproc: int, *extra: str, launcher: tuple[str, ...] = (),
            steps: int = 40, timeout: float = 200, plot: bool = False,
            **flags: Any) -> tuple[int, str]:
    """Run train_gpt.py under ringlet-run; (exit status, everything it printed)."""
    args = [f"--{k.replace('_', '-')}={v}" for k, v in {**FLAGS, **flags, "steps": steps}.items()
            if k != "plot"]
    cmd = [sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", str(nproc),
           *launcher, SCRIPT, *args, *extra, f"--out={out}", *([] if plot else ["--no-plot"])]
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ, PYTHONPATH=REPO), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:          # reap the launcher and its workers
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    return proc.returncode, text


REPLICAS = ("--restart-policy", "replica", "--max-restarts", "2")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1337, 2], ids=["kills-replica-2", "kills-rank-0"])
def test_kill_random_replica_drops_out_and_rejoins(tmp_path: Path, seed: int) -> None:
    _gpt()
    from gpt.fault_tolerant import kill_plan

    victim, at = kill_plan(seed, 40, 3)
    assert victim == (2 if seed == 1337 else 0)       # rank 0's own replica dies in one case
    code, text = _launch(tmp_path, 3, "--fault-tolerant", "--kill-random", plot=True,
                         launcher=REPLICAS, seed=seed, rejoin_wait=200, timeout=280)
    assert code == 0, text
    for expected in (f"replica {victim} (rank {victim}) SIGKILLs itself in step {at + 1}",
                     f"restarting replica {victim} only",
                     "rejoined after this step (healed from a live replica)",
                     f"  replica {victim} failed in step {at + 1}: that step took",
                     "the survivors stalled", f"  replica {victim} rejoined after step",
                     "fault tolerance: 1 failure(s), 1 rejoin(s), "):
        assert expected in text, f"missing {expected!r} in:\n{text}"
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    h, ftd = metrics["history"], metrics["history"]["ft"]
    losses = h["train_loss"]
    assert len(losses) == 40 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 1.0 and h["val"][-1][1] < h["val"][0][1] - 1.0
    (fail,) = ftd["failures"]
    (back,) = ftd["rejoins"]
    assert fail["replica"] == back["replica"] == victim and fail["step"] == at + 1
    assert fail["step_s"] > 0 and back["step"] >= fail["step"] and back["after_s"] > 0
    # every committed step without the victim (steps at+1 .. the rejoin) left its share out
    assert ftd["lost_shares"] == back["step"] - at and ftd["members"] == [0, 1, 2]
    assert f"lost: {ftd['lost_shares']} x 4 sequences" in text
    last = json.loads((tmp_path / "checkpoints" / "step_000040" / "trainer.json").read_text())
    assert last["run_id"] and last["history"]["ft"]["failures"] == ftd["failures"]
    if "plot_series" in metrics:      # matplotlib installed: the plot marks both
        assert metrics["plot_series"][2:4] == [f"replica {victim} lost (step {at + 1})",
                                               (f"replica {victim} rejoined (step "
                                                f"{back['step']})")]


@pytest.mark.timeout(200)
def test_a_replica_back_after_the_end_finds_the_job_done(tmp_path: Path) -> None:
    # --rejoin-wait 0: the survivors do not wait; whether the restarted replica still arrives
    # in time depends on the machine's load, and both endings must be clean.
    code, text = _launch(tmp_path, 3, "--fault-tolerant", "--kill-random", launcher=REPLICAS,
                         rejoin_wait=0, timeout=180)
    assert code == 0, text
    assert "fault tolerance: 1 failure(s), " in text, text
    if "0 rejoin(s)" in text:
        assert "  replica(s) [2] had not rejoined by the end (--rejoin-wait 0 s)" in text, text
        assert "before this one could rejoin; nothing left to do" in text, text
    else:
        assert "1 rejoin(s)" in text and "replica 2 rejoined after step" in text, text


def _losses(out: Path) -> tuple[list[float], list[list[float]]]:
    h = json.loads((out / "metrics.json").read_text())["history"]
    return h["train_loss"], h["val"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("strategy", "nproc", "size"), [("ddp", 3, 1), ("hsdp", 4, 2)])
def test_without_failure_the_losses_are_the_plain_runs(tmp_path: Path, strategy: str,
                                                       nproc: int, size: int) -> None:
    code, text = _launch(tmp_path / "ft", nproc, "--fault-tolerant",
                         launcher=(*REPLICAS, "--replica-size", str(size)), steps=8,
                         strategy=strategy, eval_every=4)
    assert code == 0, text
    assert "fault tolerance: 0 failure(s), 0 rejoin(s), 0 replica share(s)" in text, text
    code, plain_text = _launch(tmp_path / "plain", nproc, steps=8, strategy=strategy,
                               eval_every=4)
    assert code == 0, plain_text
    got, want = _losses(tmp_path / "ft"), _losses(tmp_path / "plain")
    assert len(got[0]) == 8
    assert got[0] == pytest.approx(want[0], rel=1e-5, abs=1e-6)
    assert [s for s, _ in got[1]] == [s for s, _ in want[1]] == [0, 4, 8]
    assert [v for _, v in got[1]] == pytest.approx([v for _, v in want[1]], rel=1e-5, abs=1e-6)


@pytest.mark.timeout(60)
def test_fault_tolerant_without_the_replica_policy_is_refused(tmp_path: Path) -> None:
    code, text = _launch(tmp_path, 2, "--fault-tolerant", steps=2, timeout=50)
    assert code != 0
    assert ("train_gpt: error: --fault-tolerant: expected a launch by ringlet-run "
            "--restart-policy replica") in text, text
    assert "got restart policy job (the default)" in text, text


ENV = {"RINGLET_RESTART_POLICY": "replica", "RINGLET_REPLICA_SIZE": "1", "WORLD_SIZE": "2"}


@pytest.mark.parametrize(("flags", "env", "needle"), [
    ({"strategy": "fsdp"}, {}, "--fault-tolerant: expected --strategy ddp or hsdp"),
    ({"resume": True}, {}, "--resume is not supported"),
    ({}, {"RINGLET_REPLICA_SIZE": "2"}, "expected --replica-size 1, got 2"),
    ({"strategy": "hsdp", "replicate": 2}, {"RINGLET_REPLICA_SIZE": "2"},
     "--replicate: expected 1 (world 2 / --replica-size 2)"),
    ({"strategy": "hsdp", "kill_random": True}, {"RINGLET_REPLICA_SIZE": "2"},
     "--kill-random: expected 2 or more replicas"),
    ({"tp": 2}, {}, "--tp: expected none"),
])
def test_unsupported_combinations_are_refused(flags: dict, env: dict, needle: str) -> None:
    trainer = _gpt()
    from gpt.fault_tolerant import check
    from gpt.resume import RunRefused

    with pytest.raises(RunRefused, match=needle.replace("(", r"\(").replace(")", r"\)")):
        check(trainer.TrainConfig(fault_tolerant=True, **flags), {**ENV, **env})
    with pytest.raises(RunRefused, match="--kill-random: expected --fault-tolerant too"):
        check(trainer.TrainConfig(kill_random=True), ENV)


def test_an_earlier_runs_checkpoint_is_refused_by_every_incarnation(tmp_path: Path) -> None:
    trainer = _gpt()
    from gpt.fault_tolerant import check_out
    from gpt.resume import RunRefused

    cfg = trainer.TrainConfig(fault_tolerant=True, out=str(tmp_path))
    check_out(cfg, 0, "job-a")                       # nothing in --out yet
    ckpt = tmp_path / "checkpoints" / "step_000010"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer.json").write_text(json.dumps({"step": 10, "run_id": "job-a"}))
    check_out(cfg, 1, "job-a")        # a restarted replica: its own job wrote it
    for incarnation, run_id in ((0, "job-a"), (1, "job-b")):   # a replica restarted after a
        with pytest.raises(RunRefused, match="already holds a checkpoint of an earlier run"):
            check_out(cfg, incarnation, run_id)                # refusal must refuse again


def test_kill_plan_is_one_replica_in_the_second_quarter() -> None:
    _gpt()
    from gpt.fault_tolerant import kill_plan

    plans = {seed: kill_plan(seed, 40, 3) for seed in range(50)}
    assert all(kill_plan(s, 40, 3) == p for s, p in plans.items())     # the same on every replica
    assert {v for v, _ in plans.values()} == {0, 1, 2}
    assert all(10 <= step <= 20 for _, step in plans.values())
    assert kill_plan(5, 2, 2)[1] == 1                                  # never step 0
