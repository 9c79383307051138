"""This node's share of a launch: its generations of workers, restarts and the failure report.

``ringlet-run`` (``run``) only parses the command line and dispatches: a one-node job runs
``run_single`` here, a multi-node one ``_multinode.run_nodes``, and both start each generation
with ``run_generation`` (one ``_supervisor.Generation`` of ``worker_specs``) and end a failed job
with ``failure_summary``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import sys
import tempfile
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import BinaryIO

from ringlet import _env
from ringlet.errors import DistError
from ringlet.launcher._capacity import max_workers, read_limits
from ringlet.launcher._forward import Sink, colour_wanted, prefix
from ringlet.launcher._logs import log_paths, stream_plan, wants_files
from ringlet.launcher._plan import PROG, LaunchConfig, error_file, worker_command, worker_env
from ringlet.launcher._preflight import check_entrypoint
from ringlet.launcher._reaper import become_subreaper
from ringlet.launcher._runtime import Signals, run_dir, say
from ringlet.launcher._supervisor import (
    Generation,
    GenerationResult,
    WorkerFailure,
    WorkerSpec,
    WorkerStartError,
    describe_exit,
)
from ringlet.store import TCPStore

__all__ = ["Run", "check_capacity", "failure_summary", "make_log_root", "prepare", "run_generation",
           "run_single", "worker_specs"]


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
        if "torch/distributed/" in tb and "EADDRINUSE" in tb:
            lines.append(f"  hint: {TORCH_UNDER_RINGLET_RUN}")
    else:
        lines.append(f"  traceback: none recorded ({_why_no_traceback(first)})")
    if first.log_files:
        lines.append(f"  log: {' '.join(first.log_files)}")
    for f in others:
        log = f" (log: {f.log_files[-1]})" if f.log_files else ""
        lines.append(f"  also failed: rank {f.rank}, pid {f.pid}, {f.reason}{log}")
    return "\n".join(lines)


TORCH_UNDER_RINGLET_RUN = (
    "the script uses torch.distributed: its rank 0 tried to serve torch's own TCPStore on "
    "MASTER_PORT, where this launcher's (ringlet's) store already listens. Run it with "
    "`ringlet-run --torch-backend` (torch's init_process_group() then joins this store, on "
    "backend 'ringlet'), or with torchrun, or port it to ringlet.distributed (docs/migration.md)")
_FAULTS = ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGABRT")


def _why_no_traceback(failure: WorkerFailure) -> str:
    """Why a failed worker left no traceback, and what would show more (by how it died)."""
    if failure.hung_s is not None:
        return ("killed for --heartbeat-timeout; the stacks it printed when asked, just before, "
                "are in its stderr")
    if failure.returncode >= 0:
        return ("the worker wrote no error file; decorate its main with "
                "ringlet.distributed.elastic.multiprocessing.errors.record")
    sig = describe_exit(failure.returncode).removeprefix("signal ")
    if sig == "SIGKILL":
        return ("SIGKILL cannot be caught, so nothing in the worker (@record included) could "
                "write one; it most often comes from the kernel's out-of-memory killer (look for "
                "'Out of memory: Killed process' with `dmesg` or `journalctl -k`), a memory or "
                "time limit of the job's scheduler or cgroup, or a `kill -9`")
    if sig in _FAULTS:
        return (f"a process killed by {sig} runs no Python code, so @record cannot help; "
                "faulthandler printed the Python stack of every thread to the worker's stderr "
                "above; for the native stack enable core dumps (`ulimit -c unlimited`) or run "
                "the rank under gdb; RINGLET_DEBUG=DETAIL checks every collective's arguments "
                "across ranks")
    return (f"{sig} was sent from outside the launcher (a scheduler, a user or another "
            "program) and the worker did not handle it; @record only sees Python exceptions")


@dataclass(frozen=True, kw_only=True)
class Run:
    """What every generation of one launch shares."""

    config: LaunchConfig
    run_id: str
    run_dir: str
    token_file: str
    port: int  # the port the store bound
    signals: Signals
    log_root: str | None = None  # per-rank log files go below it (see _logs)


def make_log_root(config: LaunchConfig, run_id: str) -> str | None:
    """The folder of this run's log files: ``<--log-dir>/<run id>`` (``-2``, ``-3``... when that
    exists), a fresh temporary folder when only -r/-t ask for files, or None."""
    if not wants_files(config.log_dir, config.redirects, config.tee):
        return None
    if not config.log_dir:
        root = tempfile.mkdtemp(prefix=f"ringlet-logs-{run_id}-")
    else:
        base = os.path.join(os.path.abspath(config.log_dir), run_id)
        root, n = base, 1
        while os.path.lexists(root):   # a dangling symlink is taken too: never follow it
            n += 1
            root = f"{base}-{n}"
        try:
            os.makedirs(root)
        except OSError as err:
            raise ValueError(f"--log-dir {config.log_dir!r}: expected a folder where this run's "
                             f"logs can be created, got {type(err).__name__}: {err}") from None
    say(f"worker logs: {root}/attempt_<n>/<local rank>/{{stdout,stderr}}.log")
    return root


def _sink(console: bool, stream: BinaryIO, rank: int, path: str | None) -> Sink:
    if path is not None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
    return Sink(console=stream if console else None, prefix=prefix(rank, colour_wanted(stream)),
                file=open(path, "wb") if path is not None else None,
                live=console and _is_tty(stream))


def _is_tty(stream: BinaryIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _terminal_env(out: Sink, err: Sink, rank: int) -> dict[str, str]:
    """Tell a worker that its output ends on a terminal ([Note: live lines] in ``_forward``)."""
    if not (out.live or err.live):
        return {}
    columns = shutil.get_terminal_size().columns - len(f"[rank{rank}]: ")
    return {"RINGLET_CONSOLE_TTY": "1", "COLUMNS": str(max(40, columns))}


def worker_specs(run: Run, restart: int, ranks: Collection[int] | None = None) -> list[WorkerSpec]:
    """What each local worker of generation ``restart`` (only ``ranks``, if given) runs, with
    what, and where its output goes."""
    config, specs = run.config, []
    for lr in range(config.nproc_per_node):
        rank = config.global_rank(lr)
        if ranks is not None and rank not in ranks:
            continue
        plan = stream_plan(config.local_rank_base + lr, config.log_dir, config.redirects,
                           config.tee, config.local_ranks_filter)
        paths = (log_paths(run.log_root, restart, config.local_rank_base + lr) if run.log_root
                 else None)
        out_log = paths[0] if paths and plan.file_out else None
        err_log = paths[1] if paths and plan.file_err else None
        hb = (os.path.join(run.run_dir, f"heartbeat-gen{restart}-rank{rank}")
              if config.heartbeat_timeout else None)
        out = _sink(plan.console_out, sys.stdout.buffer, rank, out_log)
        err = _sink(plan.console_err, sys.stderr.buffer, rank, err_log)
        env = worker_env(config, lr, restart, run.port, run_id=run.run_id, run_dir=run.run_dir,
                         token_file=run.token_file, launcher_pid=os.getpid(), heartbeat_file=hb)
        specs.append(WorkerSpec(
            rank=rank, local_rank=lr, command=worker_command(config, local_rank=lr),
            env={**env, **_terminal_env(out, err, rank)},
            error_file=error_file(run.run_dir, restart, rank),
            stdout=out,
            stderr=err,
            log_files=tuple(p for p in (out_log, err_log) if p), heartbeat_file=hb,
        ))
    return specs


def run_generation(run: Run, restart: int, elsewhere: Callable[[], bool] | None = None,
                   wake_fd: int | None = None) -> GenerationResult:
    """Start this node's workers of generation ``restart``, watch them, always stop them.
    ``elsewhere()`` says the job failed on another node; ``wake_fd`` becomes readable then."""
    config = run.config
    generation = Generation(worker_specs(run, restart), heartbeat_timeout=config.heartbeat_timeout,
                            python_workers=not config.no_python)
    try:
        generation.start()
        return generation.watch(config.monitor_interval, lambda: run.signals.received, elsewhere,
                                wake_fd)
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
    return (f"expected --nproc-per-node <= {limit} on this machine ({why}), got "
            f"{config.nproc_per_node}")


def prepare(config: LaunchConfig) -> int | None:
    """What precedes any launch on this node; returns an exit code when the launch is refused."""
    refused = check_entrypoint(config) or check_capacity(config)
    if refused is not None:
        say(f"error: {refused}")
        return 2
    # Orphaned descendants of workers come back to us, so that teardown can end them (_reaper).
    become_subreaper()
    if config.local_size > 1 and "OMP_NUM_THREADS" not in os.environ:
        say("setting OMP_NUM_THREADS=1 for each worker to avoid overloading the CPUs; "
            "set it yourself to tune")
    return None


def run_single(config: LaunchConfig, supervise: Callable[[Run], int] | None = None) -> int:
    """Host the store, then run and restart this node's workers (a one-node job) with
    ``supervise`` (default: whole-job restarts)."""
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
            try:
                log_root = make_log_root(config, run_id)
            except ValueError as err:   # nothing started yet
                say(f"error: {err}")
                return 2
            return (supervise or _supervise)(Run(config=config, run_id=run_id, run_dir=rdir,
                                  token_file=token_file, port=store.port, signals=signals,
                                  log_root=log_root))
        finally:
            store.close()
