"""One generation of workers: spawn, forward their output, watch them, stop them.

Teardown order (also used when the launcher itself is signalled): SIGTERM every worker's
process group, wait up to the grace period, SIGKILL whatever is left, reap every worker,
then join the output threads with a deadline. Each worker leads its own process group, so
the signals also reach the processes it started (``multiprocessing`` children, data loader
workers) and a Ctrl-C in the terminal reaches only the launcher, which decides.

Processes that left their worker's group (``setsid``) or were orphaned are found and ended too
(``_reaper``), and shared-memory segments whose creator was killed before it could unlink them are
removed ([Note: segment lifecycle] in ``ringlet._segments``): a stopped generation leaves nothing.

Workers are spawned from the launcher's main thread: ``PR_SET_PDEATHSIG`` (set by
``_worker``) fires when the *thread* that forked the child exits, so a short-lived
spawning thread would kill its workers.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from ringlet._segments import sweep_stale
from ringlet.launcher._forward import Sink, start_forwarder
from ringlet.launcher._reaper import Reaper
from ringlet.launcher._watch import Heartbeats, kill_hung, wait_workers

__all__ = ["Generation", "GenerationResult", "Worker", "WorkerFailure", "WorkerSpec",
           "WorkerStartError", "describe_exit"]

_READER_JOIN_S = 2.0  # pipes held open by a worker's stray children must not block exit


def describe_exit(returncode: int) -> str:
    """``exit code 1`` or ``signal SIGSEGV`` (Popen reports death by signal N as -N)."""
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class WorkerStartError(RuntimeError):
    """The operating system refused to start a worker (fork or exec failed)."""


@dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything needed to start and watch one worker (built by ``_job.worker_specs``)."""

    rank: int
    local_rank: int
    command: Sequence[str]
    env: dict[str, str]
    error_file: str
    stdout: Sink    # console/file sinks; their files are opened here, closed by the forwarders
    stderr: Sink
    log_files: tuple[str, ...] = ()     # the stdout/stderr log paths, for the failure summary
    heartbeat_file: str | None = None


@dataclass
class Worker:
    """One running worker and the threads forwarding its output."""

    spec: WorkerSpec
    popen: subprocess.Popen[bytes]
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def rank(self) -> int:
        return self.spec.rank


@dataclass(frozen=True)
class WorkerFailure:
    """A worker that failed by itself (not one the launcher stopped)."""

    rank: int
    local_rank: int
    pid: int
    returncode: int
    timestamp: float  # from the error file when the worker wrote one, else when seen dead
    error: dict[str, object] | None  # the worker's error file, if any
    hung_s: float | None = None  # killed by the launcher after this long without a heartbeat
    log_files: tuple[str, ...] = ()  # where its output went, when it was logged

    @property
    def reason(self) -> str:
        if self.hung_s is not None:
            return (f"no progress for {self.hung_s:.1f} s (--heartbeat-timeout); hung, killed "
                    f"with {describe_exit(self.returncode).removeprefix('signal ')}")
        return describe_exit(self.returncode)


@dataclass(frozen=True)
class GenerationResult:
    # stopped: failed on another node; start_failed: the machine refused to start a worker
    state: Literal["succeeded", "failed", "interrupted", "stopped", "start_failed"]
    failures: tuple[WorkerFailure, ...] = ()  # earliest first
    signum: int | None = None  # the signal that interrupted the launcher
    message: str = ""  # for start_failed: which worker and why


def read_error_file(path: str) -> dict[str, object] | None:
    """The worker's error record, or None; torch's ``@record`` format is read too."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    msg = data.get("message")
    if isinstance(msg, dict) and "traceback" in data:   # ringlet's, with torch's nested record
        return {**data, "message": msg.get("message", "")}
    if isinstance(msg, dict):  # torch.distributed.elastic's {"message": {"extraInfo": ...}}
        extra = msg.get("extraInfo") or {}
        data = {
            "message": msg.get("message", ""),
            "traceback": extra.get("py_callstack", ""),
            "timestamp": float(extra.get("timestamp", 0) or 0),
        }
    return data


class Generation:
    """Workers of one restart generation, one :class:`WorkerSpec` each.

    ``heartbeat_timeout`` > 0 watches every worker's heartbeat file ([Note: heartbeat]);
    ``python_workers`` says whether a hung worker can be asked for its stacks (SIGUSR1).
    """

    def __init__(self, specs: Sequence[WorkerSpec], *, heartbeat_timeout: float = 0.0,
                 python_workers: bool = True) -> None:
        self._specs = list(specs)
        self.workers: list[Worker] = []
        self._reaper: Reaper | None = None
        self._python = python_workers
        self._heartbeats: Heartbeats | None = None
        if heartbeat_timeout > 0:
            paths = [sp.heartbeat_file for sp in self._specs]
            if any(p is None for p in paths):
                raise AssertionError("expected a heartbeat file per worker with a heartbeat "
                                     "timeout")
            self._heartbeats = Heartbeats([p for p in paths if p is not None], heartbeat_timeout)

    def start(self) -> None:
        """Start every worker.

        Raises:
            WorkerStartError: a worker could not be started (fork/exec failed: process or memory
                limits); the caller stops the ones already started.
        """
        self._reaper = Reaper()
        if self._heartbeats is not None:
            self._heartbeats.create()
        for spec in self._specs:
            popen = self._spawn(spec)
            worker = Worker(spec, popen)
            self.workers.append(worker)
            for stream, sink in ((popen.stdout, spec.stdout), (popen.stderr, spec.stderr)):
                if stream is None:
                    raise AssertionError("expected a pipe for the worker's output, got None")
                worker.readers.append(start_forwarder(stream, sink,
                                                      f"ringlet-run-rank{spec.rank}-output"))

    def _spawn(self, spec: WorkerSpec) -> subprocess.Popen[bytes]:
        try:
            return subprocess.Popen(
                list(spec.command),
                env=spec.env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                process_group=0,
            )
        except OSError as e:
            for sink in (spec.stdout, spec.stderr):
                if sink.file is not None:
                    sink.file.close()
            raise WorkerStartError(
                f"could not start the worker of rank {spec.rank} (local rank {spec.local_rank}; "
                f"{len(self.workers)} of {len(self._specs)} started): {e.strerror or e} -- the "
                "machine refused a new process (process, memory or file limits: see ulimit -a); "
                "try a smaller --nproc-per-node") from None

    def watch(
        self, interval: float, interrupted: Callable[[], int | None],
        elsewhere: Callable[[], bool] | None = None, wake_fd: int | None = None,
    ) -> GenerationResult:
        """Wait until all workers succeed, one fails or hangs (heartbeat), a signal arrives, or
        ``elsewhere()`` says the job failed on another node (multi-node runs; ``wake_fd`` turns
        readable then).  Blocks on the workers' pidfds, the signal pipe and ``wake_fd``;
        ``interval`` paces the periodic checks only."""
        popens = [w.popen for w in self.workers]
        out = wait_workers(popens, interval, interrupted, elsewhere, self._heartbeats,
                           lambda i: kill_hung(popens[i], self._python), wake_fd)
        if out.state == "failed":
            failed = [self.workers[i] for i in out.failed]
            return GenerationResult("failed", failures=self._failures(failed, out.hung, out.failed))
        return GenerationResult(out.state, signum=out.signum)  # type: ignore[arg-type]

    def failures(self) -> tuple[WorkerFailure, ...]:
        """The workers that have exited with an error so far, earliest first."""
        idx = [i for i, w in enumerate(self.workers) if w.popen.poll() not in (None, 0)]
        return self._failures([self.workers[i] for i in idx], {}, idx)

    @staticmethod
    def _failures(failed: list[Worker], hung: dict[int, float],
                  indices: list[int]) -> tuple[WorkerFailure, ...]:
        seen = time.time()
        out = []
        for w, i in zip(failed, indices, strict=True):
            error = read_error_file(w.spec.error_file)
            stamp = error.get("timestamp") if error else None
            out.append(WorkerFailure(
                rank=w.rank, local_rank=w.spec.local_rank, pid=w.pid,
                returncode=int(w.popen.returncode if w.popen.returncode is not None else -9),
                timestamp=float(stamp) if isinstance(stamp, int | float) else seen,
                error=error, hung_s=hung.get(i), log_files=w.spec.log_files,
            ))
        return tuple(sorted(out, key=lambda f: (f.timestamp, f.rank)))

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            try:
                os.killpg(w.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is already gone

    def stop(self, grace_period: float, spare: Sequence[int] = ()) -> None:
        """SIGTERM, wait up to ``grace_period`` s, SIGKILL, reap; every step is bounded.  Then end
        the workers' detached descendants and remove the segments their killing left behind.
        ``spare``: the launcher's other children that keep running (other replicas' workers)."""
        pids = [w.pid for w in self.workers]
        reaper = self._reaper or Reaper()
        reaper.spare(spare)
        reaper.record(pids)
        if any(w.popen.poll() is None for w in self.workers):
            self._signal_all(signal.SIGTERM)
            reaper.signal(signal.SIGTERM, pids)
            _wait_all([w.popen for w in self.workers], grace_period)
        # Also reaches descendants of workers that already exited.
        self._signal_all(signal.SIGKILL)
        for w in self.workers:
            try:
                w.popen.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                # SIGKILL was sent; only an uninterruptible (D-state) process gets here.
                pass
        reaper.finish(pids)
        sweep_stale()
        deadline = time.monotonic() + _READER_JOIN_S
        for w in self.workers:
            for t in w.readers:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._heartbeats is not None:
            self._heartbeats.close()


def _wait_all(popens: Sequence[subprocess.Popen[bytes]], seconds: float) -> None:
    """Until every process exited or ``seconds`` passed, blocked on their pidfds."""
    deadline = time.monotonic() + seconds
    fds: list[int] = []
    with selectors.DefaultSelector() as sel:
        try:
            for p in popens:
                if p.poll() is None:
                    fds.append(os.pidfd_open(p.pid))
                    sel.register(fds[-1], selectors.EVENT_READ)
        except (OSError, AttributeError):   # no pidfds: wake on a short timer instead
            pass
        try:
            while any(p.poll() is None for p in popens):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                for key, _ in sel.select(remaining if fds else min(remaining, 0.02)):
                    sel.unregister(key.fd)
        finally:
            for fd in fds:
                os.close(fd)
