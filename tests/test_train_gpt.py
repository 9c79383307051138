"""examples/train_gpt.py, the README's main job: every strategy trains the same model to the same
losses, --resume continues exactly, and the run leaves its progress, breakdown and plot behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from typing import Any

import pytest

from ringlet.testing.procs import raise_first, run_world

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(REPO, "examples")

# A model small enough that a step takes milliseconds; n_head 4 splits over tp 2 and 4.
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 4, "block_size": 16, "batch_size": 8, "steps": 6,
        "data_bytes": 1 << 16, "eval_every": 3, "eval_batches": 2, "sample_tokens": 8,
        "log_every": 2,
        "breakdown_every": 3, "checkpoint_every": 3, "warmup": 2, "lr": 1e-2, "progress": "off",
        "plot": False}
STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "ddp+tp")


def _gpt() -> Any:
    if EXAMPLES not in sys.path:
        sys.path.insert(0, EXAMPLES)
    from gpt import trainer
    return trainer


def _train_each(rank: int, world: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rank body: one training run per entry of ``runs`` (TrainConfig fields), in this world."""
    import torch

    trainer = _gpt()
    torch.set_num_threads(1)
    return [trainer.train(trainer.TrainConfig(**{**TINY, **run})) for run in runs]


def _reference(tmp_path) -> dict[str, Any]:
    """The same training on one process: what every strategy must reproduce."""
    (ref,) = raise_first(run_world(1, _train_each,
                                   [{"strategy": "ddp", "out": str(tmp_path / "one")}],
                                   timeout=60))[0]
    assert (len(ref["train_loss"]) == TINY["steps"]
            and ref["train_loss"][-1] < ref["train_loss"][0] - 0.3)
    return ref


def _check_same(runs: list[dict[str, Any]], results: list[list[dict[str, Any]]],
                ref: dict[str, Any]) -> None:
    for i, run in enumerate(runs):
        got = results[0][i]
        assert all(r[i]["train_loss"] == got["train_loss"] for r in results)    # every rank agrees
        tol = 5e-2 if run.get("bf16") else 1e-4
        assert got["train_loss"] == pytest.approx(ref["train_loss"], rel=tol, abs=tol), run
        assert ([v for _, v in got["val"]]
                == pytest.approx([v for _, v in ref["val"]], rel=tol, abs=tol)), run


@pytest.mark.timeout(120)
def test_every_strategy_gives_the_same_losses(tmp_path) -> None:
    runs = [{"strategy": s, "out": str(tmp_path / s.replace("+", "_")),
             "grad_accum": 2 if s in ("ddp", "fsdp", "ddp+tp", "fsdp+tp") else 1}
            for s in STRATEGIES]
    runs += [{"strategy": s, "bf16": True, "out": str(tmp_path / f"bf16_{s}")}
             for s in ("fsdp", "tp")]
    clipped = [{"strategy": s, "grad_clip": 0.3, "out": str(tmp_path / f"clip_{s}")}
               for s in ("ddp", "fsdp")]
    results = raise_first(run_world(2, _train_each, runs + clipped, timeout=100))
    ddp_clip, fsdp_clip = results[0][len(runs):]
    assert fsdp_clip["train_loss"] == pytest.approx(ddp_clip["train_loss"], rel=1e-4, abs=1e-4)
    # it clipped
    assert ddp_clip["train_loss"][-1] != pytest.approx(results[0][0]["train_loss"][-1], abs=1e-3)
    _check_same(runs, results, _reference(tmp_path))


@pytest.mark.timeout(120)
def test_two_dimensional_layouts_on_four_ranks(tmp_path) -> None:
    """The 2-d meshes for real: hsdp 2x2, fsdp+tp and ddp+tp as dp=2 x tp=2."""
    runs = [{"strategy": s, "out": str(tmp_path / s.replace("+", "_"))}
            for s in ("hsdp", "fsdp+tp", "ddp+tp")]
    results = raise_first(run_world(4, _train_each, runs, timeout=100))
    assert [r["layout"] for r in results[0]] == ["replicate=2 x shard=2", "dp=2 x tp=2",
                                                 "dp=2 x tp=2"]
    _check_same(runs, results, _reference(tmp_path))


def _resume(rank: int, world: int, base: str, strategy: str, then: str) -> list[list[float]]:
    import torch

    import ringlet.distributed as dist

    trainer = _gpt()
    torch.set_num_threads(1)
    cfg = {**TINY, "steps": 8, "checkpoint_every": 4}
    full = trainer.train(trainer.TrainConfig(**cfg, strategy=strategy,
                                             out=os.path.join(base, "full")))
    if rank == 0:     # an interrupted run: only the checkpoint after step 4 survived
        for cut in ("cut", "cut2"):
            shutil.copytree(os.path.join(base, "full", "checkpoints", "step_000004"),
                            os.path.join(base, cut, "checkpoints", "step_000004"))
    dist.barrier()
    same = trainer.train(trainer.TrainConfig(**cfg, strategy=strategy,
                                             out=os.path.join(base, "cut"), resume=True))
    other = trainer.train(trainer.TrainConfig(**cfg, strategy=then, out=os.path.join(base, "cut2"),
                                              resume=True))
    return [full["train_loss"], same["train_loss"], other["train_loss"]]


@pytest.mark.timeout(90)
def test_resume_continues_with_the_same_losses(tmp_path) -> None:
    """fsdp checkpoint after step 4 of 8: resumed under fsdp, then under tp (resharded on load)."""
    then = "tp"
    for full, same, other in raise_first(run_world(2, _resume, str(tmp_path), "fsdp", then,
                                                   timeout=80)):
        assert len(full) == len(same) == len(other) == 8
        # the history came back with the checkpoint
        assert same[:4] == other[:4] == full[:4]
        assert same[4:] == pytest.approx(full[4:], rel=1e-6, abs=1e-6)
        assert other[4:] == pytest.approx(full[4:], rel=1e-4, abs=1e-4)


@pytest.mark.timeout(120)
def test_command_line_run_shows_progress_breakdown_and_plot(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "run"
    args = [f"--{k.replace('_', '-')}={v}" for k, v in TINY.items()
            if k not in ("progress", "plot")]
    cmd = [sys.executable, "-m", "ringlet.launcher.run", "--nproc-per-node", "2",
           os.path.join(EXAMPLES, "train_gpt.py"), *args, "--progress=lines", f"--out={out}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=100, cwd=REPO,
                          env=dict(os.environ, PYTHONPATH=REPO))
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0, text
    for expected in ("[rank0]: train_gpt: ddp (dp=2) on 2 ranks", "[rank0]: step     2/6  loss ",
                     "tok/s  ETA", "step 0: validation loss", "per-rank time, steps 1-3:",
                     "  rank   step ms   compute   comm wait    data", "straggler",
                     "== summary: ddp",
                     "sample (held-out prompt", "checkpoints/step_000006", "plot: "):
        assert expected in text, f"missing {expected!r} in:\n{text}"
    assert "[rank1]:" not in text          # only rank 0 talks
    png = (out / "train_gpt.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["plot_series"] == ["training loss", "validation loss", "compute",
                                      "comm wait", "data"]
    assert len(metrics["history"]["train_loss"]) == 6 and len(metrics["ranks"]) == 2
    assert all(r["steps"] == 6 and r["step_s"] > 0 for r in metrics["ranks"])


def _slow_data(rank: int, world: int, out: str) -> None:
    import time

    trainer = _gpt()
    from gpt import data

    if rank == 1:      # rank 1 reads its data slowly: the others wait for it in every all-reduce
        fast = data.TextData.batch

        def slow(self: Any, *args: Any) -> Any:
            time.sleep(0.03)
            return fast(self, *args)
        data.TextData.batch = slow
    trainer.train(trainer.TrainConfig(**{**TINY, "out": out, "steps": 8}))


@pytest.mark.timeout(60)
def test_breakdown_names_the_slow_rank(tmp_path) -> None:
    raise_first(run_world(2, _slow_data, str(tmp_path), timeout=50))
    _gpt()
    from gpt.observe import Window, stragglers

    ranks = [Window(**{**r, "late_s": {int(k): v for k, v in r["late_s"].items()}})
             for r in json.loads((tmp_path / "metrics.json").read_text())["ranks"]]
    assert ranks[1].data_s > 8 * 0.025 and ranks[0].data_s < 8 * 0.01
    assert ranks[0].wait_s > 8 * 0.02                  # rank 0 waited in the gradient all-reduce
    (line,) = stragglers(ranks)
    assert line.startswith("  straggler: rank 1 "), line
