"""Where a run starts, and what it says when it stops early: a resume that cannot lie.

Before anything is built or written, rank 0 looks at ``--out`` and decides (every rank then
follows the same decision):

=====================  ================================  ==========================================
``--out`` holds        without ``--resume``              with ``--resume``
=====================  ================================  ==========================================
no checkpoint          start from step 0                 start from step 0, and say so
a checkpoint after     refuse: it belongs to an earlier  continue after step N
step N < ``--steps``   run (add ``--resume``, or choose
                       another ``--out``)
a checkpoint after     refuse, as above                  refuse: nothing left to train (say which
step N >= ``--steps``                                    step it holds and the ``--steps`` to give)
=====================  ================================  ==========================================

A refusal raises :class:`RunRefused` on every rank before ``metrics.json``, the plot or a
checkpoint is touched.  A run that stops early (ctrl-c, SIGTERM from the launcher, a peer
that died) prints on rank 0 the newest complete checkpoint and the command that resumes it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import ringlet.distributed as dist

from . import checkpoint


class RunRefused(Exception):
    """The run would lie or overwrite an earlier run's checkpoints: the message says why and
    what to run instead."""


class Stopped(BaseException):
    """A signal asked the run to stop (the launcher turns ctrl-c into SIGTERM to its workers).

    A ``BaseException``, like ``KeyboardInterrupt``, so that no ``except Exception`` swallows
    it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_on_sigterm() -> None:
    """Turn SIGTERM into :class:`Stopped` in the main thread (call it from the main thread)."""
    def handler(signum: int, frame: Any) -> None:
        raise Stopped(signum)
    signal.signal(signal.SIGTERM, handler)


def checkpoint_step(path: str) -> int:
    """The step a complete checkpoint directory was written after."""
    with open(os.path.join(path, "trainer.json")) as f:
        return int(json.load(f)["step"])


def decide(cfg: Any) -> tuple[str | None, str | None]:
    """Rank 0's decision from ``--out`` alone: ``(checkpoint to load or None, note to print)``;
    raises :class:`RunRefused`.  See the table in this module's docstring."""
    path = checkpoint.latest(cfg.out)
    if path is None:
        if cfg.resume:
            return None, (f"--resume: no checkpoint in {os.path.join(cfg.out, 'checkpoints')}: "
                          "starting from step 0")
        return None, None
    step = checkpoint_step(path)
    more = f" with --steps above {step}" if step >= cfg.steps else ""
    if not cfg.resume:
        raise RunRefused(
            f"--out {cfg.out} already holds a checkpoint of an earlier run ({path}, after step "
            f"{step}); not overwriting it. Add --resume to continue that run{more}, give another "
            f"--out, or remove {os.path.join(cfg.out, 'checkpoints')} to start over")
    if step >= cfg.steps:
        raise RunRefused(
            f"--resume: the newest checkpoint in {cfg.out} ({path}) is after step {step}, and "
            f"--steps {cfg.steps} is the total number of steps: nothing left to train. Give "
            f"--steps above {step} (to train {cfg.steps} more: --steps {step + cfg.steps})")
    return path, None


def start_point(cfg: Any) -> str | None:
    """The checkpoint every rank loads (None: start from step 0), decided on rank 0 so that
    all ranks agree; raises :class:`RunRefused` on every rank.  Prints the note on rank 0."""
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = ("start", *decide(cfg))
        except RunRefused as refused:
            box[0] = ("refuse", str(refused), None)
    dist.broadcast_object_list(box, src=0)
    kind, value, note = box[0]
    if kind == "refuse":
        raise RunRefused(value)
    if note is not None and dist.get_rank() == 0:
        print(f"train_gpt: {note}", flush=True)
    return value


def resume_command(argv: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """The command line that continues this run: the same launcher, script and flags, plus
    ``--resume``.  ``argv`` is the script's ``sys.argv``."""
    env = os.environ if env is None else env
    local = env.get("LOCAL_WORLD_SIZE", "1")
    if "RANK" not in env:
        launcher = ["python"]
    elif env.get("WORLD_SIZE", local) != local:
        launcher = ["ringlet-run", "--nnodes", env.get("GROUP_WORLD_SIZE", "?"),
                    "--nproc-per-node", local, "<this node's other launcher flags>"]
    else:
        launcher = ["ringlet-run" if "RINGLET_RUN_DIR" in env else "torchrun",
                    "--nproc-per-node", local]
    args = list(argv)
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(launcher + args)


def stopped_lines(cfg: Any, why: BaseException, argv: Sequence[str] | None) -> list[str]:
    """What rank 0 prints when the run stops early: why, the last checkpoint, how to resume."""
    if isinstance(why, Stopped):
        reason = f"stopped by {why}"
    elif isinstance(why, KeyboardInterrupt):
        reason = "interrupted (ctrl-c)"
    else:
        first = str(why).splitlines()[0] if str(why) else ""
        reason = f"stopped by an error: {type(why).__name__}: {first}"
    lines = [f"train_gpt: {reason}"]
    path = checkpoint.latest(cfg.out)
    if path is None:
        lines.append(f"train_gpt: no checkpoint was written yet in {cfg.out}: run the same "
                     "command again to start over")
        return lines
    lines.append(f"train_gpt: last checkpoint: {path} (after step {checkpoint_step(path)} of "
                 f"{cfg.steps})")
    if argv is not None:
        lines.append(f"train_gpt: to resume: {resume_command(argv)}")
    else:
        lines.append("train_gpt: to resume: the same configuration with resume=True")
    return lines


@contextlib.contextmanager
def report_stop(cfg: Any, argv: Sequence[str] | None) -> Iterator[None]:
    """Around the training loop: on any exit by an exception, rank 0 prints
    :func:`stopped_lines` to stderr, then the exception goes on."""
    try:
        yield
    except BaseException as why:
        with contextlib.suppress(Exception):         # never hide the original exception
            if dist.get_rank() == 0:
                print("\n".join(stopped_lines(cfg, why, argv)), file=sys.stderr, flush=True)
        raise
