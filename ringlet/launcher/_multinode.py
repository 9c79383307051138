"""``ringlet-run --nnodes N``: one launcher per node, node 0's hosting the store.

Usage (two shells, or two hosts; see docs/multi_host.md)::

    ringlet-run --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \\
        --rdzv-token-file ~/.ringlet-token --nproc-per-node 4 train.py
    ringlet-run --nnodes 2 --node-rank 1 --master-addr 10.0.0.1 --master-port 29500 \\
        --rdzv-token-file ~/.ringlet-token --nproc-per-node 4 train.py

Node 0 binds its store to ``--master-addr`` exactly (never every interface); ``--master-port 0``
on node 0 lets it pick a port, which it prints.  The launchers agree before any worker starts
([Note: node rendezvous] in ``_nodes``), start every generation together, stop together when a
worker fails anywhere, and restart together while ``--max-restarts`` allows.
"""

from __future__ import annotations

import os
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any

from ringlet.errors import DistError
from ringlet.launcher._job import Run, failure_summary, make_log_root, run_generation
from ringlet.launcher._nodes import (
    BEAT_PERIOD_S,
    NodeRendezvous,
    Outcome,
    RendezvousFailed,
    launcher_version,
)
from ringlet.launcher._plan import PROG, LaunchConfig
from ringlet.launcher._runtime import Signals, run_dir, say, shared_token
from ringlet.launcher._supervisor import GenerationResult
from ringlet.store import TCPStore

__all__ = ["run_nodes"]


def run_nodes(config: LaunchConfig) -> int:
    """Launch this node's share of a multi-node job; returns the launcher's exit code."""
    try:
        config.check_reachable()
        token = shared_token(config)
    except ValueError as err:
        say(f"error: {err}")
        return 2
    node0 = config.node_rank == 0
    where = f"{config.master_addr}:{config.master_port}"
    with Signals().installed() as signals, run_dir(token) as (rdir, token_file, tok):
        try:
            store = TCPStore(config.master_addr, config.master_port, world_size=None,
                             is_master=node0, timeout=timedelta(seconds=config.rdzv_timeout),
                             wait_for_workers=False,
                             token=tok, rank=-1)
        except (OSError, DistError) as err:
            say(f"could not {'host' if node0 else 'reach'} the store on {where}: {err}")
            return 1
        try:
            where = f"{config.master_addr}:{store.port}"
            if node0:
                say(f"node 0 hosts the rendezvous store at {where}; waiting "
                    f"for {config.nnodes} nodes")
            return _join_and_run(config, store, where, signals, rdir, token_file)
        except DistError as err:     # the store went away under us (node 0 died or the link broke)
            say(f"lost the rendezvous store at {where}: {err}")
            return 1
        finally:
            store.close()


def _join_and_run(config: LaunchConfig, store: TCPStore, where: str, signals: Signals, rdir: str,
                  token_file: str) -> int:
    info = {"nnodes": config.nnodes, "nproc_per_node": config.nproc_per_node,
            "max_restarts": config.max_restarts, "version": launcher_version()}
    nodes = NodeRendezvous(store, config.node_rank, config.nnodes, info, config.rdzv_timeout, where)
    try:
        run_id = nodes.join(config.rdzv_id or secrets.token_hex(6))
    except RendezvousFailed as err:
        say(f"rendezvous failed: {err}")
        nodes.leave()
        return 1
    say(f"node {config.node_rank}/{config.nnodes} joined run {run_id}: ranks "
        f"{config.global_rank(0)}..{config.global_rank(config.nproc_per_node - 1)} "
        f"of {config.world_size}")
    try:
        log_root = make_log_root(config, run_id)
    except ValueError as err:
        say(f"error: {err}")
        nodes.leave()
        return 2
    run = Run(config=config, run_id=run_id, run_dir=rdir, token_file=token_file, port=store.port,
              signals=signals, log_root=log_root)
    try:
        return _supervise(run, nodes)
    except RendezvousFailed as err:
        say(f"rendezvous failed: {err}")
        return 1
    finally:
        nodes.leave()


def _supervise(run: Run, nodes: NodeRendezvous) -> int:
    config, signals = run.config, run.signals
    for gen in range(config.max_restarts + 1):
        nodes.start_generation(gen)
        result, outcome = _generation(run, nodes, gen)
        if signals.received is not None:
            say(f"stopped workers on {signal.Signals(signals.received).name}")
            return 128 + signals.received
        if outcome.state == "succeeded":
            return 0
        report = outcome.report or {}
        if outcome.state == "interrupted":
            say(f"node {report.get('node')} ({report.get('host')}) was "
                f"interrupted: {report.get('reason')}")
            return 1
        if gen < config.max_restarts:
            say(f"{_who(report)} failed with {report.get('reason')}; restarting workers on every "
                f"node ({gen + 1}/{config.max_restarts})")
            continue
        if result.state == "failed" and report.get("node") == config.node_rank:
            first, *others = result.failures
            print(failure_summary(first, others, gen + 1, run.run_id), file=sys.stderr, flush=True)
        else:
            print(_remote_summary(report, gen + 1, run.run_id), file=sys.stderr, flush=True)
    return 1


class _RemoteFailureWatch:
    """While this node's workers run, a thread blocks on the store until another node reports a
    failure of ``gen`` (beating meanwhile), then wakes the launcher's wait through a pipe, so the
    main thread never polls the store ([Note: node rendezvous])."""

    def __init__(self, nodes: NodeRendezvous, gen: int) -> None:
        self._nodes, self._gen = nodes, gen
        self._stop = threading.Event()
        self._failed = threading.Event()
        self._lock = threading.Lock()
        self._exited = False
        self._r, self._w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name=f"ringlet-run-nodes-gen{gen}",
                                        daemon=True)

    @property
    def fd(self) -> int:
        return self._r

    def failed(self) -> bool:
        return self._failed.is_set()

    def _run(self) -> None:
        key = f"launcher/gen{self._gen}/failed"
        try:
            while not self._stop.is_set():
                if self._nodes._wait([key], time.monotonic() + BEAT_PERIOD_S):
                    break
        except (DistError, OSError):   # the store is gone: the main thread finds out itself
            pass
        with self._lock:   # whichever of this thread and stop() comes second closes the pipe
            self._exited = True
            if self._stop.is_set():
                self._close()
            else:
                self._failed.set()
                os.write(self._w, b"x")

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Never waits for the thread's current store wait: it leaves within a beat period."""
        with self._lock:
            self._stop.set()
            if self._exited:
                self._close()

    def _close(self) -> None:
        os.close(self._r)
        os.close(self._w)


def _generation(run: Run, nodes: NodeRendezvous, gen: int) -> tuple[GenerationResult, Outcome]:
    """Run this node's workers of ``gen``; the job's outcome decides what happens next."""
    watch = _RemoteFailureWatch(nodes, gen)
    watch.start()
    try:
        result = run_generation(run, gen, watch.failed, watch.fd)
    finally:
        watch.stop()
    if result.state == "start_failed":
        say(f"error: {result.message}")
        won = nodes.report_failure(gen, {"reason": result.message, "interrupted": True})
        return result, Outcome("interrupted", won)
    if result.state == "succeeded":
        return result, nodes.wait_outcome(gen)
    if result.state == "interrupted" and result.signum is not None:
        name = signal.Signals(result.signum).name
        won = nodes.report_failure(gen, {"reason": f"its launcher got {name}", "interrupted": True})
        return result, Outcome("interrupted", won)
    if result.state == "failed":
        first = result.failures[0]
        tb = str(first.error.get("traceback", "")) if first.error else ""
        won = nodes.report_failure(gen, {"rank": first.rank, "pid": first.pid,
                                         "reason": first.reason, "traceback": tb[-4000:]})
        return result, Outcome("failed", won)
    failed = nodes.remote_failure(gen) or {}
    return result, Outcome("interrupted" if failed.get("interrupted") else "failed", failed)


def _who(report: dict[str, Any]) -> str:
    rank = f"rank {report['rank']} (pid {report.get('pid')}) on " if "rank" in report else ""
    return f"{rank}node {report.get('node')} ({report.get('host')})"


def _remote_summary(report: dict[str, Any], attempts: int, run_id: str) -> str:
    lines = [f"{PROG}: job failed after {attempts} attempt(s) (run id {run_id})",
             f"  first failure: {_who(report)}, {report.get('reason')}"]
    tb = str(report.get("traceback") or "")
    if tb:
        lines.append("  traceback (from that node):")
        lines.extend("    " + line for line in tb.rstrip("\n").splitlines())
    return "\n".join(lines)
