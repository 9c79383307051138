"""The GPU acceptance run of issue 20 (docs/gpu.md): one command on a machine with a CUDA GPU.

    python scripts/gpu_check.py                 # every row, a PASS/FAIL table, < 5 minutes
    python scripts/gpu_check.py --only ddp      # the rows whose name contains "ddp"

Rows: collectives on NCCL (1 rank) and staged through host memory over ringlet's transport
(``"gloo"``, 2 ranks sharing cuda:0); the same with a slow kernel (``torch.cuda._sleep``) queued
before each collective (stream ordering); DDP and fully_shard training ``--steps`` steps on CUDA,
1 rank on NCCL and 2 ranks sharing the GPU, losses against the same training in one process;
fully_shard the same under ``CPUOffloadPolicy`` (shards and gradients in pinned CPU memory);
the step time of DDP and fully_shard against torch's own DDP and FSDP2 on NCCL (fails above
``--max-ratio``).  Every ringlet row runs in fresh processes (``ringlet.testing.run_world``), the
torch baselines in a child process of this script.

Exit status: 0 every row passed, 1 a row failed, 3 no CUDA device (nothing checked).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

NO_CUDA = 3
HERE = os.path.dirname(os.path.abspath(__file__))
TOL = {"rtol": 1e-4, "atol": 1e-5}


# --- rank bodies (module level: run_world pickles them by reference as gpu_check.<name>) ------

def collectives(rank: int, n: int, slow: bool) -> str:
    """all_reduce (sync, async), all_gather, reduce_scatter, broadcast on cuda:0; with ``slow``,
    each input is written by a kernel queued behind a ~50 ms sleep kernel."""
    import ringlet.distributed as dist

    dev = torch.device("cuda", 0)

    def made(value: float, numel: int = 1 << 16) -> torch.Tensor:
        t = torch.zeros(numel, device=dev)
        if slow:
            torch.cuda._sleep(50_000_000)           # a collective that reads early sees zeros
        return t.fill_(value)
    dist.all_reduce(torch.zeros(1, device=dev))     # NCCL builds its communicator here
    torch.cuda.synchronize()
    total = float(sum(range(1, n + 1)))
    t = made(rank + 1.0)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    queued = time.perf_counter() - t0
    _same(t, total, "all_reduce")
    if slow and dist.get_backend() == "nccl":       # NCCL only queues: the host does not wait
        _check(queued < 0.025, f"all_reduce held the host {queued * 1e3:.1f} ms behind a kernel")
    t = made(rank + 1.0)
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    t.mul_(2)                                        # queued after the collective's results
    _same(t, 2 * total, "all_reduce async")
    out = torch.empty(n * 8, device=dev)
    dist.all_gather_into_tensor(out, made(rank + 1.0, 8))
    want = torch.arange(1, n + 1, device=dev, dtype=torch.float32).repeat_interleave(8)
    _check(torch.equal(out, want), f"all_gather_into_tensor: {out.tolist()}")
    rs = torch.empty(8, device=dev)
    dist.reduce_scatter_tensor(rs, made(rank + 1.0, 8 * n))
    _same(rs, total, "reduce_scatter_tensor")
    b = made(float(rank + 7), 8)
    dist.broadcast(b, src=0)
    _same(b, 7.0, "broadcast")
    cpu = torch.ones(4)
    dist.all_reduce(cpu)                              # CPU tensors keep working on the same group
    _check(cpu.tolist() == [float(n)] * 4, f"CPU all_reduce: {cpu.tolist()}")
    torch.cuda.synchronize()
    return "ok"


def _same(t: torch.Tensor, value: float, what: str) -> None:
    _check(bool((t == value).all()), f"{what}: expected every element {value}, got "
                                     f"{t.unique().tolist()[:4]}")


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _model(width: int = 32, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 4)).cuda()


def _batch(step: int, rows: int, width: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return (torch.randn(rows, width, generator=g).cuda(), torch.randn(rows, 4, generator=g).cuda())


def _losses(model: nn.Module, steps: int, rank: int, n: int, reduce: Callable) -> list[float]:
    """SGD on ``rank``'s rows of each global batch of 8 rows per rank; the mean loss over ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = _batch(step, 8 * n)
        loss = nn.functional.mse_loss(model(x[8 * rank:8 * rank + 8]), y[8 * rank:8 * rank + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        reduce(mean)
        out.append(float(mean) / n)
    return out


def train(rank: int, n: int, strategy: str, steps: int) -> list[float]:
    """``steps`` steps of DDP or fully_shard on cuda:0; raises unless the mean losses equal
    the same training on the whole batch in this process.  ``"fully_shard offload"``: under
    ``CPUOffloadPolicy``, whose shards and gradients must be in pinned CPU memory."""
    import ringlet.distributed as dist
    from ringlet.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from ringlet.nn.parallel import DistributedDataParallel

    local = _model()
    offload = strategy.endswith("offload")
    shard = functools.partial(fully_shard, offload_policy=CPUOffloadPolicy()) if offload \
        else fully_shard
    model = _parallel(copy.deepcopy(local), strategy, DistributedDataParallel, shard)
    got = _losses(model, steps, rank, n, dist.all_reduce)
    want = _whole(local, steps, n)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    if offload:
        for p in model.parameters():
            shard_, grad = p.to_local(), p.grad.to_local()
            _check(shard_.is_pinned() and grad.is_pinned(),
                   f"offloaded shard on {shard_.device}, its grad on {grad.device}: expected "
                   "both in pinned CPU memory")
    return got


def _parallel(model: nn.Module, strategy: str, ddp: Callable, shard: Callable) -> nn.Module:
    """``model`` under DDP (``device_ids=[0]``) or fully_shard (each Linear, then the root)."""
    if strategy == "ddp":
        return ddp(model, device_ids=[0])
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer)
    shard(model)
    return model


def _whole(model: nn.Module, steps: int, n: int) -> list[float]:
    """The single-process reference of an ``n``-rank run: the whole batch, one loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = _batch(step, 8 * n)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def step_time(rank: int, n: int, strategy: str, engine: str) -> float:
    """Seconds per training step of a 16 x 2048 MLP (batch 64), after warm-up."""
    model = _model(width=2048, depth=16)
    if engine == "torch":
        import torch.distributed as tdist
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.nn.parallel import DistributedDataParallel as TorchDDP
        tdist.init_process_group("nccl", init_method=f"file://{os.environ['GPU_CHECK_FILE']}",
                                 rank=0, world_size=1, device_id=torch.device("cuda", 0))
        wrap, shard = TorchDDP, torch_fully_shard
    else:
        from ringlet.distributed.fsdp import fully_shard as shard
        from ringlet.nn.parallel import DistributedDataParallel as wrap
    model = _parallel(model, strategy, wrap, shard)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = _batch(0, 64, 2048)
    for i in range(25):
        if i == 5:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 20


# --- the rows -------------------------------------------------------------------------------

def _world(n: int, fn: Callable, *args: Any, backend: str) -> Any:
    from ringlet.testing.procs import raise_first, run_world

    return raise_first(run_world(n, fn, *args, backend=backend, timeout=150, op_timeout=60))


def _torch_baseline(strategy: str) -> float:
    """torch's DDP/FSDP2 step time, in a child process (torch.distributed's own default group)."""
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--torch-baseline", strategy],
                          check=False, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"torch {strategy} baseline failed: {proc.stderr[-800:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


def _speed(me: Any, strategy: str, max_ratio: float) -> str:
    theirs = _torch_baseline(strategy)
    ours = _world(1, me.step_time, strategy, "ringlet", backend="nccl")[0]
    ratio = ours / theirs
    line = (f"ringlet {ours * 1e3:.2f} ms/step, torch {theirs * 1e3:.2f} ms/step, "
            f"ratio {ratio:.3f} (limit {max_ratio})")
    _check(ratio <= max_ratio, line)
    return line


def rows(me: Any, steps: int, max_ratio: float) -> list[tuple[str, Callable[[], Any]]]:
    """(name, check) in the order they run; a check returns a detail or raises."""
    out: list[tuple[str, Callable[[], Any]]] = []
    for slow in (False, True):
        tag = " slow-kernel" if slow else ""
        out.append((f"collectives{tag} nccl 1 rank",
                    lambda s=slow: _world(1, me.collectives, s, backend="nccl")))
        out.append((f"collectives{tag} staged 2 ranks (gloo, shared GPU)",
                    lambda s=slow: _world(2, me.collectives, s, backend="gloo")))
    for strategy in ("ddp", "fully_shard", "fully_shard offload"):
        out.append((f"{strategy} {steps} steps nccl 1 rank vs single process",
                    lambda st=strategy: _world(1, me.train, st, steps, backend="nccl")[0][-1]))
        out.append((f"{strategy} {steps} steps staged 2 ranks vs single process",
                    lambda st=strategy: _world(2, me.train, st, steps, backend="gloo")[0][-1]))
    for strategy in ("ddp", "fully_shard"):
        out.append((f"speed {strategy} vs torch (1 rank nccl)",
                    lambda st=strategy: _speed(me, st, max_ratio)))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="GPU acceptance run of ringlet (docs/gpu.md): "
                                 "prints a PASS/FAIL table; exit 0 all passed, 1 a row failed, "
                                 f"{NO_CUDA} no CUDA device")
    ap.add_argument("--only", default="", help="run the rows whose name contains this text")
    ap.add_argument("--steps", type=int, default=10, help="training steps per row (10)")
    ap.add_argument("--max-ratio", type=float, default=1.05,
                    help="step-time limit against torch's DDP/FSDP2 (1.05)")
    ap.add_argument("--torch-baseline", choices=("ddp", "fully_shard"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device here: nothing checked")
        return NO_CUDA
    if args.torch_baseline:
        import tempfile

        os.environ["GPU_CHECK_FILE"] = os.path.join(tempfile.mkdtemp(), "store")
        print(json.dumps({"seconds": step_time(0, 1, args.torch_baseline, "torch")}))
        return 0
    sys.path.insert(0, HERE)
    # the rank bodies pickle as gpu_check.<name>, importable in run_world's children
    import gpu_check as me

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    results = []
    for name, check in rows(me, args.steps, args.max_ratio):
        if args.only and args.only not in name:
            continue
        t0 = time.perf_counter()
        try:
            detail, ok = check(), True
        except Exception as e:  # noqa: BLE001 - every failure is a row of the table
            detail, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", False
        results.append((name, ok, time.perf_counter() - t0, detail))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({results[-1][2]:.1f} s)  {detail}", flush=True)
    width = max((len(r[0]) for r in results), default=10)
    print("\n" + "\n".join(f"{n:<{width}}  {'PASS' if ok else 'FAIL'}" for n, ok, _, _ in results))
    failed = sum(not ok for _, ok, _, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed")
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
