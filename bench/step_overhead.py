"""Per-step host overhead of DDP and fully_shard: ringlet against torch (gloo) on short steps.

Usage::

    python bench/step_overhead.py [--ranks 1] [--width 256] [--depth 16] [--batch 64]
        [--steps 200] [--rounds 3] [--markdown out.md]

A GPU step of a small model is short, so what each wrapper adds on the host per step (hooks,
bucket copies, launching collectives, waiting for them) decides its speed there; this measures
that on the CPU, where it can be measured, with a model whose step takes a few milliseconds: an
MLP of ``--depth`` Linear(``--width``) + ReLU layers, batch ``--batch``, SGD.  Modes:

- ``plain``: the bare model, no wrapper (the floor);
- ``ringlet ddp`` / ``torch ddp``: ``DistributedDataParallel`` (default options);
- ``ringlet fully_shard`` / ``torch fully_shard``: ``fully_shard`` on every Linear, then the root.

Each mode runs in its own world of ``--ranks`` processes (one torch thread each, ringlet's default
group over shm; the torch modes also join a gloo group), builds the model (seed 0), runs 20
untimed steps, then ``--steps`` timed steps in 5 chunks; its time is the median chunk's mean
step (the slowest rank's).  Rounds alternate the mode order; a mode's figure is the median over
rounds.  "overhead" = the mode's step minus ``plain``'s; "vs torch" = ringlet / torch.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import _common as common
import torch
from torch import nn

MODES = ("plain", "ringlet ddp", "torch ddp", "ringlet fully_shard", "torch fully_shard")


def _model(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def _wrap(model: nn.Module, mode: str, store: str, rank: int, n: int) -> nn.Module:
    if mode == "plain":
        return model
    if mode.startswith("torch"):
        import torch.distributed as tdist
        from torch.distributed.fsdp import fully_shard
        from torch.nn.parallel import DistributedDataParallel

        tdist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=n)
    else:
        from ringlet.distributed.fsdp import fully_shard
        from ringlet.nn.parallel import DistributedDataParallel
    if mode.endswith("ddp"):
        return DistributedDataParallel(model)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model


def measure(rank: int, n: int, mode: str, store: str, cfg: dict[str, int]) -> list[float]:
    """Mean seconds per step of each of 5 chunks of ``cfg["steps"] // 5`` steps."""
    torch.set_num_threads(1)
    model = _wrap(_model(cfg["width"], cfg["depth"]), mode, store, rank, n)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = torch.randn(cfg["batch"], cfg["width"]), torch.randn(cfg["batch"], 4)

    def step() -> None:
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    for _ in range(20):
        step()
    chunks = []
    per = max(1, cfg["steps"] // 5)
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(per):
            step()
        chunks.append((time.perf_counter() - t0) / per)
    if mode.startswith("torch"):
        import torch.distributed as tdist

        # torch's gloo can deadlock when its group is destroyed (here: when DDP's reducer is
        # freed) while a gloo worker thread still frees the last op's work, which takes the GIL;
        # seen as a rank hanging after its steps.  A barrier, then a pause without the GIL,
        # lets that thread finish first.
        tdist.barrier()
        time.sleep(0.2)
        del model, opt
        tdist.destroy_process_group()
    return chunks


def _checked(a: argparse.Namespace) -> argparse.Namespace:
    common.names(a.modes, "--modes", MODES)
    if min(a.ranks, a.width, a.depth, a.batch, a.steps, a.rounds) < 1:
        raise ValueError("expected every number >= 1")
    return a


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__, ranks=1)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=200, help="timed steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated, from the above")
    a = common.parse(p, argv, _checked)
    modes = common.names(a.modes, "--modes", MODES)
    cfg = {"width": a.width, "depth": a.depth, "batch": a.batch, "steps": a.steps}
    got: dict[str, list[float]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            order = modes if r % 2 == 0 else modes[::-1]
            for i, mode in enumerate(order):
                store = os.path.join(tmp, f"store-{r}-{i}")
                per_rank = common.run_ranks(a.ranks, measure, mode, store, cfg, backend="gloo",
                                     timeout=180, op_timeout=60)
                chunks = [max(c) for c in zip(*per_rank)]       # the slowest rank's
                got[mode].append(common.median(chunks))
                print(f"  round {r + 1}/{a.rounds} {mode}: {got[mode][-1] * 1e3:.3f} ms/step",
                      flush=True)
    step = {m: common.median(v) for m, v in got.items()}

    def render(md: bool) -> str:
        rows = []
        for m in modes:
            theirs = step.get("torch " + m.split(" ", 1)[1]) if m.startswith("ringlet") else None
            over = f"{(step[m] - step['plain']) * 1e3:+.3f}" if "plain" in step else ""
            rows.append([m, f"{step[m] * 1e3:.3f}", over,
                         f"{step[m] / theirs:.3f}" if theirs else ""])
        headers = ["mode", "ms/step", "overhead ms", "vs torch"]
        return (common.markdown_table if md else common.text_table)(headers, rows)

    line = common.provenance(f"{a.ranks} rank(s), MLP {a.depth} x {a.width}, batch {a.batch}")
    print(line)
    common.emit(render, lambda md: line, a.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
