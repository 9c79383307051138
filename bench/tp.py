"""Tensor-parallel benchmark: ringlet TP against torch TP (gloo) on one Llama-like model, plus the
DTensor per-op dispatch cost, in one run.

Usage::

    python bench/tp.py [--ranks 2] [--plans tp+sp,tp] [--steps 10] [--warmup 3] [--rounds 2]
        [--ops-only] [--quick] [--markdown out.md] [--op-timeout 300] [--timeout S]

**Training step.** ``--ranks`` processes (forkserver, one torch thread each) join a ringlet
default group (shm) and a torch gloo group (file:// rendezvous).  Model: the Llama-like
transformer of ``tests/_tp_models.py`` (token embedding, 4 pre-norm blocks of RMSNorm,
attention with rotary embedding and causal SDPA, SwiGLU feed-forward; d=256, 8 heads,
hidden 768, vocab 4096, seq 128, 5.5 M parameters), batch 4 sequences, AdamW.
Plans are torchtitan's (``tests/_tp_workers.py``): ``tp+sp`` -- column-wise q/k/v and gate/up,
row-wise o/down, row-wise embedding, sequence-parallel norms, vocab-sharded head and
``loss_parallel``; ``tp`` -- the same without sequence parallelism (norms stay plain tensors,
replicated logits, plain cross-entropy, AdamW without foreach: the optimizer sees DTensor and
plain parameters).  Both libraries get the same plan from the same code (only the import
differs) and the same initial values.  A step is forward, loss, backward, ``opt.step()`` and
``zero_grad()``, started together after a barrier; every timed iteration runs one ringlet and
one torch step, in alternating order, so both share the machine's noise.  A step's time is the
slowest rank's; reported times are medians over ``--steps`` x ``--rounds`` iterations (after
``--warmup``); "ringlet / torch" is the median of the per-iteration ratios (below 1: ringlet
is faster).  "local" is the bare model on one rank with the batch of one rank (no
parallelism, for scale: TP splits the model's compute, not the batch).

**Dispatch.** One process, one rank (a 1-rank mesh each: ringlet inproc, torch gloo), 64x64
float32: ``a + b`` (both ``Shard(0)``), ``a @ w`` (``Shard(0)`` @ ``Replicate``), ``a.mul_(1.0)``
and the same ops on plain tensors; each is timed in batches of 3000 calls after a warm-up,
7 batches per op and library, interleaved; the median batch's mean per call is reported.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import _common as common
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

PLANS = ("tp+sp", "tp")
MODEL = {"vocab": 4096, "d": 256, "heads": 8, "hidden": 768, "layers": 4, "seq": 128}
BATCH = 4
OPS = ("a + b", "a @ w", "a.mul_(1.0)")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int
    plans: tuple[str, ...]
    steps: int
    warmup: int
    rounds: int
    ops_only: bool
    op_timeout: float
    timeout: float
    markdown: str | None = None

    def __post_init__(self) -> None:
        if self.ranks < 2:
            raise ValueError(f"expected --ranks >= 2, got {self.ranks}")
        bad = [p for p in self.plans if p not in PLANS]
        if bad or not self.plans:
            raise ValueError(f"expected --plans from {','.join(PLANS)}, got "
                             f"{','.join(self.plans)!r}")
        if self.steps < 1 or self.warmup < 0 or self.rounds < 1:
            raise ValueError(f"expected --steps >= 1, --warmup >= 0, --rounds >= 1, got "
                             f"{self.steps}, {self.warmup}, {self.rounds}")


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = common.parser(__doc__, op_timeout=300.0)
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--steps", type=int, default=10, help="timed iterations per round")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--ops-only", action="store_true", help="only the dispatch table")
    p.add_argument("--quick", action="store_true", help="tp+sp only, 3 steps, 1 round")
    return common.parse(p, argv, _config)


def _config(a: argparse.Namespace) -> Config:
    plans = common.names(a.plans, "--plans", PLANS)
    steps, rounds = a.steps, a.rounds
    if a.quick:
        plans, steps, rounds = ("tp+sp",), 3, 1
    timeout = (120.0 + 10.0 * len(plans) * rounds * (steps + a.warmup) if a.timeout is None
               else a.timeout)
    return Config(ranks=a.ranks, plans=plans, steps=steps, warmup=a.warmup, rounds=rounds,
                  ops_only=a.ops_only, op_timeout=a.op_timeout, timeout=timeout,
                  markdown=a.markdown)


# ---------------------------------------------------------------- training steps (in each rank)


def _libraries() -> dict[str, Any]:
    """Per library: the TP module (torch's or ringlet's, same names), Replicate/Shard and the
    mesh."""
    import torch.distributed.tensor as tdt
    import torch.distributed.tensor.parallel as ttp
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    import ringlet.distributed.tensor as rdt
    import ringlet.distributed.tensor.parallel as rtp
    from ringlet.distributed.device_mesh import init_device_mesh as r_mesh

    return {"ringlet": (rtp, rdt, r_mesh), "torch": (ttp, tdt, t_mesh)}


def _plan(tp: Any, dt: Any, sp: bool) -> dict[str, Any]:
    """torchtitan's plan, spelled with one library's classes (as tests/_tp_workers.llama_plan)."""
    seq = dt.Shard(1) if sp else dt.Replicate()
    plan = {"tok_embeddings": tp.RowwiseParallel(input_layouts=dt.Replicate(), output_layouts=seq),
            "output": tp.ColwiseParallel(input_layouts=seq,
                                         output_layouts=dt.Shard(-1) if sp else dt.Replicate(),
                                         use_local_output=not sp)}
    plan["layers.*.attention"] = tp.PrepareModuleInput(input_layouts=(seq, None, None),
                                                       desired_input_layouts=(dt.Replicate(),
                                                                              None, None))
    plan["layers.*.feed_forward"] = (tp.PrepareModuleInput(
        input_layouts=(seq,), desired_input_layouts=(dt.Replicate(),)))
    for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1",
                 "feed_forward.w3"):
        plan[f"layers.*.{name}"] = tp.ColwiseParallel()
    for name in ("attention.wo", "feed_forward.w2"):
        plan[f"layers.*.{name}"] = tp.RowwiseParallel(output_layouts=seq)
    if sp:
        for name in ("layers.*.attention_norm", "layers.*.ffn_norm", "norm"):
            plan[name] = tp.SequenceParallel()
    return plan


class _Runner:
    """One library's parallelized model, optimizer and batch; ``step()`` times one training step."""

    def __init__(self, lib: str, plan: str, rank: int, n: int) -> None:
        import torch.nn.functional as F
        from _tp_models import Llama, init_

        tp, dt, make_mesh = _libraries()[lib]
        self.sp = plan == "tp+sp"
        self.lib, self.tp = lib, tp
        model = init_(Llama(**MODEL))
        self.model = model if lib == "local" else tp.parallelize_module(
            model, make_mesh("cpu", (n,)), _plan(tp, dt, self.sp))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4, foreach=self.sp)
        g = torch.Generator().manual_seed(1)
        toks = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1), generator=g)
        self.x, self.y = toks[:, :-1], toks[:, 1:]
        self.ce = F.cross_entropy

    def step(self, barrier: Callable[[], None]) -> float:
        barrier()
        t0 = time.perf_counter()
        with self.tp.loss_parallel() if self.sp else contextlib.nullcontext():
            loss = self.ce(self.model(self.x).flatten(0, 1), self.y.flatten())
            loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return time.perf_counter() - t0


def _local_step_s(steps: int) -> float:
    """The bare model's step on one rank (same batch), for scale."""
    import torch.nn.functional as F
    from _tp_models import Llama, init_

    model = init_(Llama(**MODEL))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    toks = torch.randint(0, MODEL["vocab"], (BATCH, MODEL["seq"] + 1),
                         generator=torch.Generator().manual_seed(1))
    times = []
    for _ in range(steps + 2):
        t0 = time.perf_counter()
        F.cross_entropy(model(toks[:, :-1]).flatten(0, 1), toks[:, 1:].flatten()).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    return common.median(times[2:])


def _bench_plan(cfg: Config, plan: str, rank: int, n: int) -> dict[str, Any]:
    import torch.distributed as tdist

    import ringlet.distributed as rdist

    runners = {lib: _Runner(lib, plan, rank, n) for lib in ("ringlet", "torch")}
    barriers = {"ringlet": rdist.barrier, "torch": tdist.barrier}
    times: dict[str, list[float]] = {"ringlet": [], "torch": []}
    for rnd in range(cfg.rounds):
        for i in range(cfg.warmup + cfg.steps):
            order = ("ringlet", "torch") if (i + rnd) % 2 == 0 else ("torch", "ringlet")
            for lib in order:
                t = runners[lib].step(barriers[lib])
                if i >= cfg.warmup:
                    times[lib].append(t)
    worst = torch.tensor([times["ringlet"], times["torch"]], dtype=torch.float64)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)                 # each step: the slowest rank
    ours, theirs = worst[0].tolist(), worst[1].tolist()
    return {"plan": plan, "ringlet": common.median(ours), "torch": common.median(theirs),
            "ratio": common.median([a / b for a, b in zip(ours, theirs)]),
            "params": sum(p.numel() for p in runners["torch"].model.parameters())}


def _rank_main(rank: int, n: int, cfg: Config, gloo_init: str) -> dict[str, Any]:
    with common.gloo_group(gloo_init, rank, n, cfg.op_timeout) as tdist:
        out: dict[str, Any] = {"plans": []}
        for plan in cfg.plans:
            res = _bench_plan(cfg, plan, rank, n)
            if rank == 0:
                print(f"  {plan:<6} ringlet {res['ringlet'] * 1e3:7.1f} ms  torch "
                      f"{res['torch'] * 1e3:7.1f} ms  ratio "
                      f"{res['ratio']:.3f}", file=sys.stderr, flush=True)
            out["plans"].append(res)
        tdist.barrier()
        if rank == 0:
            out["local"] = _local_step_s(cfg.steps)
        return out


# ---------------------------------------------------------------- dispatch cost (one process)


def _timeit(fn: Callable[[], Any], n: int = 3000) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n


def _op_table(operands: dict[str, tuple[Any, Any, Any]]) -> dict[str, dict[str, float]]:
    """Median per-call seconds of each op for each library's operands (a, b, w), interleaved."""
    fns = {lib: {"a + b": (lambda a=a, b=b: a + b), "a @ w": (lambda a=a, w=w: a @ w),
                 "a.mul_(1.0)": (lambda a=a: a.mul_(1.0))} for lib, (a, b, w) in operands.items()}
    samples: dict[str, dict[str, list[float]]] = {lib: {op: [] for op in OPS} for lib in fns}
    for lib in fns:
        for op in OPS:
            _timeit(fns[lib][op], 300)                            # warm-up (and the dispatch cache)
    for _ in range(7):
        for op in OPS:
            for lib in fns:
                samples[lib][op].append(_timeit(fns[lib][op]))
    return {lib: {op: common.median(v) for op, v in per.items()} for lib, per in samples.items()}


def dispatch_table() -> dict[str, dict[str, float]]:
    import torch.distributed as tdist
    import torch.distributed.tensor as tdt
    from torch.distributed.device_mesh import init_device_mesh as t_mesh

    from ringlet.testing import run_threads

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    x, y, z = (torch.randn(64, 64, generator=g) for _ in range(3))
    tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)
    try:
        tm = t_mesh("cpu", (1,))
        theirs = (tdt.distribute_tensor(x, tm, [tdt.Shard(0)]),
                  tdt.distribute_tensor(y, tm, [tdt.Shard(0)]),
                  tdt.distribute_tensor(z, tm, [tdt.Replicate()]))

        def body(rank: int, n: int) -> dict[str, dict[str, float]]:
            from ringlet.distributed.device_mesh import init_device_mesh
            from ringlet.distributed.tensor import Replicate, Shard, distribute_tensor

            mesh = init_device_mesh("cpu", (1,))
            ours = (distribute_tensor(x, mesh, [Shard(0)]), distribute_tensor(y, mesh, [Shard(0)]),
                    distribute_tensor(z, mesh, [Replicate()]))
            return _op_table({"ringlet": ours, "torch": theirs, "plain": (x.clone(), y, z)})
        return run_threads(body, 1, timeout=300)[0]
    finally:
        tdist.destroy_process_group()


# ---------------------------------------------------------------- report


def render(cfg: Config, results: dict[str, Any], markdown: bool) -> str:
    table = common.markdown_table if markdown else common.text_table
    parts = []
    if results.get("plans"):
        local = results["local"]
        rows = [[r["plan"], f"{r['ringlet'] * 1e3:.1f}", f"{r['torch'] * 1e3:.1f}",
                 f"{r['ratio']:.3f}x"]
                for r in results["plans"]]
        rows.append(["local (1 rank, no TP)", f"{local * 1e3:.1f}", "", ""])
        parts += ["### Training step" if markdown
                  else f"== TP training step ({cfg.ranks} ranks) ==", "",
                  table(["plan", "ringlet ms", "torch ms", "ringlet / torch"], rows), ""]
    ops = results["ops"]
    rows = [[op, f"{ops['ringlet'][op] * 1e6:.1f}", f"{ops['torch'][op] * 1e6:.1f}",
             f"{ops['plain'][op] * 1e6:.1f}", f"{ops['ringlet'][op] / ops['torch'][op]:.2f}x"]
            for op in OPS]
    parts += ["### DTensor dispatch (1 rank, 64x64 float32)" if markdown
              else "== DTensor dispatch ==", "",
              table(["op", "ringlet us", "torch us", "plain tensor us", "ringlet / torch"], rows),
              ""]
    return "\n".join(parts)


def preamble(cfg: Config, info: dict[str, str], markdown: bool) -> str:
    setup = (f"setup: {cfg.ranks} ranks x 1 torch thread, ringlet shm vs torch gloo, model "
             f"{MODEL}, batch {BATCH}, AdamW; {cfg.warmup} warm-up + {cfg.steps} timed iterations "
             f"x {cfg.rounds} rounds")
    return common.preamble("ringlet tensor-parallel benchmark", [setup], info, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    info = common.machine_info()
    print(preamble(cfg, info, markdown=False), flush=True)
    results: dict[str, Any] = {}
    if not cfg.ops_only:
        values = common.run_beside_gloo(cfg.ranks, _rank_main, cfg, backend="shm",
                                        timeout=cfg.timeout, op_timeout=cfg.op_timeout)
        if values is None:
            return 1
        results = values[0]
    results["ops"] = dispatch_table()
    common.emit(lambda md: render(cfg, results, markdown=md),
                lambda md: preamble(cfg, info, markdown=md), cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
