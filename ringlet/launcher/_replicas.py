"""``--restart-policy replica``: restart only the replica whose worker failed; the others go on.

The workers are split into replicas of ``--replica-size`` consecutive ranks.  Each replica runs
as its own :class:`~ringlet.launcher._supervisor.Generation`; when one of its workers fails, the
launcher stops that replica's other workers (a replica that lost a process cannot go on), and
starts the replica again with ``RINGLET_REPLICA_RESTART`` (and ``TORCHELASTIC_RESTART_COUNT``)
one higher, while ``--max-restarts`` (counted over all replicas) allows.  The restarted workers
rejoin the live ones through ``ringlet.ft``, which copies the state to them.

A worker that fails after another replica has already finished is not restarted (there is no
live replica left to heal it; the job's result is with the replicas that finished): it is
reported, and the exit status is that of the replicas that ran to the end.
"""

from __future__ import annotations

import signal
import sys
import time

from ringlet.launcher._job import Run, failure_summary, worker_specs
from ringlet.launcher._runtime import say
from ringlet.launcher._supervisor import Generation, WorkerStartError

__all__ = ["supervise_replicas"]


def _start(run: Run, replica: int, restart: int) -> Generation:
    size = run.config.replica_size
    ranks = {run.config.global_rank(lr) for lr in range(run.config.nproc_per_node)
             if run.config.global_rank(lr) // size == replica}
    gen = Generation(worker_specs(run, restart, ranks), python_workers=not run.config.no_python)
    gen.start()
    return gen


def _others(gens: dict[int, Generation]) -> list[int]:
    return [w.pid for g in gens.values() for w in g.workers]


def _state(gen: Generation) -> str:
    codes = [w.popen.poll() for w in gen.workers]
    if any(c not in (None, 0) for c in codes):
        return "failed"
    return "succeeded" if all(c == 0 for c in codes) else "running"


def supervise_replicas(run: Run) -> int:
    """Run every replica to the end, restarting failed ones; returns the launcher's exit code."""
    config, signals = run.config, run.signals
    count = config.nproc_per_node // config.replica_size
    first = config.global_rank(0) // config.replica_size
    gens: dict[int, Generation] = {}
    restarts = dict.fromkeys(range(first, first + count), 0)
    finished: set[int] = set()
    used = 0
    try:
        for r in restarts:
            gens[r] = _start(run, r, 0)
        while gens:
            if signals.received is not None:
                say(f"stopped workers on {signal.Signals(signals.received).name}")
                return 128 + signals.received
            for r, gen in list(gens.items()):
                state = _state(gen)
                if state == "running":
                    continue
                del gens[r]
                if state == "succeeded":
                    gen.stop(config.grace_period, _others(gens))
                    finished.add(r)
                    continue
                failures = gen.failures()
                gen.stop(config.grace_period, _others(gens))
                if finished:
                    say(f"replica {r}: rank {failures[0].rank} failed with "
                        f"{failures[0].reason} after replica(s) {sorted(finished)} finished; "
                        "not restarted")
                    continue
                if used >= config.max_restarts:
                    print(failure_summary(failures[0], failures[1:], used + 1, run.run_id),
                          file=sys.stderr, flush=True)
                    return 1
                used += 1
                restarts[r] += 1
                say(f"replica {r}: rank {failures[0].rank} (pid {failures[0].pid}) failed with "
                    f"{failures[0].reason}; restarting replica {r} only "
                    f"({used}/{config.max_restarts}), the others go on")
                gens[r] = _start(run, r, restarts[r])
            time.sleep(config.monitor_interval)
    except WorkerStartError as err:
        say(f"error: {err}")
        return 1
    finally:
        for gen in gens.values():
            gen.stop(config.grace_period)
    return 0
