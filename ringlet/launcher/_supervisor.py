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
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import BinaryIO, Literal

from ringlet._segments import sweep_stale
from ringlet.launcher._reaper import Reaper

__all__ = ["Generation", "GenerationResult", "Worker", "WorkerFailure", "WorkerStartError", "describe_exit"]

_OUTPUT_LOCK = threading.Lock()  # one writer at a time, so prefixed lines never interleave
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


@dataclass
class Worker:
    """One running worker and the threads forwarding its output."""

    rank: int
    local_rank: int
    popen: subprocess.Popen[bytes]
    error_file: str
    readers: list[threading.Thread] = field(default_factory=list)

    @property
    def pid(self) -> int:
        return self.popen.pid


@dataclass(frozen=True)
class WorkerFailure:
    """A worker that failed by itself (not one the launcher stopped)."""

    rank: int
    local_rank: int
    pid: int
    returncode: int
    timestamp: float  # from the error file when the worker wrote one, else when seen dead
    error: dict[str, object] | None  # the worker's error file, if any

    @property
    def reason(self) -> str:
        return describe_exit(self.returncode)


@dataclass(frozen=True)
class GenerationResult:
    # stopped: failed on another node; start_failed: the machine refused to start a worker
    state: Literal["succeeded", "failed", "interrupted", "stopped", "start_failed"]
    failures: tuple[WorkerFailure, ...] = ()  # earliest first
    signum: int | None = None  # the signal that interrupted the launcher
    message: str = ""  # for start_failed: which worker and why


def _forward(stream: BinaryIO, sink: BinaryIO, prefix: bytes) -> None:
    try:
        for line in iter(stream.readline, b""):
            if not line.endswith(b"\n"):
                line += b"\n"
            with _OUTPUT_LOCK:
                sink.write(prefix + line)
                sink.flush()
    except (OSError, ValueError):
        pass  # the sink or the pipe went away while the launcher shuts down
    finally:
        stream.close()


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
    if isinstance(msg, dict):  # torch.distributed.elastic's {"message": {"extraInfo": ...}}
        extra = msg.get("extraInfo") or {}
        data = {
            "message": msg.get("message", ""),
            "traceback": extra.get("py_callstack", ""),
            "timestamp": float(extra.get("timestamp", 0) or 0),
        }
    return data


class Generation:
    """Workers of one restart generation.

    ``command`` and ``envs`` come from the plan (``_plan.worker_command``/``worker_env``),
    one env per local rank; ``ranks`` maps local rank -> global rank.
    """

    def __init__(
        self,
        command: Sequence[str],
        envs: Sequence[dict[str, str]],
        ranks: Sequence[int],
        error_files: Sequence[str],
        *,
        stdout: BinaryIO,
        stderr: BinaryIO,
    ) -> None:
        if not len(envs) == len(ranks) == len(error_files):
            raise AssertionError(
                f"expected one env, rank and error file per worker, got "
                f"{len(envs)}, {len(ranks)}, {len(error_files)}"
            )
        self._command = list(command)
        self._envs = list(envs)
        self._ranks = list(ranks)
        self._error_files = list(error_files)
        self._stdout, self._stderr = stdout, stderr
        self.workers: list[Worker] = []
        self._reaper: Reaper | None = None

    def start(self) -> None:
        """Start every worker.

        Raises:
            WorkerStartError: a worker could not be started (fork/exec failed: process or memory
                limits); the caller stops the ones already started.
        """
        self._reaper = Reaper()
        for local_rank, (env, rank) in enumerate(zip(self._envs, self._ranks, strict=True)):
            try:
                popen = subprocess.Popen(
                    self._command,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    process_group=0,
                )
            except OSError as e:
                raise WorkerStartError(
                    f"could not start the worker of rank {rank} (local rank {local_rank}; "
                    f"{len(self.workers)} of {len(self._envs)} started): {e.strerror or e} -- the "
                    "machine refused a new process (process, memory or file limits: see ulimit -a); "
                    "try a smaller --nproc-per-node") from None
            worker = Worker(rank, local_rank, popen, self._error_files[local_rank])
            self.workers.append(worker)
            prefix = f"[rank{rank}]: ".encode()
            for stream, sink in ((popen.stdout, self._stdout), (popen.stderr, self._stderr)):
                if stream is None:
                    raise AssertionError("expected a pipe for the worker's output, got None")
                t = threading.Thread(
                    target=_forward, args=(stream, sink, prefix),
                    name=f"ringlet-run-rank{rank}-output", daemon=True,
                )
                t.start()
                worker.readers.append(t)

    def watch(
        self, interval: float, interrupted: Callable[[], int | None],
        elsewhere: Callable[[], bool] | None = None,
    ) -> GenerationResult:
        """Poll every ``interval`` s until all workers succeed, one fails, a signal arrives, or
        ``elsewhere()`` says the job failed on another node (multi-node runs)."""
        while True:
            signum = interrupted()
            if signum is not None:
                return GenerationResult("interrupted", signum=signum)
            if elsewhere is not None and elsewhere():
                return GenerationResult("stopped")
            codes = [w.popen.poll() for w in self.workers]
            failed = [w for w, rc in zip(self.workers, codes, strict=True) if rc not in (None, 0)]
            if failed:
                return GenerationResult("failed", failures=self._failures(failed))
            if all(rc == 0 for rc in codes):
                return GenerationResult("succeeded")
            time.sleep(interval)

    @staticmethod
    def _failures(failed: list[Worker]) -> tuple[WorkerFailure, ...]:
        seen = time.time()
        out = []
        for w in failed:
            error = read_error_file(w.error_file)
            stamp = error.get("timestamp") if error else None
            out.append(WorkerFailure(
                rank=w.rank, local_rank=w.local_rank, pid=w.pid,
                returncode=int(w.popen.returncode),
                timestamp=float(stamp) if isinstance(stamp, int | float) else seen,
                error=error,
            ))
        return tuple(sorted(out, key=lambda f: (f.timestamp, f.rank)))

    def _signal_all(self, sig: int) -> None:
        for w in self.workers:
            try:
                os.killpg(w.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the group is already gone

    def stop(self, grace_period: float) -> None:
        """SIGTERM, wait up to ``grace_period`` s, SIGKILL, reap; every step is bounded.  Then end
        the workers' detached descendants and remove the segments their killing left behind."""
        pids = [w.pid for w in self.workers]
        reaper = self._reaper or Reaper()
        reaper.record(pids)
        if any(w.popen.poll() is None for w in self.workers):
            self._signal_all(signal.SIGTERM)
            reaper.signal(signal.SIGTERM, pids)
            deadline = time.monotonic() + grace_period
            while time.monotonic() < deadline:
                if all(w.popen.poll() is not None for w in self.workers):
                    break
                time.sleep(0.02)
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
