"""The training loop: one function, ``train(cfg)``, that every rank runs.

Data: each step draws one global batch from the step number alone; gradient accumulation
splits it into ``grad_accum`` micro-batches and every data-parallel rank trains on its own
rows of each.  So the losses depend on the seed and the batch, not on the strategy or the
number of ranks.  The learning rate is a function of the step (warm-up, then cosine), which
is all a resumed run needs besides the model and optimizer state.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.nn.functional as F

import ringlet.distributed as dist

from . import checkpoint, report, resume
from .data import TextData
from .model import GPT, GPTConfig, generate
from .observe import Progress, StepMeter, breakdown_table, gather_windows, peak_rss_mib, state_mib
from .strategies import Parallel, default_layout, parallelize


@dataclass(kw_only=True)
class TrainConfig:
    """Everything a run depends on (the command-line flags of ``train_gpt.py``)."""

    strategy: str = "ddp"
    tp: int | None = None            # tensor-parallel degree of the 2-d strategies
    replicate: int | None = None     # HSDP: number of replica groups
    steps: int = 2000
    batch_size: int = 32             # sequences per step, all ranks together
    grad_accum: int = 1
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    lr: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    grad_clip: float = 0.0           # clip_grad_norm_ (ddp, fsdp, hsdp only); 0: off
    seed: int = 1337
    bf16: bool = False
    data: str | None = None
    data_bytes: int = 2 << 20
    eval_every: int = 250
    eval_batches: int = 8
    checkpoint_every: int = 500
    out: str = "runs/gpt"
    resume: bool = False
    sample_tokens: int = 200
    log_every: int = 50
    breakdown_every: int = 500
    progress: str = "auto"           # auto | bar | lines | off
    plot: bool = True
    fault_tolerant: bool = False     # replicas drop out and rejoin (gpt/fault_tolerant.py)
    kill_random: bool = False        # --fault-tolerant demo: one replica SIGKILLs itself once
    rejoin_wait: float = 120.0       # --fault-tolerant: seconds to wait at the end for a rejoin


def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warm-up to ``cfg.lr``, then a cosine down to a tenth of it at the last step."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def _rows(par: Parallel, cfg: TrainConfig, micro: int) -> slice:
    """This rank's rows of micro-batch ``micro`` of a global batch."""
    per_micro = cfg.batch_size // cfg.grad_accum
    per_rank = per_micro // par.layout.dp
    start = micro * per_micro + par.dp_rank * per_rank
    return slice(start, start + per_rank)


def loss_of(par: Parallel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    with par.autocast():
        logits = par.model(x)
    return F.cross_entropy(logits.float().flatten(0, 1), y.flatten())


def train_step(par: Parallel, opt: torch.optim.Optimizer, data: TextData, cfg: TrainConfig,
               step: int, meter: StepMeter) -> float:
    """One optimizer step over the global batch of ``step``; returns this rank's mean loss."""
    t = time.perf_counter()
    x, y = data.batch("train", cfg.seed * 1_000_003 + step, cfg.batch_size)
    meter.data(time.perf_counter() - t)
    total = 0.0
    for micro in range(cfg.grad_accum):
        rows = _rows(par, cfg, micro)
        last = micro == cfg.grad_accum - 1
        sync = contextlib.nullcontext() if last else par.no_sync()   # communicate on the last only
        with sync, par.loss_parallel():
            loss = loss_of(par, x[rows], y[rows]) / cfg.grad_accum
            loss.backward()
        total += loss.item()
    if cfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(par.model.parameters(), cfg.grad_clip)
    for group in opt.param_groups:
        group["lr"] = lr_at(cfg, step)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


@torch.no_grad()
def evaluate(par: Parallel, data: TextData, cfg: TrainConfig) -> float:
    """Mean loss on ``eval_batches`` fixed global batches of held-out text (every rank calls it)."""
    par.model.eval()
    total = 0.0
    for i in range(cfg.eval_batches):
        x, y = data.batch("val", cfg.seed + 7919 * (i + 1), cfg.batch_size)
        for micro in range(cfg.grad_accum):
            rows = _rows(par, cfg, micro)
            with par.loss_parallel():
                total += loss_of(par, x[rows], y[rows]).item()
    par.model.train()
    return _world_mean([total / (cfg.eval_batches * cfg.grad_accum)])[0]


def _world_mean(values: list[float]) -> list[float]:
    """Average each value over all ranks (tensor-parallel ranks hold equal copies)."""
    t = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return (t / dist.get_world_size()).tolist()


def check_config(cfg: TrainConfig, dp: int, tp: int) -> None:
    if cfg.grad_clip > 0 and tp > 1:
        # Under TP some parameters are DTensors and some plain (and DDP hands DDP+TP's to the
        # optimizer as local shards): clip_grad_norm_ would see only this rank's pieces.
        raise ValueError("--grad-clip: expected 0 with tensor parallelism (--strategy "
                         f"{cfg.strategy}), got {cfg.grad_clip}")
    for flag in ("steps", "grad_accum", "eval_every", "eval_batches", "checkpoint_every",
                 "log_every", "breakdown_every"):
        if getattr(cfg, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')}: expected >= 1, got {getattr(cfg, flag)}")
    if cfg.batch_size % (cfg.grad_accum * dp):
        raise ValueError(f"--batch-size: expected a multiple of grad_accum x data-parallel ranks = "
                         f"{cfg.grad_accum} x {dp}, got {cfg.batch_size}")


def build(cfg: TrainConfig) -> tuple[Parallel, torch.optim.Optimizer, TextData]:
    """The data, the model spread over the ranks, and its optimizer."""
    layout = default_layout(cfg.strategy, dist.get_world_size(), cfg.tp, cfg.replicate)
    check_config(cfg, layout.dp, layout.tp)
    data = TextData.load(cfg.data, cfg.block_size, cfg.data_bytes)
    model = new_model(cfg)                  # the same initial weights on every rank
    par = parallelize(model, layout, cfg.bf16)
    return par, optimizer_for(par.model, cfg), data


def new_model(cfg: TrainConfig) -> GPT:
    """The model with ``cfg.seed``'s initial weights (the same on every rank)."""
    torch.manual_seed(cfg.seed)
    return GPT(GPTConfig(block_size=cfg.block_size, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd))


def optimizer_for(model: torch.nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (not on norms' gains and biases), as GPT-2 and
    most LLMs do."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.95))


def train(cfg: TrainConfig, argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Train; returns the history (losses per step, evaluations, per-rank time totals).

    Raises ``resume.RunRefused`` on every rank, before anything is written, when ``--out`` holds
    a checkpoint that ``--resume`` and ``--steps`` do not fit (see ``resume.py``).  ``argv``, the
    command line (``sys.argv``), gives the resume command printed if the run stops early.
    """
    path = resume.start_point(cfg)
    par, opt, data = build(cfg)
    rank = dist.get_rank()
    history: dict[str, Any] = {"train_loss": [], "val": []}
    start = 0
    if path is not None:
        state = checkpoint.load(path, par.model, opt)
        start, history = state["step"], state["history"]
    progress = Progress(cfg.steps, start, cfg.batch_size * cfg.block_size, cfg.progress,
                        cfg.log_every, enabled=rank == 0)
    if rank == 0:
        report.print_header(progress.write, cfg, par, data, start)
    meter = StepMeter()
    t_run = time.perf_counter()
    try:
        with resume.report_stop(cfg, argv):
            if start == 0:
                history["val"].append([0, evaluate(par, data, cfg)])
                progress.write(f"step 0: validation loss {history['val'][-1][1]:.4f} (untrained)")
            _loop(par, opt, data, cfg, start, history, progress, meter)
    finally:
        progress.close()
    meter.take_window()
    meter.total.rss_mib, meter.total.state_mib = peak_rss_mib(), state_mib(par.model, opt)
    totals = gather_windows(meter.total)
    history["wall_s"] = time.perf_counter() - t_run
    history["layout"] = str(par.layout)
    text = _sample(par, data, cfg)
    if rank == 0:
        report.finish(cfg, par, history, totals, text, start)
    return history


def _loop(par: Parallel, opt: torch.optim.Optimizer, data: TextData, cfg: TrainConfig, start: int,
          history: dict[str, Any], progress: Progress, meter: StepMeter) -> None:
    """Steps ``start`` to ``cfg.steps``: logging, evaluation, breakdowns and checkpoints."""
    pending: list[float] = []
    for step in range(start, cfg.steps):
        meter.start()
        pending.append(train_step(par, opt, data, cfg, step, meter))
        meter.stop()
        done = step + 1
        reduced = None
        if (done % 10 == 0 or done % cfg.log_every == 0 or done % cfg.checkpoint_every == 0
                or done == cfg.steps):
            history["train_loss"] += _world_mean(pending)    # one all-reduce per log interval
            pending, reduced = [], history["train_loss"][-1]
        progress.update(step, reduced)
        if done % cfg.eval_every == 0 or done == cfg.steps:
            history["val"].append([done, evaluate(par, data, cfg)])
            progress.write(f"step {done}: validation loss {history['val'][-1][1]:.4f}")
        if done % cfg.breakdown_every == 0 and done < cfg.steps:
            windows = gather_windows(meter.take_window())
            for line in breakdown_table(windows,
                                        "per-rank time, steps "
                                        f"{done - windows[0].steps + 1}-{done}:"):
                progress.write(line)
        if done % cfg.checkpoint_every == 0 or done == cfg.steps:
            path = checkpoint.save(cfg.out, done, par.model, opt,
                                   {"config": asdict(cfg), "history": history})
            progress.write(f"step {done}: checkpoint {path}")


def _sample(par: Parallel, data: TextData, cfg: TrainConfig) -> str:
    """A short continuation of a held-out prompt, the same on every rank."""
    if cfg.sample_tokens <= 0:
        return ""
    prompt = data.val[: cfg.block_size // 2].long()
    model = par.raw if par.layout.strategy in ("ddp", "ddp+tp") else par.model
    model.eval()
    with par.autocast():
        new = generate(model, prompt, cfg.sample_tokens, cfg.block_size, seed=cfg.seed)
    model.train()
    return bytes(prompt.tolist() + new.tolist()).decode("utf-8", errors="replace")
