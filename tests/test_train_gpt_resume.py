"""examples/train_gpt.py cannot lie about where it starts: every case of --out and --resume
either trains what it says or refuses with the reason before touching anything; a run that
stops early names its last checkpoint and the command that resumes it; --help gives each flag
one line and one default; a layout that shards nothing says so."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import re
import shlex
import signal
from pathlib import Path
from typing import Any

import pytest
from test_launcher import _launcher, _wait_for
from test_train_gpt import EXAMPLES, REPO, TINY, _gpt

from ringlet.testing.procs import raise_first, run_world


def _train_gpt() -> Any:
    _gpt()                                  # puts examples/ on sys.path
    return importlib.import_module("train_gpt")


def _help_entries() -> dict[str, str]:
    """``--flag`` -> the text after it in ``train_gpt.py --help`` (empty: no help)."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        _train_gpt().parse_args(["--help"])
    section = out.getvalue().split("options:\n", 1)[1]
    entries: dict[str, str] = {}
    for chunk in re.split(r"\n(?=  -)", section.strip("\n")):
        head, *rest = chunk.splitlines()
        parts = re.split(r"\s{2,}", head.strip(), maxsplit=1)
        flag = re.findall(r"(?:^|, )(-{1,2}[\w-]+)", parts[0])[-1]
        entries[flag] = " ".join([*parts[1:], *(line.strip() for line in rest)])
    return entries


def test_help_gives_every_flag_one_line_and_one_true_default() -> None:
    entries = _help_entries()
    for flag, text in entries.items():
        assert text, f"{flag} has no help"
        assert text.count("default") <= 1, f"{flag} says two defaults: {text}"
        assert not re.search(r"default: (None|True|False)\)", text), f"{flag}: {text}"
    parser = _train_gpt().build_parser()
    flags = {s for a in parser._actions for s in a.option_strings if s.startswith("--")}
    assert flags == set(entries), entries.keys()
    assert "(default: 2000)" in entries["--steps"]
    assert "(default: 2 on an even number of ranks" in entries["--tp"]
    # every flag is in getting_started's table of flags
    table = (Path(REPO) / "docs" / "getting_started.md").read_text()
    assert not [f for f in flags - {"--help"} if f"`{f}" not in table]


def _out_cases(rank: int, world: int, base: str) -> dict[str, Any]:
    """A finished 4-step run in ``a``, then every way of starting again on top of it."""
    import torch

    import ringlet.distributed as dist

    trainer = _gpt()
    from gpt.resume import RunRefused

    torch.set_num_threads(1)
    first = {**TINY, "steps": 4, "checkpoint_every": 2, "out": os.path.join(base, "a")}
    shown = io.StringIO()
    with contextlib.redirect_stdout(shown):
        trainer.train(trainer.TrainConfig(**{**first, "progress": "lines"}))
    files = [os.path.join(first["out"], n) for n in ("metrics.json", "train_gpt.png")]
    if rank == 0:
        Path(files[1]).write_bytes(b"the earlier run's plot")
    dist.barrier()                          # rank 0 has written metrics.json and the "plot"
    before = [Path(f).read_bytes() for f in files]
    refused = []
    for change in ({"resume": True, "steps": 2}, {"resume": True, "steps": 4}, {},
                   {"steps": 8}):
        try:
            trainer.train(trainer.TrainConfig(**{**first, **change}))
            refused.append(None)
        except RunRefused as err:
            refused.append(str(err))
    after = [Path(f).read_bytes() for f in files]
    fresh_out = io.StringIO()
    with contextlib.redirect_stdout(fresh_out):
        fresh = trainer.train(trainer.TrainConfig(**{
            **TINY, "steps": 2, "strategy": "hsdp", "progress": "lines", "resume": True,
            "out": os.path.join(base, "b")}))
    return {"shown": shown.getvalue(), "refused": refused, "unchanged": before == after,
            "fresh": fresh_out.getvalue(), "fresh_steps": len(fresh["train_loss"])}


@pytest.mark.timeout(120)
def test_out_and_resume_either_train_what_they_say_or_refuse(tmp_path) -> None:
    r0, r1 = raise_first(run_world(2, _out_cases, str(tmp_path), timeout=100))
    assert r0["refused"] == r1["refused"]            # every rank refuses, none hangs
    past_2, past_4, again, again_8 = r0["refused"]
    ckpt = str(tmp_path / "a" / "checkpoints" / "step_000004")
    for msg, steps, more in ((past_2, 2, 6), (past_4, 4, 8)):
        assert msg is not None and msg.startswith("--resume: the newest checkpoint"), msg
        assert (f"({ckpt}) is after step 4, and --steps {steps} is the total" in msg
                and f"Give --steps above 4 (to train {steps} more: --steps {more})" in msg), msg
    for msg in (again, again_8):
        assert msg is not None and msg.startswith(
            f"--out {tmp_path / 'a'} already holds a checkpoint of an earlier run ({ckpt}, "
            "after step 4); not overwriting it. Add --resume"), msg
        assert "give another --out" in msg
    assert "with --steps above 4" in again and "with --steps above" not in again_8
    assert r0["unchanged"] and r1["unchanged"]       # metrics.json and the plot untouched
    # --resume with no checkpoint: says so, then trains from step 0
    assert (f"train_gpt: --resume: no checkpoint in {tmp_path / 'b' / 'checkpoints'}: "
            "starting from step 0") in r0["fresh"]
    assert r0["fresh_steps"] == 2 and "step 0: validation loss" in r0["fresh"]
    assert r1["fresh"] == ""                          # only rank 0 talks
    # hsdp on 2 ranks is replicate=2 x shard=1: it says that it shards nothing; ddp says nothing
    assert "note: hsdp on 2 ranks shards nothing (replicate=2 x shard=1" in r0["fresh"]
    assert "train_gpt: ddp (dp=2)" in r0["shown"] and "shards nothing" not in r0["shown"]


def _dies_after_step_3(rank: int, world: int, out: str) -> str:
    """Rank 1 dies in step 5 (the checkpoint after step 3 is complete); rank 0 reports."""
    import torch

    trainer = _gpt()
    from gpt import data

    torch.set_num_threads(1)
    if rank == 1:
        batch, calls = data.TextData.batch, []

        def dying(self: Any, split: str, *args: Any) -> Any:
            calls.append(split)
            if calls.count("train") == 5:
                os._exit(3)
            return batch(self, split, *args)
        data.TextData.batch = dying
    said = io.StringIO()
    with contextlib.redirect_stderr(said), contextlib.suppress(Exception):
        trainer.train(trainer.TrainConfig(**{**TINY, "steps": 8, "out": out}),
                      argv=["examples/train_gpt.py", "--steps", "8"])
    return said.getvalue()


@pytest.mark.timeout(90)
def test_a_dead_rank_leaves_the_last_checkpoint_and_the_resume_command(tmp_path) -> None:
    (r0, r1) = run_world(2, _dies_after_step_3, str(tmp_path), timeout=80, op_timeout=20)
    assert r1.exitcode == 3 and r0.ok, r0.message
    lines = r0.value.splitlines()
    assert lines[0].startswith("train_gpt: stopped by an error: "), r0.value
    last = tmp_path / "checkpoints" / "step_000003"
    assert lines[1:] == [
        f"train_gpt: last checkpoint: {last} (after step 3 of 8)",
        "train_gpt: to resume: python examples/train_gpt.py --steps 8 --resume"], r0.value


@pytest.mark.timeout(120)
def test_ctrl_c_under_the_launcher_prints_the_exact_resume_command(tmp_path) -> None:
    """SIGINT to ringlet-run (what ctrl-c sends it): rank 0 names the last complete checkpoint
    and the command that continues the run, the same flags plus --resume."""
    trainer = _gpt()
    from gpt import checkpoint

    run = {**TINY, "steps": 10**7, "checkpoint_every": 20, "eval_every": 10**7, "log_every": 1000}
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in run.items() if k not in ("plot",)]
    script = os.path.join(EXAMPLES, "train_gpt.py")
    with _launcher(tmp_path, "--nproc-per-node", "2", script, *flags, "--no-plot",
                   "--out=run") as proc:
        _wait_for(lambda: checkpoint.latest(str(tmp_path / "run")) is not None, timeout=90)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    text = out + err
    assert proc.returncode == 128 + signal.SIGINT, text
    assert re.search(r"^\[rank0\]: train_gpt: stopped by SIGTERM$", text, re.MULTILINE), text
    last = re.search(r"^\[rank0\]: train_gpt: last checkpoint: (run/checkpoints/step_(\d+)) "
                     r"\(after step (\d+) of 10000000\)$", text, re.MULTILINE)
    assert last and last[2].lstrip("0") == last[3] and int(last[3]) % 20 == 0, text
    assert (tmp_path / last[1] / "trainer.json").exists()
    cmd = re.search(r"^\[rank0\]: train_gpt: to resume: (.*)$", text, re.MULTILINE)
    assert cmd, text
    argv = shlex.split(cmd[1])
    assert argv[:4] == ["ringlet-run", "--nproc-per-node", "2", script], argv
    assert argv[4:] == [*flags, "--no-plot", "--out=run", "--resume"]
    resumed = _train_gpt().parse_args(argv[4:])
    assert resumed == trainer.TrainConfig(**{**run, "plot": False, "out": "run", "resume": True})
    assert "[rank1]: train_gpt:" not in text


def test_resume_command_names_the_launcher() -> None:
    _gpt()
    from gpt.resume import resume_command

    argv = ["examples/train_gpt.py", "--out", "my dir"]
    assert resume_command(argv, {}) == "python examples/train_gpt.py --out 'my dir' --resume"
    torchrun = {"RANK": "0", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "4"}
    assert resume_command(argv + ["--resume"], torchrun) == (
        "torchrun --nproc-per-node 4 examples/train_gpt.py --out 'my dir' --resume")
    ours = {**torchrun, "RINGLET_RUN_DIR": "/tmp/x"}
    assert resume_command(argv, ours).startswith("ringlet-run --nproc-per-node 4 examples/")
