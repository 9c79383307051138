"""``--fault-tolerant``: replicas that drop out and rejoin while the others keep training.

Launch with ``ringlet-run --restart-policy replica [--replica-size N] --max-restarts K``.  Each
replica is one process (``--strategy ddp``) or ``--replica-size`` processes that ``fully_shard``
the model over their own world (``--strategy hsdp``: ``ft.init_replica_group()`` makes the
replica's processes the default world; the ``ringlet.ft.Manager`` carries the replica axis).

Every step: ``start_quorum()`` (agree on the live replicas, heal a new one), forward and backward
on this process's rows of the step's global batch, ``allreduce_gradients`` (average over the live
replicas; retried over the survivors if one dies in the step), then the optimizer step if the
step commits.  The global batch of a step and its split over ``num_replicas x replica_size``
processes are those of the normal trainer, so without a failure the losses equal those of
``--strategy ddp`` (or ``hsdp``) on as many ranks.  When a replica is missing, its rows of the
batch are left out of the step (``lost``).  The loss history and the fault-tolerance events
travel with the heal (a ``stateful`` of the Manager), so a restarted rank 0 prints them all.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import statistics
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

import torch

import ringlet.distributed as dist
from ringlet import ft

from . import checkpoint, report
from .data import TextData
from .observe import Progress, StepMeter, breakdown_table, gather_windows, peak_rss_mib, state_mib
from .resume import RunRefused, decide
from .strategies import Layout, Parallel, parallelize
from .trainer import (
    TrainConfig,
    _rows,
    _sample,
    _world_mean,
    check_config,
    evaluate,
    loss_of,
    lr_at,
    new_model,
    optimizer_for,
)

STRATEGIES = ("ddp", "hsdp")


def check(cfg: TrainConfig, env: Mapping[str, str] = os.environ) -> None:
    """Refuse what ``--fault-tolerant`` does not support (raises :class:`RunRefused`)."""
    if not cfg.fault_tolerant:
        if cfg.kill_random:
            raise RunRefused("--kill-random: expected --fault-tolerant too (without it a killed "
                             "rank ends the job)")
        return
    if cfg.strategy not in STRATEGIES:
        raise RunRefused(f"--fault-tolerant: expected --strategy ddp or hsdp (replicas of the "
                         f"whole model), got {cfg.strategy!r}")
    if cfg.resume:
        raise RunRefused("--fault-tolerant: --resume is not supported (a replica that fails "
                         "heals from a live one instead); a checkpoint of a fault-tolerant run "
                         "resumes without --fault-tolerant")
    policy = env.get("RINGLET_RESTART_POLICY")
    if policy != "replica":
        raise RunRefused("--fault-tolerant: expected a launch by ringlet-run --restart-policy "
                         "replica [--replica-size N] --max-restarts K (so that only a failed "
                         f"replica restarts), got restart policy {policy or 'job (the default)'}")
    size, world = int(env.get("RINGLET_REPLICA_SIZE", "1")), int(env["WORLD_SIZE"])
    if cfg.strategy == "ddp" and size != 1:
        raise RunRefused(f"--strategy ddp --fault-tolerant: each process is a replica: expected "
                         f"--replica-size 1, got {size} (--strategy hsdp shards a replica)")
    if cfg.replicate not in (None, world // size):
        raise RunRefused(f"--replicate: expected {world // size} (world {world} / --replica-size "
                         f"{size}) with --fault-tolerant, got {cfg.replicate}")
    if cfg.tp is not None:
        raise RunRefused(f"--tp: expected none with --fault-tolerant, got {cfg.tp}")
    if cfg.kill_random and world // size < 2:
        raise RunRefused(f"--kill-random: expected 2 or more replicas (world {world} / "
                         f"--replica-size {size}), got {world // size}")


def check_out(cfg: TrainConfig, incarnation: int, run_id: str) -> None:
    """Refuse an ``--out`` that holds an earlier run's checkpoint (as the plain trainer does);
    a restarted replica accepts the checkpoints this job wrote (``run_id`` in trainer.json)."""
    path = checkpoint.latest(cfg.out)
    if path is None:
        return
    if incarnation > 0:
        with open(os.path.join(path, "trainer.json")) as f:
            if json.load(f).get("run_id") == run_id:
                return
    decide(cfg)         # raises RunRefused: a checkpoint of another run, and no --resume


def kill_plan(seed: int, steps: int, num_replicas: int) -> tuple[int, int]:
    """``(replica, step)`` that ``--kill-random`` kills: from the seed alone, so every replica
    computes the same; the step (0-based: after that many committed steps) is between a quarter
    and a half of ``steps``."""
    rng = random.Random(seed)
    victim = rng.randrange(num_replicas)
    low = max(1, steps // 4)
    return victim, rng.randint(low, max(low, steps // 2))


class History:
    """The run's losses and fault-tolerance events: a ``stateful`` the Manager copies to a
    healing replica."""

    def __init__(self) -> None:
        self.data: dict[str, Any] = {"train_loss": [], "val": [], "step_s": [], "ft": {
            "members": [], "failures": [], "rejoins": [], "lost_shares": 0}}

    def state_dict(self) -> dict[str, Any]:
        return {"history": self.data}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.data = state["history"]


def main(cfg: TrainConfig) -> int:
    """``train_gpt.py --fault-tolerant`` on this process; the exit status."""
    try:
        check(cfg)
    except RunRefused as refused:
        if os.environ.get("RANK", "0") == "0":
            print(f"train_gpt: error: {refused}", file=sys.stderr, flush=True)
        return 2
    ft.init_replica_group()
    try:
        train(cfg)
    except RunRefused as refused:
        if int(os.environ["RANK"]) == 0:
            print(f"train_gpt: error: {refused}", file=sys.stderr, flush=True)
        return 2
    finally:
        dist.destroy_process_group()
    return 0


def _build(cfg: TrainConfig, num_replicas: int) -> tuple[Parallel, Parallel, Any]:
    """(the model as the steps see it, as evaluation sees it, the optimizer).  Training splits
    the global batch over every process of every replica; evaluation over the replica's."""
    size, rank = dist.get_world_size(), int(os.environ["RANK"])
    if cfg.strategy == "hsdp":
        inner = parallelize(new_model(cfg), Layout(strategy="fsdp", shard=size), cfg.bf16)
        outer = Layout(strategy="hsdp", replicate=num_replicas, shard=size)
    else:      # a replica of one process: no DDP wrapper, the Manager averages the gradients
        inner = Parallel(new_model(cfg), Layout(strategy="ddp"), 0, cfg.bf16)
        outer = Layout(strategy="ddp", shard=num_replicas)
    check_config(cfg, outer.dp, 1)
    return (Parallel(inner.model, outer, rank, cfg.bf16), inner, optimizer_for(inner.model, cfg))


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Train as one replica's process (after ``ft.init_replica_group()``); returns the history
    (as ``trainer.train``)."""
    incarnation = int(os.environ.get("RINGLET_REPLICA_RESTART", "0"))
    check_out(cfg, incarnation, os.environ.get("TORCHELASTIC_RUN_ID", ""))
    size = dist.get_world_size()
    num_replicas = int(os.environ["WORLD_SIZE"]) // size
    par, eval_par, opt = _build(cfg, num_replicas)
    data = TextData.load(cfg.data, cfg.block_size, cfg.data_bytes)
    history = History()
    manager = ft.Manager(par.model, opt, stateful=[history])
    run = _Run(cfg, par, eval_par, opt, data, manager, history)
    if run.talks:
        _header(run, incarnation)
    if incarnation == 0:
        history.data["val"].append([0, evaluate(eval_par, data, cfg)])
        run.say(f"step 0: validation loss {history.data['val'][-1][1]:.4f} (untrained)")
    t_run = time.perf_counter()
    try:
        finished = run.loop()     # False: came back after the others had finished
        if finished:
            run.wait_for_rejoin()
        manager.close()
    finally:
        if run.progress is not None:
            run.progress.close()
    if not finished:
        return history.data
    run.meter.take_window()
    run.meter.total.rss_mib, run.meter.total.state_mib = peak_rss_mib(), state_mib(par.model, opt)
    totals = gather_windows(run.meter.total)
    h = history.data
    h["wall_s"], h["layout"] = time.perf_counter() - t_run, str(par.layout)
    h["ft"]["report"] = asdict(manager.report)
    text = _sample(eval_par, data, cfg)
    if run.talks:
        table = breakdown_table(totals, "per-rank time over the run, replica "
                                       f"{manager.replica_id} (the cross-replica reduction "
                                       "counts as compute):") if totals[0].steps else []
        report.finish(cfg, par, h, totals, text, run.start,
                      lines=summary_lines(cfg, par, h, run.start, size) + table)
    return h


def _header(run: _Run, incarnation: int) -> None:
    cfg, m = run.cfg, run.manager
    print(f"train_gpt: {cfg.strategy} --fault-tolerant ({run.par.layout}): {m.num_replicas} "
          f"replicas of {m.replica_size} process(es) over '{dist.get_backend()}'"
          + (f"; incarnation {incarnation} of replica {m.replica_id}: rejoining" if incarnation
             else ""), flush=True)
    print(f"batch: {cfg.batch_size} x {cfg.block_size} tokens per step, split over the live "
          f"replicas; {cfg.steps} steps", flush=True)
    if cfg.kill_random and not incarnation:
        victim, at = kill_plan(cfg.seed, cfg.steps, m.num_replicas)
        print(f"--kill-random: replica {victim} will SIGKILL itself in step {at + 1}", flush=True)


class _Run:
    """One process's training loop and its bookkeeping of failures and rejoins."""

    def __init__(self, cfg: TrainConfig, par: Parallel, eval_par: Parallel, opt: Any,
                 data: TextData, manager: ft.Manager, history: History) -> None:
        self.cfg, self.par, self.eval_par, self.opt, self.data = cfg, par, eval_par, opt, data
        self.manager, self.history = manager, history
        self.talks = int(os.environ["RANK"]) == 0
        self.meter = StepMeter()
        self.progress: Progress | None = None
        self.start = 0
        self.kill = (kill_plan(cfg.seed, cfg.steps, manager.num_replicas) if cfg.kill_random
                     and os.environ.get("RINGLET_REPLICA_RESTART", "0") == "0" else None)
        self._lost_seen = 0

    def say(self, line: str) -> None:
        if self.talks:
            self.progress.write(line) if self.progress is not None else print(line, flush=True)

    def loop(self) -> bool:
        """Steps until ``cfg.steps`` are committed; False if this replica came back after the
        others had finished (nothing left to do)."""
        m, cfg = self.manager, self.cfg
        while m.current_step < cfg.steps:
            t0 = time.perf_counter()
            if not self._quorum():
                return False
            if m.current_step >= cfg.steps:      # healed after the last step
                break
            self.meter.start()
            loss = self._step(m.current_step)
            self.meter.stop()
            if loss is not None:
                self._after(m.current_step - 1, loss, time.perf_counter() - t0)
        return True

    def _quorum(self) -> bool:
        heals = self.manager.report.heals_received
        try:
            self.manager.start_quorum()
        except ft.JobFinished as done:
            print(f"train_gpt: replica {self.manager.replica_id}: {done}", flush=True)
            return False
        if self.progress is None or self.manager.report.heals_received != heals:
            self.start = self.manager.current_step
            self.progress = Progress(self.cfg.steps, self.start,
                                     self.cfg.batch_size * self.cfg.block_size, self.cfg.progress,
                                     self.cfg.log_every, enabled=self.talks)
        self._membership(self.manager.current_step + 1)
        return True

    def _step(self, step: int) -> float | None:
        """Train step ``step`` (0-based); the loss averaged over the live replicas, or None if
        the step was not committed here."""
        cfg, par, m = self.cfg, self.par, self.manager
        t = time.perf_counter()
        x, y = self.data.batch("train", cfg.seed * 1_000_003 + step, cfg.batch_size)
        self.meter.data(time.perf_counter() - t)
        total = 0.0
        for micro in range(cfg.grad_accum):
            rows = _rows(par, cfg, micro)
            with par.no_sync() if micro < cfg.grad_accum - 1 else contextlib.nullcontext():
                loss = loss_of(par, x[rows], y[rows]) / cfg.grad_accum
                loss.backward()
            total += loss.item()
        if self.kill is not None and self.kill == (m.replica_id, step) and m.position == 0:
            print(f"train_gpt: --kill-random: replica {m.replica_id} (rank "
                  f"{os.environ['RANK']}) SIGKILLs itself in step {step + 1}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        carrier = torch.zeros(1)       # the loss travels with the gradients: averaged alike
        carrier.grad = torch.tensor([total])
        m.allreduce_gradients([*par.model.parameters(), carrier])
        self._membership(step + 1)
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(par.model.parameters(), cfg.grad_clip)
        committed = m.should_commit()
        if committed:
            for group in self.opt.param_groups:
                group["lr"] = lr_at(cfg, step)
            self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(carrier.grad.item()) if committed else None

    def _membership(self, step: int) -> None:
        """Record (and say) replicas lost or back since the last look; ``step`` is 1-based."""
        ftd, now = self.history.data["ft"], self.manager.participants()
        before = ftd["members"]
        if before:
            for r in sorted(set(before) - set(now)):
                ftd["failures"].append({"replica": r, "step": step, "time": time.time()})
                self.say(f"step {step}: replica {r} lost; replicas {now} finish the step "
                         "without it and go on (its rows of the batch are left out)")
            for r in sorted(set(now) - set(before)):
                fail = next((f for f in reversed(ftd["failures"]) if f["replica"] == r), None)
                after = time.time() - fail["time"] if fail else None
                ftd["rejoins"].append({"replica": r, "step": step - 1, "after_s": after})
                self.say(f"step {step - 1}: replica {r} rejoined after this step (healed from a "
                         "live replica)" + (f", {after:.1f} s after its failure in step "
                                           f"{fail['step']}" if fail else ""))
        ftd["members"] = now

    def _after(self, step: int, loss: float, seconds: float) -> None:
        """Bookkeeping, progress, evaluation and checkpoints after committed step ``step``."""
        cfg, h, m = self.cfg, self.history.data, self.manager
        done = step + 1
        if dist.get_world_size() > 1:     # hsdp: the replica's processes hold parts of the batch
            loss = _world_mean([loss])[0]
        h["train_loss"].append(loss)
        h["step_s"].append(seconds)
        h["ft"]["lost_shares"] += m.report.lost_micro_batches - self._lost_seen
        self._lost_seen = m.report.lost_micro_batches
        for fail in h["ft"]["failures"]:
            if fail["step"] == done and "step_s" not in fail:
                fail["step_s"] = seconds
                median = statistics.median(h["step_s"])
                self.say(f"step {done}: the step with the failure took {seconds:.2f} s against "
                         f"a median step of {median:.3f} s: the survivors stalled "
                         f"{max(0.0, seconds - median):.2f} s")
        assert self.progress is not None, "the first quorum makes the progress view"
        self.progress.update(step, loss)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            h["val"].append([done, evaluate(self.eval_par, self.data, cfg)])
            self.say(f"step {done}: validation loss {h['val'][-1][1]:.4f}")
        if (done % cfg.checkpoint_every == 0 or done == cfg.steps) \
                and m.participants()[0] == m.replica_id:
            path = checkpoint.save(cfg.out, done, self.eval_par.model, self.opt,
                                   {"config": asdict(cfg), "history": h,
                                    "run_id": os.environ.get("TORCHELASTIC_RUN_ID", "")})
            self.say(f"step {done}: checkpoint {path} (written by replica {m.replica_id})")

    def wait_for_rejoin(self) -> None:
        """At the end, wait up to ``cfg.rejoin_wait`` s for restarted replicas, so that the job
        ends with every replica holding the final state (each round admits and heals joiners)."""
        m = self.manager
        deadline = time.monotonic() + self.cfg.rejoin_wait
        missing = sorted(set(range(m.num_replicas)) - set(m.participants()))
        if missing:
            self.say(f"step {m.current_step}: done; waiting up to {self.cfg.rejoin_wait:.0f} s "
                     f"(--rejoin-wait) for replica(s) {missing} to rejoin")
        while m.num_participants() < m.num_replicas and time.monotonic() < deadline:
            time.sleep(0.2)
            m.start_quorum()
            self._membership(m.current_step + 1)


def summary_lines(cfg: TrainConfig, par: Parallel, h: dict[str, Any], start: int,
                  size: int) -> list[str]:
    """The summary: training, then what the failures cost."""
    ftd, losses, n = h["ft"], h["train_loss"], len(h["ft"]["members"]) or 1
    tokens = (cfg.steps - start) * cfg.batch_size * cfg.block_size
    lines = [(f"== summary: {cfg.strategy} --fault-tolerant ({par.layout}), {n} replica(s) of "
              f"{size} process(es) at the end =="),
             (f"trained steps {start + 1}-{cfg.steps} here ({tokens / 1e6:.2f}M tokens) in "
              f"{h['wall_s']:.1f} s" if start < cfg.steps else
              f"this process rejoined after the last step {start}: it trained none itself"),
             f"training loss {losses[0]:.3f} (step 1) -> {losses[-1]:.3f} (step {len(losses)})"]
    if h["val"]:
        lines.append("validation loss " + ", ".join(f"{v:.3f} (step {s})" for s, v in h["val"]))
    median = statistics.median(h["step_s"]) if h["step_s"] else 0.0
    lines.append(f"fault tolerance: {len(ftd['failures'])} failure(s), {len(ftd['rejoins'])} "
                 f"rejoin(s), {ftd['lost_shares']} replica share(s) of a step's batch lost "
                 f"(median step {median:.3f} s)")
    for f in ftd["failures"]:
        took = f.get("step_s")
        lines.append(f"  replica {f['replica']} failed in step {f['step']}"
                     + (f": that step took {took:.2f} s, the survivors stalled "
                        f"{max(0.0, took - median):.2f} s" if took is not None else ""))
    gone = sorted(set(range(par.layout.dp // size)) - set(ftd["members"]))
    if gone:
        lines.append(f"  replica(s) {gone} had not rejoined by the end (--rejoin-wait "
                     f"{cfg.rejoin_wait:g} s); a restarted one that comes later finds the job done")
    for r in ftd["rejoins"]:
        lines.append(f"  replica {r['replica']} rejoined after step {r['step']}"
                     + (f", {r['after_s']:.1f} s after its failure" if r["after_s"] is not None
                        else ""))
    if ftd["lost_shares"]:
        share = cfg.batch_size // (par.layout.dp // size)
        lines.append(f"  lost: {ftd['lost_shares']} x {share} sequences of the global batches left "
                     "out of committed steps (never trained on)")
    return lines
