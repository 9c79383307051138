"""torch's own stack over backend "ringlet" against torch's gloo and against ringlet's own API.

Usage::

    python bench/torch_backend.py [--ranks 2] [--sizes 8,64K,1M,16M] [--rounds 3]
        [--width 256] [--depth 16] [--batch 64] [--steps 100] [--markdown out.md]

Two tables, every figure measured in the same processes, phases alternating per round:

- collectives: ``dist.all_reduce`` latency per size through torch's API on gloo, through torch's
  API on ``"ringlet"``, and through ringlet's own API on the same ringlet group (the difference
  of the last two is what the crossing adds: torch's Python API, its C++ trampoline, the
  adapter); the slowest rank's median call;
- steps: torch's DDP and ``fully_shard`` on gloo and on ``"ringlet"`` against ringlet's own DDP and
  ``fully_shard`` on an MLP of ``--depth`` Linear(``--width``) + ReLU layers, batch ``--batch``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from datetime import timedelta
from typing import Any

import _common as common
import torch
from torch import nn

STEP_MODES = ("torch ddp [gloo]", "torch ddp [ringlet]", "ringlet ddp",
              "torch fully_shard [gloo]", "torch fully_shard [ringlet]", "ringlet fully_shard")


def _init(backend: str, path: str, rank: int, n: int) -> None:
    import torch.distributed as tdist

    import ringlet  # noqa: F401  (registers "ringlet")

    tdist.init_process_group(backend, init_method=f"file://{path}.{backend}", rank=rank,
                             world_size=n, timeout=timedelta(seconds=120))


def _finish() -> None:
    import torch.distributed as tdist

    tdist.barrier()
    time.sleep(0.2)     # let gloo's threads drop their last work before the group goes
    tdist.destroy_process_group()


def _timed(fn: Any, calls: int) -> float:
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - t0) / calls)
    return common.median(samples)


def collectives(rank: int, n: int, path: str, sizes: list[int]) -> dict[str, list[float]]:
    """Seconds per all_reduce for each size: torch on gloo, torch on ringlet, ringlet's API."""
    import torch.distributed as tdist

    import ringlet.c10d as rc

    torch.set_num_threads(1)
    out: dict[str, list[float]] = {"torch [gloo]": [], "torch [ringlet]": [], "ringlet api": []}
    for backend in ("gloo", "ringlet"):
        _init(backend, path, rank, n)
        for nbytes in sizes:
            t = torch.ones(max(1, nbytes // 4))
            calls = max(5, min(2000, (64 << 20) // max(nbytes, 1) // 4))
            for _ in range(3):
                tdist.all_reduce(t)
            tdist.barrier()
            out[f"torch [{backend}]"].append(_timed(lambda t=t: tdist.all_reduce(t), calls))
            if backend == "ringlet":
                rg = tdist.group.WORLD.ringlet_group
                tdist.barrier()
                out["ringlet api"].append(_timed(lambda t=t, rg=rg: rc.all_reduce(t, group=rg),
                                                 calls))
        _finish()
    return out


def _model(cfg: dict[str, int]) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg["depth"]):
        layers += [nn.Linear(cfg["width"], cfg["width"]), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(cfg["width"], 4))


def _wrap(model: nn.Module, mode: str) -> nn.Module:
    if mode.startswith("torch"):
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel
    else:
        from ringlet.distributed.fsdp import fully_shard
        from ringlet.nn.parallel import DistributedDataParallel
    if " ddp" in mode:
        return DistributedDataParallel(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def steps(rank: int, n: int, path: str, mode: str, cfg: dict[str, int]) -> float:
    """Median seconds per training step of ``mode``."""
    torch.set_num_threads(1)
    torch_backend = mode.split("[")[1].rstrip("]") if "[" in mode else None
    if torch_backend:
        _init(torch_backend, path, rank, n)
    model = _wrap(_model(cfg), mode)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(cfg["batch"], cfg["width"]), torch.randn(cfg["batch"], 4)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(10):
        step()
    took = _timed(step, max(1, cfg["steps"] // 5))
    if torch_backend:
        del model, opt
        _finish()
    return took


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__)
    p.add_argument("--sizes", default="8,64K,1M,16M")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--skip-steps", action="store_true", help="only the collectives table")
    a = p.parse_args(argv)
    sizes = [common.parse_size(s) for s in a.sizes.split(",")]
    cfg = {"width": a.width, "depth": a.depth, "batch": a.batch, "steps": a.steps}
    lat: dict[str, list[list[float]]] = {}
    st: dict[str, list[float]] = {m: [] for m in STEP_MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            per_rank = common.run_ranks(a.ranks, collectives, os.path.join(tmp, f"c{r}"), sizes,
                                        backend="shm", timeout=600, op_timeout=120)
            for key in per_rank[0]:
                slowest = [max(v[key][i] for v in per_rank) for i in range(len(sizes))]
                lat.setdefault(key, []).append(slowest)
            print(f"  round {r + 1}/{a.rounds} collectives done", flush=True)
            order = STEP_MODES if r % 2 == 0 else STEP_MODES[::-1]
            for i, mode in enumerate(() if a.skip_steps else order):
                got = common.run_ranks(a.ranks, steps, os.path.join(tmp, f"s{r}-{i}"), mode, cfg,
                                       backend="shm", timeout=600, op_timeout=120)
                st[mode].append(max(got))
                print(f"  round {r + 1}/{a.rounds} {mode}: {st[mode][-1] * 1e3:.3f} ms/step",
                      flush=True)
    med = {k: [common.median([rnd[i] for rnd in v]) for i in range(len(sizes))]
           for k, v in lat.items()}
    step = {m: common.median(v) for m, v in st.items() if v}

    def render(md: bool) -> str:
        table = common.markdown_table if md else common.text_table
        rows = [[common.format_size(s), f"{med['torch [gloo]'][i] * 1e6:.1f}",
                 f"{med['torch [ringlet]'][i] * 1e6:.1f}", f"{med['ringlet api'][i] * 1e6:.1f}",
                 f"{med['torch [gloo]'][i] / med['torch [ringlet]'][i]:.2f}",
                 f"{(med['torch [ringlet]'][i] - med['ringlet api'][i]) * 1e6:+.1f}"]
                for i, s in enumerate(sizes)]
        out = table(["all_reduce", "torch on gloo us", "torch on ringlet us", "ringlet api us",
                     "gloo / ringlet", "crossing us"], rows)
        if step:
            srows = []
            for m in STEP_MODES:
                kind = "ddp" if " ddp" in m else "fully_shard"
                own, gloo = step[f"ringlet {kind}"], step[f"torch {kind} [gloo]"]
                srows.append([m, f"{step[m] * 1e3:.3f}", f"{step[m] / gloo:.3f}",
                              f"{step[m] / own:.3f}"])
            out += "\n\n" + table(["step", "ms/step", "vs torch on gloo", "vs ringlet's own"],
                                  srows)
        return out

    line = common.provenance(f"{a.ranks} rank(s), all_reduce sizes {a.sizes}; MLP {a.depth} x "
                             f"{a.width}, batch {a.batch}")
    print(line)
    common.emit(render, lambda md: line, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
