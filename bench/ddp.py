"""DDP benchmark: ringlet's DistributedDataParallel against torch's (gloo), in one run.

Usage::

    python bench/ddp.py [--ranks 2] [--models mlp,wide,gpt] [--steps 8] [--warmup 2] [--rounds 2]
        [--caps 1,5,25,100] [--quick] [--loader-workers N [--loader-ms 100]] [--optimizer sgd]
        [--markdown out.md]
        [--op-timeout 300] [--timeout S]

``--ranks`` processes (forkserver, one torch thread each) join a ringlet default group (shm)
and a torch gloo group (file:// rendezvous).  Models (``bench/_models.py``): (a) mlp: 4 x
Linear(2500, 2500), batch 32 per rank, AdamW; (b) wide: Linear 2048 -> 4096 -> 2048 -> 4096,
batch 16 per rank, SGD -- the same 25 M parameters in three large gradients, with far less
compute per gradient byte (the communication-heavy case); (c) gpt: 4 pre-LN blocks, d=384, 6
heads, seq 128, vocab 4096, batch 8 per rank, AdamW.  A step is forward, backward, the
optimizer's ``step()`` and ``zero_grad()``, started together after a barrier.  Modes:

- ``ringlet``: ringlet DDP with ``gradient_as_bucket_view=True`` (bucket_cap_mb 25);
- ``ringlet copy``: ringlet DDP with default options;
- ``torch``: torch's DDP on gloo, default options;
- ``packed cap=N``: the bucket_cap_mb sweep (``--caps``): ringlet DDP with bucket views but
  torch's bucket layout (large gradients packed with their neighbours, no solo buckets), where
  the cap matters -- and which shows what reducing large gradients in place saves;
- ``no-sync``: the same model without communication: a step on ``ddp.module`` (DDP's hooks
  stay idle unless DDP's own forward ran, in both libraries).

Each mode has its own model (same seed) and optimizer.  The main modes are timed
together: every timed iteration runs, for each mode in rotating order, one no-sync step and one
synchronised step, so each mode and its own no-sync baseline share the machine's noise (the
ratios hold on a busy machine; absolute times do not).  Each sweep cap is timed the same way on
its own.  After ``--warmup`` iterations, ``--steps`` are timed per round, ``--rounds`` rounds.
A step's time is the slowest rank's; reported times are medians.  samples/s = ranks x per-rank
batch / step time.  Ratios are paired, then the median taken: "vs no-sync" = each synchronised
step / the no-sync step run next to it (same mode); "vs torch" = each step / torch DDP's step of
the same iteration (below 1: faster than torch); the no-sync row pools the main modes' no-sync
steps.

``--loader-workers N``: each rank draws every step's batch from a ``torch.utils.data.DataLoader``
with ``num_workers=N`` (inside the timed step), as a training job does; each batch costs its
worker ``--loader-ms`` of CPU time (decoding, augmenting), so the workers compete with the ranks
for the cores.  Without it every step reuses one batch made up front.

Overlap, from the reducer's own statistics (``reducer.last_stats``) of each synchronised step:
"done in bwd" = share of the gradient bytes whose all-reduce had finished when backward ended
(communication hidden behind backward); "end of bwd" = time from the end of backward to the
gradients being in ``.grad`` (launching the rest, waiting, copying); "exposed" = the
synchronised step minus the no-sync step run next to it (median of the pairs): what
communication costs the step.  For scale, the ``ringlet`` mode's bucket sizes are also
all-reduced back to back with no compute (median of 5).

Floor: when every core runs a rank (2 ranks on 2 cores), the communication thread has no core
of its own, so the reduction's CPU time cannot hide behind backward: the least a synchronised
step can cost is the no-sync step plus the copies of the gradients into shared memory and their
all-reduces.  The ``no overlap`` mode measures exactly that, side by side with the others: a
no-sync step whose backward is followed by, for each gradient in turn, a copy into a
``comm_buffer`` and its all-reduce (DDP's op), on the main thread, with no DDP and no overlap;
``.grad`` then holds the average.  "vs floor" = each step / the ``no overlap`` step of the same
iteration (median).  "CPU vs no-sync" = the process's CPU time (all its threads) in each
synchronised step / in the no-sync step next to it (the slowest rank's, median): what the
step costs the machine, which other jobs' load moves far less than wall time.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common as common
import _loader
import _models as models
import torch

MODELS = ("mlp", "wide", "gpt")
BATCH = {"mlp": 32, "wide": 16, "gpt": 8}
OPTIMIZER = {"mlp": "adamw", "wide": "sgd", "gpt": "adamw"}
MAIN_CAP = 25
NO_OVERLAP = "no overlap"
MAIN_MODES = ("ringlet", "ringlet copy", "torch", NO_OVERLAP)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int
    models: tuple[str, ...]
    steps: int
    warmup: int
    rounds: int
    caps: tuple[float, ...]
    op_timeout: float
    timeout: float
    markdown: str | None = None
    loader_workers: int = 0     # DataLoader(num_workers=...) per rank; 0: one fixed batch
    loader_ms: float = 100.0    # CPU milliseconds a worker spends on one batch
    optimizer: str = ""         # "sgd" or "adamw" for every model; "": each model's own

    def __post_init__(self) -> None:
        if self.loader_workers < 0 or self.loader_ms < 0:
            raise ValueError(f"expected --loader-workers >= 0 and --loader-ms >= 0, got "
                             f"{self.loader_workers}, {self.loader_ms}")
        if self.ranks < 1:
            raise ValueError(f"expected --ranks >= 1, got {self.ranks}")
        bad = [m for m in self.models if m not in MODELS]
        if bad or not self.models:
            raise ValueError(f"expected --models from {','.join(MODELS)}, got "
                             f"{','.join(self.models)!r}")
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError(f"expected --steps >= 1, --warmup >= 0, --rounds >= 1, got "
                             f"{self.steps}, {self.warmup}, {self.rounds}")
        if self.optimizer not in ("", "sgd", "adamw"):
            raise ValueError(f"expected --optimizer sgd or adamw, got {self.optimizer!r}")
        if any(c <= 0 for c in self.caps):
            raise ValueError(f"expected positive --caps, got {self.caps}")


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = common.parser(__doc__, op_timeout=300.0)
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--caps", default="1,5,25,100", help="bucket_cap_mb sweep (MiB)")
    p.add_argument("--quick", action="store_true", help="MLP only, 3 steps, 1 round, no sweep")
    p.add_argument("--loader-workers", type=int, default=0, metavar="N",
                   help="draw each step's batch from a DataLoader with N worker processes per rank")
    p.add_argument("--loader-ms", type=float, default=100.0,
                   help="with --loader-workers: CPU ms a worker spends making one batch")
    p.add_argument("--optimizer", default="",
                   help="sgd or adamw for every model (default: each model's own)")
    return common.parse(p, argv, _config)


def _config(a: argparse.Namespace) -> Config:
    names = common.names(a.models, "--models", MODELS)
    caps = tuple(float(c) for c in a.caps.split(",") if c.strip())
    steps, rounds = a.steps, a.rounds
    if a.quick:
        names, caps, steps, rounds = ("mlp",), (), 3, 1
    n_modes = len(MAIN_MODES) + len(caps)
    timeout = 120.0 + 2 * 12.0 * len(names) * n_modes * rounds * (steps + a.warmup) \
        if a.timeout is None else a.timeout
    return Config(ranks=a.ranks, models=names, steps=steps, warmup=a.warmup, rounds=rounds,
                  caps=caps, op_timeout=a.op_timeout, timeout=timeout, markdown=a.markdown,
                  loader_workers=a.loader_workers, loader_ms=a.loader_ms, optimizer=a.optimizer)


# ---------------------------------------------------------------- in each rank


def _build(name: str) -> tuple[torch.nn.Module, Callable[..., torch.Tensor]]:
    torch.manual_seed(0)
    if name == "mlp":
        return models.mlp(), models.mlp_loss
    if name == "wide":
        return models.wide_mlp(), models.mlp_loss
    return models.GPT(), models.gpt_loss


def _make_batch(name: str, seed: int) -> Any:
    if name == "mlp":
        return models.mlp_batch(BATCH[name], seed=seed)
    if name == "wide":
        return models.wide_batch(BATCH[name], seed=seed)
    return models.gpt_batch(BATCH[name], seed=seed)


def optimizer_of(cfg: Config, name: str) -> str:
    """The optimizer model ``name`` trains with: ``--optimizer``, else the model's own."""
    return cfg.optimizer or OPTIMIZER[name]


def _optimizer(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=1e-4)
    return torch.optim.AdamW(params, lr=1e-4)


def _wrap(mode: str, module: torch.nn.Module) -> torch.nn.Module:
    if mode == NO_OVERLAP:
        return module
    if mode == "torch":
        from torch.nn.parallel import DistributedDataParallel as TorchDDP

        return TorchDDP(module)
    from ringlet.nn.parallel import DistributedDataParallel as DDP

    if mode == "ringlet copy":
        return DDP(module)
    cap = float(mode.split("=")[1]) if "cap=" in mode else MAIN_CAP
    ddp = DDP(module, gradient_as_bucket_view=True, bucket_cap_mb=cap)
    if mode.startswith("packed"):
        # torch's layout: large gradients packed with their neighbours (no solo buckets), to
        # show what the cap does and what reducing large gradients in place saves.
        layout = ddp.reducer.layout
        layout.solo_bytes = 1 << 62
        layout.install(list(range(len(layout.params) - 1, -1, -1)))
    return ddp


class SerialReduction:
    """The floor's reduction: after backward, each gradient in turn is copied into a shared
    buffer of its own and all-reduced there (each rank's gradient times 1/world size, summed, as
    DDP does), on the calling thread; ``.grad`` then is that buffer."""

    def __init__(self, module: torch.nn.Module) -> None:
        import ringlet.distributed as rdist

        self.params = [p for p in module.parameters() if p.requires_grad][::-1]
        self.bufs = [rdist.comm_buffer(p.numel(), p.dtype).view(p.shape) for p in self.params]
        self.op = rdist._make_nccl_premul_sum(1.0 / rdist.get_world_size())

    def reduce(self) -> None:
        import ringlet.distributed as rdist

        for p, buf in zip(self.params, self.bufs):
            if p.grad is None:
                raise RuntimeError("no overlap: expected every parameter to have a gradient")
            if p.grad is not buf:
                buf.copy_(p.grad)
            rdist.all_reduce(buf, op=self.op)
            p.grad = buf


class _Runner:
    """One model and optimizer; steps either through the DDP wrapper or on the bare module.

    A step on the bare module is a no-sync step: DDP's hooks stay idle unless DDP's own forward
    ran (both libraries), so the same parameters, gradients and optimizer state serve both.
    """

    def __init__(self, name: str, mode: str, batches: Callable[[], Any], optimizer: str) -> None:
        self.mode = mode
        self.plain, self.loss_fn = _build(name)
        self.batches = batches
        self.model = _wrap(mode, self.plain)
        self.opt = _optimizer(optimizer, self.model.parameters())
        self.serial = SerialReduction(self.plain) if mode == NO_OVERLAP else None
        # per synced step: share done in backward, finalize s
        self.stats: list[tuple[float, float]] = []

    def step(self, synced: bool) -> tuple[float, float]:
        """One step; returns its wall seconds and this process's CPU seconds (all threads)."""
        import ringlet.distributed as rdist

        rdist.barrier()
        c0 = time.process_time()
        t0 = time.perf_counter()
        batch = self.batches()
        self.loss_fn(self.model if synced else self.plain, batch).backward()
        if synced and self.serial is not None:
            self.serial.reduce()
        self.opt.step()
        self.opt.zero_grad()
        dt = time.perf_counter() - t0
        cpu = time.process_time() - c0
        stats = getattr(getattr(self.model, "reducer", None), "last_stats", None)
        if synced and stats is not None:
            self.stats.append((stats.bytes_done_in_backward / max(1, stats.bytes),
                               stats.finalize_s))
        return dt, cpu


def _interleaved(cfg: Config, name: str, modes: list[str],
                 batches: Callable[[], Any]) -> dict[str, dict[str, Any]]:
    """Time ``modes`` together: each timed iteration runs a no-sync and a synced step of every mode.

    Interleaving puts every mode and its own no-sync baseline under the same machine noise, so the
    ratios hold even on a busy machine.  Times are the slowest rank's.
    """
    import torch.distributed as tdist

    runners = [_Runner(name, m, batches, optimizer_of(cfg, name)) for m in modes]
    for _ in range(cfg.warmup):
        for r in runners:
            r.step(False), r.step(True)
    keys = ("plain", "ddp", "plain_cpu", "ddp_cpu")
    times: dict[str, dict[str, list[float]]] = {m: {k: [] for k in keys} for m in modes}
    for i in range(cfg.steps):
        for k in range(len(runners)):
            r = runners[(i + k) % len(runners)]
            for synced in ((False, True) if i % 2 == 0 else (True, False)):
                wall, cpu = r.step(synced)
                times[r.mode]["ddp" if synced else "plain"].append(wall)
                times[r.mode]["ddp_cpu" if synced else "plain_cpu"].append(cpu)
    out: dict[str, dict[str, Any]] = {}
    for r in runners:
        worst = torch.tensor([times[r.mode][k] for k in keys], dtype=torch.float64)
        tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)          # each step: the slowest rank
        out[r.mode] = dict(zip(keys, worst.tolist()))
        reducer = getattr(r.model, "reducer", None)
        if reducer is not None and hasattr(reducer, "layout"):
            out[r.mode]["buckets"] = len(reducer.layout.plans)
            timed = r.stats[cfg.warmup:]
            out[r.mode]["done_share"] = common.median([d for d, _ in timed])
            out[r.mode]["finalize"] = common.median([f for _, f in timed])
            if r.mode == "ringlet":
                bufs = [_bucket_like(p.numel, p.dtype) for p in reducer.layout.plans]  # same sizes
                comm = torch.tensor([_comm_alone(bufs)], dtype=torch.float64)
                tdist.all_reduce(comm, op=tdist.ReduceOp.MAX)
                out[r.mode]["comm"] = comm.item()
    return out


def _bucket_like(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A buffer where ringlet's DDP keeps its buckets (shared memory on shm: ``comm_buffer``)."""
    import ringlet.distributed as rdist

    return rdist.comm_buffer(numel, dtype).zero_()


def _comm_alone(bufs: list[torch.Tensor]) -> float:
    """Seconds to all-reduce the bucket buffers back to back with nothing else running (median of
    5)."""
    import ringlet.distributed as rdist

    op = rdist._make_nccl_premul_sum(1.0 / rdist.get_world_size())   # DDP's own reduction
    samples = []
    for _ in range(6):
        rdist.barrier()
        t0 = time.perf_counter()
        works = [rdist.all_reduce(b, op=op, async_op=True) for b in bufs]
        for w in works:
            if w is not None:
                w.wait()
        samples.append(time.perf_counter() - t0)
    return common.median(samples[1:])


def _rank_main(rank: int, n: int, cfg: Config, gloo_init: str) -> list[dict[str, Any]]:
    with common.gloo_group(gloo_init, rank, n, cfg.op_timeout):
        return [_bench_model(cfg, name, rank) for name in cfg.models]


def _bench_model(cfg: Config, name: str, rank: int) -> dict[str, Any]:
    """The main modes together, then each bucket cap of the sweep with its own no-sync steps."""
    groups = [MAIN_MODES] + [[f"packed cap={c:g}"] for c in cfg.caps]
    merged: dict[str, dict[str, Any]] = {}
    make = functools.partial(_make_batch, name)
    batches, close = _loader.batch_source(make, rank, cfg.loader_workers, cfg.loader_ms)
    try:
        for rnd in range(cfg.rounds):
            for group in groups if rnd % 2 == 0 else groups[::-1]:
                _run_group(cfg, name, list(group), rank, rnd, batches, merged)
    finally:
        close()
    return _summarize(name, merged)


def _run_group(cfg: Config, name: str, group: list[str], rank: int, rnd: int,
               batches: Callable[[], Any], merged: dict[str, dict[str, Any]]) -> None:
    """One round of ``group``'s modes, merged into ``merged`` (mode -> samples and stats)."""
    for mode, res in _interleaved(cfg, name, group, batches).items():
        m = merged.setdefault(mode, {"plain": [], "ddp": [], "plain_cpu": [], "ddp_cpu": []})
        for key in ("plain", "ddp", "plain_cpu", "ddp_cpu"):
            m[key] += res.pop(key)
        m.update(res)
        if rank == 0:
            print(f"  {name:<4} {mode:<16} round {rnd}: no-sync "
                  f"{common.median(m['plain']) * 1e3:8.1f} ms  synced "
                  f"{common.median(m['ddp']) * 1e3:8.1f} ms", file=sys.stderr, flush=True)


def _summarize(name: str, merged: dict[str, dict[str, Any]]) -> dict[str, Any]:
    for m in merged.values():
        m["plain_s"], m["ddp_s"] = common.median(m["plain"]), common.median(m["ddp"])
        # Paired ratios: each synced step against the no-sync step run right next to it.
        m["vs_nosync"] = common.median([d / p for d, p in zip(m["ddp"], m["plain"])])
        # CPU seconds of the process (all its threads), which other jobs' load hardly moves.
        m["cpu_vs_nosync"] = paired_ratio(m["ddp_cpu"], m["plain_cpu"])
        m["exposed"] = common.median([d - p for d, p in zip(m["ddp"], m["plain"])])
    torch_steps = merged["torch"]["ddp"]
    for mode in MAIN_MODES:      # same iteration, seconds apart: paired against torch's step
        merged[mode]["vs_torch"] = common.median(
            [d / t for d, t in zip(merged[mode]["ddp"], torch_steps)])
    plain = [t for mode in MAIN_MODES for t in merged[mode]["plain"]]
    nosync_vs_torch = common.median([p / t for mode in MAIN_MODES
                                     for p, t in zip(merged[mode]["plain"], torch_steps)])
    for mode in MAIN_MODES:
        merged[mode]["vs_floor"] = paired_ratio(merged[mode]["ddp"], merged[NO_OVERLAP]["ddp"])
    return {"model": name, "modes": merged, "nosync": common.median(plain),
            "nosync_vs_torch": nosync_vs_torch}


def paired_ratio(steps: list[float], refs: list[float]) -> float:
    """The median of ``steps[i] / refs[i]`` (steps of the same iteration, seconds apart)."""
    if len(steps) != len(refs) or not steps:
        raise ValueError(f"paired_ratio: expected as many reference steps as steps, got "
                         f"{len(refs)} for {len(steps)}")
    return common.median([s / r for s, r in zip(steps, refs)])


# ---------------------------------------------------------------- report


def _rows(cfg: Config, r: dict[str, Any]) -> list[list[str]]:
    modes, batch = r["modes"], cfg.ranks * BATCH[r["model"]]
    rows = [["no-sync", f"{r['nosync'] * 1e3:.1f}", f"{batch / r['nosync']:.1f}", "1.000x",
             f"{r['nosync_vs_torch']:.3f}x"]]
    rows[0] += ["", "1.000x"]
    for mode in MAIN_MODES:
        m = modes[mode]
        rows.append([mode + (" (floor)" if mode == NO_OVERLAP else ""), f"{m['ddp_s'] * 1e3:.1f}",
                     f"{batch / m['ddp_s']:.1f}", f"{m['vs_nosync']:.3f}x",
                     f"{m['vs_torch']:.3f}x", f"{m['vs_floor']:.3f}x",
                     f"{m['cpu_vs_nosync']:.3f}x"])
    return rows


def _sweep_rows(cfg: Config, r: dict[str, Any]) -> list[list[str]]:
    rows = []
    for mode in ["ringlet"] + [f"packed cap={c:g}" for c in cfg.caps]:
        m = r["modes"][mode]
        label = (f"{MAIN_CAP} (solo, default)" if mode == "ringlet"
                 else f"{mode.split('=')[1]} (packed)")
        rows.append([label, str(m.get("buckets", "?")), f"{m['ddp_s'] * 1e3:.1f}",
                     f"{m['plain_s'] * 1e3:.1f}",
                     f"{m['vs_nosync']:.3f}x", f"{m['done_share'] * 100:.0f}%",
                     f"{m['finalize'] * 1e3:.1f}", f"{m['exposed'] * 1e3:.1f}"])
    return rows


def _overlap(r: dict[str, Any]) -> str:
    m = r["modes"]["ringlet"]
    comm, exposed = m["comm"], m["exposed"]
    return (f"the buckets' all-reduces alone take {comm * 1e3:.1f} ms; in a ringlet step "
            f"{m['done_share'] * 100:.0f}% of the gradient bytes were already reduced when "
            "backward ended, and the end of backward (rest of the all-reduces, waits, writing "
            f".grad) took {m['finalize'] * 1e3:.1f} ms; exposed communication (synchronised step - "
            f"the no-sync step run next to it, median) = {exposed * 1e3:.1f} ms per step")


def render(cfg: Config, results: list[dict[str, Any]], markdown: bool) -> str:
    table = common.markdown_table if markdown else common.text_table
    parts = []
    for r in results:
        title = f"### {r['model']}" if markdown else f"== {r['model']} ({cfg.ranks} ranks) =="
        parts += [title, "",
                  table(["mode", "step ms", "samples/s", "vs no-sync", "vs torch", "vs floor",
                         "CPU vs no-sync"],
                        _rows(cfg, r)),
                  "", table(["bucket_cap_mb", "buckets", "step ms", "no-sync ms", "vs no-sync",
                         "done in bwd", "end of bwd ms", "exposed ms"], _sweep_rows(cfg, r)), "",
                  ("**Overlap:** " if markdown else "overlap: ") + _overlap(r), ""]
    return "\n".join(parts)


def preamble(cfg: Config, info: dict[str, str], markdown: bool) -> str:
    setup = [(f"setup: {cfg.ranks} ranks x 1 torch thread, ringlet shm vs torch gloo, "
              f"optimizer {', '.join(f'{m} {optimizer_of(cfg, m)}' for m in cfg.models)}, "
              f"{cfg.warmup} warm-up + {cfg.steps} timed steps x {cfg.rounds} rounds per mode; "
              f"step = median of the slowest rank's step times")]
    if cfg.loader_workers:
        setup.append("data: each rank draws every step's batch from a DataLoader(num_workers="
                     f"{cfg.loader_workers}); a worker spends {cfg.loader_ms:g} ms of CPU per "
                     "batch")
    return common.preamble("ringlet DDP benchmark", setup, info, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    return common.run_and_report(parse_args(argv), _rank_main, render, preamble)


if __name__ == "__main__":
    sys.exit(main())
