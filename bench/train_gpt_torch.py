"""The main job against torch's stack: ``examples/train_gpt.py``'s model, batch and steps under
ringlet and under torch's own DDP / FSDP2 / tensor parallel (gloo), side by side.

Usage::

    python bench/train_gpt_torch.py [--ranks 2] [--strategies ddp,fsdp,hsdp,tp,fsdp+tp,ddp+tp]
        [--steps 30] [--warmup 5] [--rounds 2] [--bf16] [--tiny] [--markdown out.md]
        [--batch-size 32] [--block-size 64] [--n-layer 4] [--n-head 4] [--n-embd 128]
        [--op-timeout 300] [--timeout S]

``--ranks`` processes (forkserver, one torch thread each) join a ringlet default group (shm,
as ``ringlet-run`` gives the trainer) and a torch gloo group.  For each strategy both stacks
build the trainer's model from the same seed (ringlet's through the trainer's own ``build``,
torch's through ``bench/_torch_gpt.py``, the same layout spelled with ``torch.distributed``),
and every iteration runs one step of each -- ``gpt.trainer.train_step``: the trainer's batch,
forward, loss, backward, learning-rate schedule, ``AdamW.step()`` and ``zero_grad`` -- in
alternating order, each started after its library's barrier.  A step's time is the slowest
rank's; tokens/s is ``batch_size x block_size`` over the median step; "ringlet / torch" is the
median of the per-iteration ratios of tokens/s (above 1: ringlet is faster).  "max |dloss|" is
the largest difference between the two stacks' losses on the same step (they train the same
model on the same batches, so it is float rounding).  ``--tiny`` is a smoke run (a 1-block
model of width 32, 3 steps) for CI.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common as common

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "ddp+tp")
_MODEL_FLAGS = ("batch_size", "block_size", "n_layer", "n_head", "n_embd")
_TINY = {"batch_size": 4, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 32}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int
    strategies: tuple[str, ...]
    steps: int
    warmup: int
    rounds: int
    bf16: bool
    model: dict[str, int]
    data_bytes: int
    op_timeout: float
    timeout: float
    markdown: str | None = None

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"expected --ranks >= 2, got {self.ranks}")
        common.names(",".join(self.strategies), "--strategies", STRATEGIES)
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError(f"expected --steps >= 1, --warmup >= 0, --rounds >= 1, got "
                             f"{self.steps}, {self.warmup}, {self.rounds}")

    @property
    def tokens_per_step(self) -> int:
        return self.model["batch_size"] * self.model["block_size"]


def parse_args(argv: Sequence[str] | None = None) -> Config:
    from gpt.trainer import TrainConfig

    d = TrainConfig()
    p = common.parser(__doc__, op_timeout=300.0)
    p.add_argument("--strategies", default=",".join(STRATEGIES))
    p.add_argument("--steps", type=int, default=30, help="timed iterations per round")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--bf16", action="store_true", help="the trainer's --bf16 on both stacks")
    for flag in _MODEL_FLAGS:
        p.add_argument(f"--{flag.replace('_', '-')}", type=int, default=getattr(d, flag))
    p.add_argument("--tiny", action="store_true",
                   help="smoke run: 1 block of width 32, batch 4 x 16, 1 warm-up + 2 steps")
    return common.parse(p, argv, lambda a: _config(a, d.data_bytes))


def _config(a: argparse.Namespace, data_bytes: int) -> Config:
    model = {flag: getattr(a, flag) for flag in _MODEL_FLAGS}
    steps, warmup, rounds = a.steps, a.warmup, a.rounds
    if a.tiny:
        model, steps, warmup, rounds, data_bytes = dict(_TINY), 2, 1, 1, 64 << 10
    strategies = common.names(a.strategies, "--strategies", STRATEGIES)
    timeout = (120.0 + 20.0 * len(strategies) * rounds * (steps + warmup) if a.timeout is None
               else a.timeout)
    return Config(ranks=a.ranks, strategies=strategies, steps=steps, warmup=warmup,
                  rounds=rounds, bf16=a.bf16, model=model, data_bytes=data_bytes,
                  op_timeout=a.op_timeout, timeout=timeout, markdown=a.markdown)


# ---------------------------------------------------------------- in each rank


def _stacks(cfg: Config, strategy: str) -> dict[str, tuple[Any, Any, Callable[[], None]]]:
    """Per stack: the trainer's ``Parallel``, its optimizer and its barrier; and the data."""
    import _torch_gpt
    import torch.distributed as tdist
    from gpt.strategies import default_layout
    from gpt.trainer import build

    import ringlet.distributed as rdist

    tc = _train_config(cfg, strategy)
    par, opt, data = build(tc)                                  # ringlet: the trainer's own
    layout = default_layout(strategy, tdist.get_world_size(), tc.tp, tc.replicate)
    model = _torch_gpt.build_model(tc.seed, tc.block_size, tc.n_layer, tc.n_head, tc.n_embd)
    tpar = _torch_gpt.parallelize(model, layout, tc.bf16)
    topt = _torch_gpt.make_optimizer(tpar.model, tc.lr, tc.weight_decay)
    return {"ringlet": (par, opt, rdist.barrier), "torch": (tpar, topt, tdist.barrier),
            "data": data, "config": tc}


def _train_config(cfg: Config, strategy: str) -> Any:
    from gpt.trainer import TrainConfig

    return TrainConfig(strategy=strategy, steps=cfg.rounds * (cfg.warmup + cfg.steps),
                       bf16=cfg.bf16, data_bytes=cfg.data_bytes, progress="off", plot=False,
                       **cfg.model)


def _bench_strategy(cfg: Config, strategy: str) -> dict[str, Any]:
    import torch
    import torch.distributed as tdist
    from gpt.observe import StepMeter
    from gpt.trainer import train_step

    s = _stacks(cfg, strategy)
    data, tc = s["data"], s["config"]
    times: dict[str, list[float]] = {"ringlet": [], "torch": []}
    losses: dict[str, list[float]] = {"ringlet": [], "torch": []}
    step = 0
    for rnd in range(cfg.rounds):
        for i in range(cfg.warmup + cfg.steps):
            order = ("ringlet", "torch") if (i + rnd) % 2 == 0 else ("torch", "ringlet")
            for lib in order:
                par, opt, barrier = s[lib]
                barrier()
                t0 = time.perf_counter()
                loss = train_step(par, opt, data, tc, step, StepMeter())
                dt = time.perf_counter() - t0
                losses[lib].append(loss)
                if i >= cfg.warmup:
                    times[lib].append(dt)
            step += 1
    worst = torch.tensor([times["ringlet"], times["torch"]], dtype=torch.float64)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)              # each step: the slowest rank
    ours, theirs = worst[0].tolist(), worst[1].tolist()
    dloss = max(abs(a - b) for a, b in zip(losses["ringlet"], losses["torch"], strict=True))
    return {"strategy": strategy, "layout": str(s["ringlet"][0].layout),
            "ringlet": common.median(ours), "torch": common.median(theirs),
            "ratio": common.median([b / a for a, b in zip(ours, theirs, strict=True)]),
            "dloss": dloss, "loss": losses["ringlet"][-1]}


def _rank_main(rank: int, n: int, cfg: Config, gloo_init: str) -> list[dict[str, Any]]:
    with common.gloo_group(gloo_init, rank, n, cfg.op_timeout):
        out = []
        for strategy in cfg.strategies:
            res = _bench_strategy(cfg, strategy)
            if rank == 0:
                print(f"  {strategy:<8} ringlet {cfg.tokens_per_step / res['ringlet']:8.0f} tok/s"
                      f"  torch {cfg.tokens_per_step / res['torch']:8.0f} tok/s  ringlet/torch "
                      f"{res['ratio']:.3f}x", file=sys.stderr, flush=True)
            out.append(res)
        return out


# ---------------------------------------------------------------- report


def render(cfg: Config, results: list[dict[str, Any]], markdown: bool) -> str:
    table = common.markdown_table if markdown else common.text_table
    tok = cfg.tokens_per_step
    rows = [[r["strategy"], r["layout"], f"{r['ringlet'] * 1e3:.1f}", f"{r['torch'] * 1e3:.1f}",
             f"{tok / r['ringlet'] / 1e3:.1f}k", f"{tok / r['torch'] / 1e3:.1f}k",
             f"{r['ratio']:.2f}x", f"{r['dloss']:.1e}"] for r in results]
    head = ["strategy", "mesh", "ringlet step ms", "torch step ms", "ringlet tokens/s",
            "torch tokens/s", "ringlet / torch", "max |dloss|"]
    title = ("### train_gpt: ringlet vs torch" if markdown
             else f"== train_gpt ({cfg.ranks} ranks) ==")
    return "\n".join([title, "", table(head, rows), ""])


def preamble(cfg: Config, info: dict[str, str], markdown: bool) -> str:
    setup = (f"setup: {cfg.ranks} ranks x 1 torch thread, ringlet shm vs torch gloo, model "
             f"{cfg.model}{', bf16' if cfg.bf16 else ''}, AdamW; {cfg.warmup} warm-up + "
             f"{cfg.steps} timed iterations x {cfg.rounds} rounds, stacks alternating")
    return common.preamble("train_gpt: ringlet vs torch", [setup], info, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run_and_report(parse_args(argv), _rank_main, render, preamble)


if __name__ == "__main__":
    sys.exit(main())
