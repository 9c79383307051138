"""``ringlet-run``: start N local worker processes with torchrun's interface.

Usage::

    ringlet-run --nproc-per-node 2 train.py --lr 0.1
    ringlet-run --nproc_per_node=cpu --max-restarts 3 -m mypkg.train
    python -m ringlet.distributed.run --standalone --nproc-per-node 4 train.py
    ringlet-run --nproc-per-node 2 --no-python ./worker.sh

The launcher hosts the rendezvous ``TCPStore`` itself (bound to ``--master-addr``,
127.0.0.1 by default, on ``--master-port`` or a port the store picks), protected by a
per-run random token kept in a 0600 file of a private run directory. Every worker gets
torchrun's environment::

    RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE GROUP_RANK GROUP_WORLD_SIZE
    ROLE_RANK ROLE_WORLD_SIZE ROLE_NAME MASTER_ADDR MASTER_PORT
    TORCHELASTIC_RUN_ID TORCHELASTIC_RESTART_COUNT TORCHELASTIC_MAX_RESTARTS
    TORCHELASTIC_ERROR_FILE

and ringlet's own::

    RINGLET_AGENT_STORE=1          the store is the launcher's: every rank is a client
    RINGLET_STORE_TOKEN_FILE=...   the file holding the store token
    RINGLET_RUN_DIR=...            private (0700) directory of this run, removed at exit
    RINGLET_GENERATION=<n>         restart generation (= TORCHELASTIC_RESTART_COUNT)
    RINGLET_LAUNCHER_PID=<pid>     lets a worker notice that the launcher is gone

plus ``OMP_NUM_THREADS=1`` when unset and more than one worker shares the node, and
``PYTHONUNBUFFERED=1``.

[Note: store generations] Every generation of workers talks to the *same* store, which
keeps the keys of earlier generations. ``init_process_group`` therefore prefixes all its
keys with the generation (``RINGLET_GENERATION``), so a restarted job never reads a
key that a dead generation wrote.

Each worker's output lines are forwarded with a ``[rank{r}]: `` prefix. When a worker
fails (non-zero exit or a signal), the others get SIGTERM, then SIGKILL after
``--grace-period`` seconds; with restarts left a new generation starts, otherwise the
launcher prints a summary of the first failure (rank, pid, exit code or signal, time,
traceback) and exits 1. SIGINT/SIGTERM to the launcher stop the workers the same way and
the launcher exits 128 + signal number.

Several nodes (``--nnodes N --node-rank R --master-addr A --master-port P``, or ``--from-env``
under srun/mpirun): see ``_multinode`` ([Note: node rendezvous] in ``_nodes``) and
[Note: run tokens] in ``_runtime``.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime

from ringlet import _env
from ringlet.errors import DistError
from ringlet.launcher._capacity import max_workers, read_limits
from ringlet.launcher._plan import (
    PROG,
    LaunchConfig,
    build_parser,
    error_file,
    parse_args,
    worker_command,
    worker_env,
)
from ringlet.launcher._reaper import become_subreaper
from ringlet.launcher._runtime import Signals, run_dir, say
from ringlet.launcher._supervisor import (
    Generation,
    GenerationResult,
    WorkerFailure,
    WorkerStartError,
)
from ringlet.store import TCPStore

__all__ = ["main", "run"]


def _format_time(stamp: float) -> str:
    return datetime.fromtimestamp(stamp).astimezone().isoformat(timespec="milliseconds")


def failure_summary(first: WorkerFailure, others: Sequence[WorkerFailure], attempts: int,
                    run_id: str) -> str:
    """The report printed when the last generation failed, ``first`` being its first failure."""
    lines = [
        f"{PROG}: job failed after {attempts} attempt(s) (run id {run_id})",
        (f"  first failure: rank {first.rank} (local rank {first.local_rank}), "
         f"pid {first.pid}, {first.reason}, at {_format_time(first.timestamp)}"),
    ]
    tb = str(first.error.get("traceback", "")) if first.error else ""
    if tb:
        lines.append("  traceback:")
        lines.extend("    " + line for line in tb.rstrip("\n").splitlines())
    else:
        lines.append("  traceback: none recorded (the worker wrote no error file)")
    for f in others:
        lines.append(f"  also failed: rank {f.rank}, pid {f.pid}, {f.reason}")
    return "\n".join(lines)


@dataclass(frozen=True, kw_only=True)
class Run:
    """What every generation of one launch shares."""

    config: LaunchConfig
    run_id: str
    run_dir: str
    token_file: str
    port: int  # the port the store bound
    signals: Signals


def run_generation(run: Run, restart: int,
                   elsewhere: Callable[[], bool] | None = None) -> GenerationResult:
    """Start this node's workers of generation ``restart``, watch them, always stop them."""
    config = run.config
    envs = [
        worker_env(config, lr, restart, run.port, run_id=run.run_id, run_dir=run.run_dir,
                   token_file=run.token_file, launcher_pid=os.getpid())
        for lr in range(config.nproc_per_node)
    ]
    ranks = [config.global_rank(lr) for lr in range(config.nproc_per_node)]
    generation = Generation(
        worker_command(config), envs, ranks,
        [error_file(run.run_dir, restart, r) for r in ranks],
        stdout=sys.stdout.buffer, stderr=sys.stderr.buffer,
    )
    try:
        generation.start()
        return generation.watch(config.monitor_interval, lambda: run.signals.received, elsewhere)
    except WorkerStartError as err:
        return GenerationResult("start_failed", message=str(err))
    finally:
        generation.stop(config.grace_period)


def _supervise(run: Run) -> int:
    config, signals = run.config, run.signals
    for restart in range(config.max_restarts + 1):
        result = run_generation(run, restart)
        if signals.received is not None:
            say(f"stopped workers on {signal.Signals(signals.received).name}")
            return 128 + signals.received
        if result.state == "succeeded":
            return 0
        if result.state == "start_failed":
            say(f"error: {result.message}")
            return 1
        first, *others = result.failures
        if restart < config.max_restarts:
            say(f"rank {first.rank} (pid {first.pid}) failed with {first.reason}; "
                 f"restarting workers ({restart + 1}/{config.max_restarts})")
            continue
        print(failure_summary(first, others, restart + 1, run.run_id), file=sys.stderr,
              flush=True)
    return 1


def check_capacity(config: LaunchConfig) -> str | None:
    """Why this machine cannot start ``config.nproc_per_node`` workers, or None when it can."""
    limit, why = max_workers(read_limits())
    if config.nproc_per_node <= limit:
        return None
    return f"expected --nproc-per-node <= {limit} on this machine ({why}), got {config.nproc_per_node}"


def run(config: LaunchConfig) -> int:
    """Launch ``config`` on this node and supervise it; returns the launcher's exit code."""
    refused = check_capacity(config)
    if refused is not None:
        say(f"error: {refused}")
        return 2
    # Orphaned descendants of workers come back to us, so that teardown can end them (_reaper).
    become_subreaper()
    if config.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        say("setting OMP_NUM_THREADS=1 for each worker to avoid overloading the CPUs; "
            "set it yourself to tune")
    if config.nnodes > 1:
        from ringlet.launcher._multinode import run_nodes

        return run_nodes(config)
    run_id = config.rdzv_id or secrets.token_hex(6)
    with Signals().installed() as signals, run_dir(None) as (rdir, token_file, token):
        try:
            store = TCPStore(config.master_addr, config.master_port, world_size=None,
                             is_master=True, timeout=_env.default_timeout(),
                             wait_for_workers=False, token=token)
        except (OSError, DistError) as err:
            say(f"could not host the store on {config.master_addr}:{config.master_port}: {err}")
            return 1
        try:
            return _supervise(Run(config=config, run_id=run_id, run_dir=rdir,
                                  token_file=token_file, port=store.port, signals=signals))
        finally:
            store.close()


def main(argv: Sequence[str] | None = None) -> None:
    """Console entry point of ``ringlet-run``; exits with the launcher's exit code."""
    args = sys.argv[1:] if argv is None else list(argv)
    try:
        config = parse_args(args)
    except ValueError as err:
        build_parser().print_usage(sys.stderr)
        say(f"error: {err}")
        sys.exit(2)
    sys.exit(run(config))


if __name__ == "__main__":
    main()
