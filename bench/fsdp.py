"""fully_shard benchmark: ringlet's FSDP2 against torch's (gloo), step time and memory per rank.

Usage::

    python bench/fsdp.py [--ranks 2] [--steps 8] [--warmup 2] [--rounds 2] [--batch 8]
        [--modes local,ringlet,torch] [--markdown out.md] [--op-timeout 300] [--timeout S]

Run it as ``MALLOC_MMAP_THRESHOLD_=131072 python bench/fsdp.py`` so that freed memory goes
back to the OS and peak RSS means something (glibc otherwise keeps freed heap around).

Model: the GPT of ``bench/_models.py`` (4 pre-LN blocks, d=384, 6 heads, seq 128, vocab 4096,
10.3 M parameters), batch ``--batch`` sequences per rank, AdamW (lr 1e-4).  Modes:

- ``local``: the bare model on each rank, no sharding, no communication (the compute floor);
- ``ringlet``: ``ringlet.distributed.fsdp.fully_shard`` on every block, then on the root
  (default options: blocks reshard after forward, the root does not);
- ``torch``: ``torch.distributed.fsdp.fully_shard`` the same way, on gloo;
- ``ringlet-nopf`` / ``ringlet-pf2``: ringlet with no prefetch / prefetching two groups ahead
  (explicit ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch`` lists;
  the default prefetches one group ahead).

Every mode runs in its own world of ``--ranks`` processes (forkserver, one torch thread each,
a ringlet default group over shm; the torch mode also joins a gloo group), so that each
process's peak RSS belongs to one mode.  A world builds a fresh model (seed 0), runs
``--warmup`` untimed and ``--steps`` timed steps -- forward, backward, ``opt.step()``,
``opt.zero_grad()``, started together after a barrier -- and reports its step times.  A step's
time is the slowest rank's; a mode's time is the median over its timed steps of all
``--rounds`` rounds (rounds alternate the mode order so that modes share the machine's noise).

Memory per rank:

- logical bytes: after a step (before ``zero_grad``), the bytes of the distinct storages
  behind parameters, gradients and optimizer state (DTensors: their local tensors; padding
  of uneven shards included, 0-d step counters excluded).  "DDP" is the same count for the
  unsharded model (parameters, gradients and AdamW's two moments, all full size);
- peak RSS: the process's ``ru_maxrss`` at the end of its world (max over ranks).

"vs torch" = ringlet / torch (step time: below 1 is faster).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import resource
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

import _common as common
import _models as models
import torch

MODES = ("local", "ringlet", "torch", "ringlet-nopf", "ringlet-pf2")
PREFETCH = {"ringlet-nopf": 0, "ringlet-pf2": 2}   # groups prefetched ahead (default mode: 1)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int
    steps: int
    warmup: int
    rounds: int
    batch: int
    modes: tuple[str, ...]
    op_timeout: float
    timeout: float
    markdown: str | None = None

    def __post_init__(self) -> None:
        if self.ranks < 1:
            raise ValueError(f"expected --ranks >= 1, got {self.ranks}")
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1 or self.batch < 1:
            raise ValueError("expected --steps >= 1, --warmup >= 0, --rounds >= 1, --batch >= 1, "
                             f"got {self.steps}, {self.warmup}, {self.rounds}, {self.batch}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(f"expected --modes from {','.join(MODES)}, got "
                             f"{','.join(self.modes)!r}")


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = common.parser(__doc__, op_timeout=300.0)
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--modes", default=",".join(MODES))
    return common.parse(p, argv, _config)


def _config(a: argparse.Namespace) -> Config:
    """The run's configuration (``--timeout`` is the backstop of each world)."""
    timeout = 120.0 + 30.0 * (a.steps + a.warmup) if a.timeout is None else a.timeout
    return Config(ranks=a.ranks, steps=a.steps, warmup=a.warmup, rounds=a.rounds, batch=a.batch,
                  modes=common.names(a.modes, "--modes", MODES), op_timeout=a.op_timeout,
                  timeout=timeout, markdown=a.markdown)


# ---------------------------------------------------------------- in each rank


def _shard(mode: str, model: torch.nn.Module, n: int) -> None:
    if mode.startswith("ringlet"):
        from ringlet.distributed.fsdp import fully_shard
    elif mode == "torch":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard as torch_fully_shard

        mesh = init_device_mesh("cpu", (n,))

        def fully_shard(m: torch.nn.Module) -> Any:
            return torch_fully_shard(m, mesh=mesh)
    else:
        return
    for blk in model.blocks:  # type: ignore[attr-defined]
        fully_shard(blk)
    fully_shard(model)
    if mode in PREFETCH:
        _prefetch(model, PREFETCH[mode])


def _prefetch(model: Any, depth: int) -> None:
    """Explicit prefetch lists: each group starts the all-gathers of the ``depth`` groups that
    run after it (forward: the next blocks; backward: the previous ones)."""
    blocks = list(model.blocks)
    order = [model, *blocks]
    for i, m in enumerate(order):
        m.set_modules_to_forward_prefetch(order[i + 1:i + 1 + depth])
    back = [model, *blocks[::-1]]
    for i, m in enumerate(back):
        m.set_modules_to_backward_prefetch(back[i + 1:i + 1 + depth])


def logical_bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients and optimizer state."""
    seen: set[int] = set()
    total = 0

    def add(t: Any) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.dim() == 0:
            return
        st = local.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    for p in model.parameters():
        add(p)
        add(p.grad)
        for v in opt.state.get(p, {}).values():
            add(v)
    return total


def _rank_main(rank: int, n: int, cfg: Config, mode: str, gloo_init: str) -> dict[str, Any]:
    import ringlet.distributed as rdist

    torch.set_num_threads(1)
    torch_group = (common.gloo_group(gloo_init, rank, n, cfg.op_timeout) if mode == "torch"
                   else contextlib.nullcontext())
    with torch_group:
        torch.manual_seed(0)
        model = models.GPT()
        ddp_bytes = 4 * sum(p.numel() * p.element_size() for p in model.parameters())
        _shard(mode, model, n)
        batch = models.gpt_batch(cfg.batch, seed=rank)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        times, nbytes = [], 0
        for i in range(cfg.warmup + cfg.steps):
            rdist.barrier()
            t0 = time.perf_counter()
            models.gpt_loss(model, batch).backward()
            opt.step()
            if i == 0:
                nbytes = logical_bytes(model, opt)
            opt.zero_grad()
            if i >= cfg.warmup:
                times.append(time.perf_counter() - t0)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return {"times": times, "bytes": nbytes, "ddp_bytes": ddp_bytes, "rss": rss}


# ---------------------------------------------------------------- driver


def run(cfg: Config) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {m: {"times": [], "bytes": 0, "rss": 0, "ddp_bytes": 0}
                                      for m in cfg.modes}
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-fsdp-") as tmp:
        for rnd in range(cfg.rounds):
            for k, mode in enumerate(cfg.modes if rnd % 2 == 0 else cfg.modes[::-1]):
                init = f"file://{os.path.join(tmp, f'gloo-{rnd}-{k}')}"
                ranks = common.run_ranks(cfg.ranks, _rank_main, cfg, mode, init, backend="shm",
                                         timeout=cfg.timeout, op_timeout=cfg.op_timeout)
                res = out[mode]
                res["times"] += [max(steps) for steps in zip(*(r["times"] for r in ranks))]
                res["bytes"] = max(r["bytes"] for r in ranks)
                res["ddp_bytes"] = ranks[0]["ddp_bytes"]
                res["rss"] = max(res["rss"], max(r["rss"] for r in ranks))
                print(f"  round {rnd + 1}/{cfg.rounds} {mode}: median step "
                      f"{common.median(res['times'][-cfg.steps:]):.3f} s",
                      file=sys.stderr, flush=True)
    return out


def report(cfg: Config, out: dict[str, dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    headers = ["mode", "step (s)", "vs torch", "samples/s", "logical MiB/rank",
               "vs DDP", "vs torch", "peak RSS MiB"]
    torch_res = out.get("torch")
    rows = []
    for mode in cfg.modes:
        r = out[mode]
        step = common.median(r["times"])
        t_ratio = f"{step / common.median(torch_res['times']):.2f}" if torch_res else "-"
        b_ratio = (f"{r['bytes'] / torch_res['bytes']:.2f}"
                   if torch_res and torch_res["bytes"] else "-")
        rows.append([mode, f"{step:.3f}", t_ratio, f"{cfg.ranks * cfg.batch / step:.1f}",
                     f"{r['bytes'] / common.MIB:.1f}",
                     f"{r['bytes'] / r['ddp_bytes']:.3f}", b_ratio, f"{r['rss'] / common.MIB:.0f}"])
    return headers, rows


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    info = common.machine_info()
    print(f"fully_shard benchmark: {cfg.ranks} ranks x 1 thread, GPT (bench/_models.py), batch "
          f"{cfg.batch}/rank, AdamW; {cfg.warmup} warm-up + {cfg.steps} timed steps x {cfg.rounds} "
          "rounds", file=sys.stderr)
    out = run(cfg)
    headers, rows = report(cfg, out)
    print(common.text_table(headers, rows))
    if cfg.markdown:
        with open(cfg.markdown, "w") as f:
            f.write(f"Command: `{common.command_line()}`\n\n")
            f.write(", ".join(f"{k}: {v}" for k, v in info.items()) + "\n\n")
            f.write(common.markdown_table(headers, rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
