"""The GPU acceptance run of issue 20 (docs/gpu.md): one command on a machine with a CUDA GPU.

    python scripts/gpu_check.py                 # every row, a PASS/FAIL table, < 5 minutes
    python scripts/gpu_check.py --only ddp      # the rows whose name contains "ddp"
    python scripts/gpu_check.py --rehearse      # every row on the CPU: checks this script only

Rows: collectives on NCCL (1 rank) and staged through host memory over ringlet's transport
(``"gloo"``, 2 ranks sharing cuda:0); the same with a slow kernel (``torch.cuda._sleep``) queued
before each collective (stream ordering); DDP and fully_shard training ``--steps`` steps on CUDA,
1 rank on NCCL and 2 ranks sharing the GPU, losses against the same training in one process;
fully_shard the same under ``CPUOffloadPolicy`` (shards and gradients in pinned CPU memory);
tensor parallelism on 1 rank (NCCL) and 2 ranks (staged), and fully_shard + tensor parallelism
on a 2 x 2 mesh of 4 ranks sharing the GPU (staged), against one process; the step time of DDP
and fully_shard against torch's own DDP and FSDP2 on NCCL (fails above ``--max-ratio``).  Every
ringlet row runs in fresh processes (``ringlet.testing.run_world``), the torch baselines in a
child process of this script.

``--rehearse`` runs the same rows on the CPU, to catch a plain bug of this script before the rare
GPU run: the rank bodies take the device as an argument (``"cuda:0"`` or ``"cpu"``) and every CUDA
call goes through a helper below (``_to``, ``_sync``, ``_slow_kernel``, ``_offloaded``,
``_device_name``) that does the CPU equivalent there; the backends stay (ringlet's ``"nccl"`` and
``"gloo"`` serve CPU tensors on ringlet's transports), torch's baseline runs on its gloo, the
speed model is smaller and the speed rows report their ratio without failing on it.  It checks
none of the CUDA code: NCCL, staging, streams, pinned memory, the timings.

Exit status: 0 every row passed, 1 a row failed, 3 no CUDA device and no ``--rehearse``
(nothing checked).
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
GPU = "cuda:0"                  # every rank of every row computes here (2 ranks share it)
REHEARSAL = "cpu"               # the device of --rehearse
# the speed rows' MLP: (width, depth, batch rows); the rehearsal's is small enough for 2 cores
SPEED_MODEL = {"cuda": (2048, 16, 64), "cpu": (256, 4, 64)}
BANNER = ("=" * 100 + "\nREHEARSAL ON THE CPU: this checks the script gpu_check.py, NOT the GPU "
          "(no CUDA, NCCL, staging, stream or pinned-memory code runs; timings mean nothing)\n"
          + "=" * 100)


# --- the device: CUDA calls on a GPU, their CPU stand-ins in the rehearsal ------------------

def _on_gpu(device: str) -> bool:
    return torch.device(device).type == "cuda"


def _to(t: Any, device: str) -> Any:
    """``t.cuda()`` on a GPU (a tensor or a module; ``device`` is ``cuda:0``), ``t`` on the CPU."""
    return t.to(torch.device(device)) if _on_gpu(device) else t


def _sync(device: str) -> None:
    """Wait for the GPU's queued work; nothing is queued on the CPU."""
    if _on_gpu(device):
        torch.cuda.synchronize()


def _slow_kernel(device: str) -> None:
    """Queue ~0.1 s of GPU work on the current stream (200M cycles: 0.1 s at 2 GHz, more at
    lower clocks; the host goes on at once); on the CPU a 5 ms sleep of the host, after which
    the tensor is written as on the GPU."""
    if _on_gpu(device):
        torch.cuda._sleep(200_000_000)
    else:
        time.sleep(0.005)


def _offloaded(t: torch.Tensor, device: str) -> bool:
    """Whether ``t`` lives where ``CPUOffloadPolicy`` puts it: pinned CPU memory on a GPU; on a CPU
    mesh the policy changes nothing, so only the device is checked (not the pinning)."""
    return t.device.type == "cpu" and (not _on_gpu(device) or t.is_pinned())


def _device_name(device: str) -> str:
    if _on_gpu(device):
        return torch.cuda.get_device_name(torch.device(device))
    return f"CPU ({os.cpu_count()} cores)"


def _ddp_devices(device: str) -> list[int] | None:
    """DDP's ``device_ids``: ``[0]`` for a module on cuda:0, ``None`` for a CPU module."""
    return [torch.device(device).index or 0] if _on_gpu(device) else None


# --- rank bodies (module level: run_world pickles them by reference as gpu_check.<name>) ------

def collectives(rank: int, n: int, slow: bool, device: str = GPU) -> str:
    """all_reduce (sync, async), all_gather, reduce_scatter, broadcast on ``device``; with
    ``slow``, each input is written by a kernel queued behind a ~0.1 s sleep kernel."""
    import ringlet.distributed as dist

    dev = torch.device(device)

    def made(value: float, numel: int = 1 << 16) -> torch.Tensor:
        t = torch.zeros(numel, device=dev)
        if slow:
            _slow_kernel(device)                    # a collective that reads early sees zeros
        return t.fill_(value)
    dist.all_reduce(torch.zeros(1, device=dev))     # NCCL builds its communicator here
    _sync(device)
    total = float(sum(range(1, n + 1)))
    t = made(rank + 1.0)
    t0 = time.perf_counter()
    dist.all_reduce(t)
    queued = time.perf_counter() - t0
    _same(t, total, "all_reduce")
    if slow and dist.get_backend() == "nccl" and _on_gpu(device):  # NCCL only queues
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
    _sync(device)
    return "ok"


def _same(t: torch.Tensor, value: float, what: str) -> None:
    _check(bool((t == value).all()), f"{what}: expected every element {value}, got "
                                     f"{t.unique().tolist()[:4]}")


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise AssertionError(what)


def _model(device: str, width: int = 32, depth: int = 3) -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return _to(nn.Sequential(*layers, nn.Linear(width, 4)), device)


def _batch(step: int, rows: int, device: str, width: int = 32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(step)
    return (_to(torch.randn(rows, width, generator=g), device),
            _to(torch.randn(rows, 4, generator=g), device))


def _losses(model: nn.Module, steps: int, rank: int, n: int, reduce: Callable,
            device: str) -> list[float]:
    """SGD on ``rank``'s rows of each global batch of 8 rows per rank; the mean loss over ranks."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = _batch(step, 8 * n, device)
        loss = nn.functional.mse_loss(model(x[8 * rank:8 * rank + 8]), y[8 * rank:8 * rank + 8])
        opt.zero_grad()
        loss.backward()
        opt.step()
        mean = loss.detach().clone()
        reduce(mean)
        out.append(float(mean) / n)
    return out


def train(rank: int, n: int, strategy: str, steps: int, device: str = GPU) -> list[float]:
    """``steps`` steps of DDP or fully_shard on ``device``; raises unless the mean losses equal
    the same training on the whole batch in this process.  ``"fully_shard offload"``: under
    ``CPUOffloadPolicy``, whose shards and gradients must be in pinned CPU memory."""
    import ringlet.distributed as dist
    from ringlet.distributed.fsdp import CPUOffloadPolicy, fully_shard
    from ringlet.nn.parallel import DistributedDataParallel

    local = _model(device)
    offload = strategy.endswith("offload")
    shard = functools.partial(fully_shard, offload_policy=CPUOffloadPolicy()) if offload \
        else fully_shard
    model = _parallel(copy.deepcopy(local), strategy, DistributedDataParallel, shard, device)
    got = _losses(model, steps, rank, n, dist.all_reduce, device)
    want = _whole(local, steps, n, device)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    if offload:
        for p in model.parameters():
            shard_, grad = p.to_local(), p.grad.to_local()
            _check(_offloaded(shard_, device) and _offloaded(grad, device),
                   f"offloaded shard on {shard_.device}, its grad on {grad.device}: expected "
                   "both in pinned CPU memory")
    return got


def tp_train(rank: int, n: int, dp: int, steps: int, device: str = GPU) -> list[float]:
    """Tensor parallelism (column-, row-, column-, row-wise Linears) on the ``tp`` axis of a
    ``(dp, n // dp)`` mesh of ``device``'s type, plus fully_shard on ``dp`` when ``dp > 1``; raises
    unless the mean losses equal the same training on the whole batch in this process.  The
    model is built on the device, as torch's tutorials do, and parallelized there."""
    import ringlet.distributed as dist
    from ringlet.distributed.device_mesh import init_device_mesh
    from ringlet.distributed.fsdp import fully_shard
    from ringlet.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh(torch.device(device).type, (dp, n // dp),
                            mesh_dim_names=("dp", "tp"))
    local = _model(device)
    plan = {str(i): ColwiseParallel() if i % 4 == 0 else RowwiseParallel() for i in (0, 2, 4, 6)}
    model = parallelize_module(copy.deepcopy(local), mesh["tp"], plan)
    if dp > 1:
        _parallel(model, "fully_shard", None, functools.partial(fully_shard, mesh=mesh["dp"]),
                  device)
    dp_group = mesh.get_group("dp")
    got = _losses(model, steps, mesh.get_local_rank("dp"), dp,
                  lambda t: dist.all_reduce(t, group=dp_group), device)
    want = _whole(local, steps, dp, device)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), **TOL)
    for name, p in model.named_parameters():
        _check(p.to_local().device == torch.device(device),
               f"{name}: local shard on {p.to_local().device}, expected {device}")
    return got


def _parallel(model: nn.Module, strategy: str, ddp: Callable, shard: Callable,
              device: str) -> nn.Module:
    """``model`` under DDP (``device_ids=[0]`` on cuda:0) or fully_shard (each Linear, then the
    root)."""
    if strategy == "ddp":
        return ddp(model, device_ids=_ddp_devices(device))
    for layer in model:
        if isinstance(layer, nn.Linear):
            shard(layer)
    shard(model)
    return model


def _whole(model: nn.Module, steps: int, n: int, device: str) -> list[float]:
    """The single-process reference of an ``n``-rank run: the whole batch, one loss."""
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    out = []
    for step in range(steps):
        x, y = _batch(step, 8 * n, device)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        out.append(loss.item())
    return out


def step_time(rank: int, n: int, strategy: str, engine: str, device: str = GPU) -> float:
    """Seconds per training step of an MLP (``SPEED_MODEL``: 16 x 2048, batch 64 on a GPU),
    after warm-up.  ``engine="torch"``: torch's DDP/FSDP2 on its own default group (NCCL on a
    GPU, gloo in the rehearsal), made here."""
    width, depth, batch = SPEED_MODEL[torch.device(device).type]
    model = _model(device, width=width, depth=depth)
    if engine == "torch":
        from torch.distributed.fsdp import fully_shard as torch_fully_shard
        from torch.nn.parallel import DistributedDataParallel as TorchDDP
        _torch_group(device)
        wrap, shard = TorchDDP, torch_fully_shard
    else:
        from ringlet.distributed.fsdp import fully_shard as shard
        from ringlet.nn.parallel import DistributedDataParallel as wrap
    model = _parallel(model, strategy, wrap, shard, device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    x, y = _batch(0, batch, device, width)
    for i in range(25):
        if i == 5:
            _sync(device)
            t0 = time.perf_counter()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    _sync(device)
    return (time.perf_counter() - t0) / 20


def _torch_group(device: str) -> Any:
    """Join torch's own one-rank default group (NCCL on a GPU, gloo in the rehearsal); returns
    ``torch.distributed``."""
    import torch.distributed as tdist

    bound = {"device_id": torch.device(device)} if _on_gpu(device) else {}
    tdist.init_process_group("nccl" if _on_gpu(device) else "gloo",
                             init_method=f"file://{os.environ['GPU_CHECK_FILE']}",
                             rank=0, world_size=1, **bound)
    return tdist


def collective_time(rank: int, n: int, engine: str, device: str = GPU) -> float:
    """Seconds per ``all_reduce`` of 1024 floats on one rank (after warm-up, the GPU drained at
    the end): what a collective costs above its kernel.  ``engine="torch"``: torch's own
    process group (NCCL on a GPU, gloo in the rehearsal), made here."""
    if engine == "torch":
        dist = _torch_group(device)
    else:
        import ringlet.distributed as dist
    t = _to(torch.ones(1024), device)
    for i in range(1100):
        if i == 100:
            _sync(device)
            t0 = time.perf_counter()
        dist.all_reduce(t)
    _sync(device)
    return (time.perf_counter() - t0) / 1000


def peak_memory(rank: int, n: int, device: str = GPU) -> int:
    """Bytes this rank holds at its peak over 3 AdamW steps of a fully_shard MLP (1024 wide, 8
    deep): ``torch.cuda.max_memory_allocated`` on a GPU (each process has its own allocator, so
    2 ranks sharing the GPU are measured apart); in the rehearsal, the stand-in is what sharding
    divides: this rank's parameter shards, their gradients and the optimizer state."""
    from ringlet.distributed.fsdp import fully_shard

    model = _model(device, width=1024, depth=8)
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if _on_gpu(device):
        _sync(device)
        torch.cuda.reset_peak_memory_stats(torch.device(device))
    for step in range(3):
        x, y = _batch(step, 8, device, width=1024)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    if _on_gpu(device):
        _sync(device)
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    held = [p.to_local() for p in model.parameters()]
    held += [p.grad.to_local() for p in model.parameters() if p.grad is not None]
    held += [v.to_local() for st in opt.state.values() for v in st.values()
             if isinstance(v, torch.Tensor) and v.dim() > 0]
    return sum(t.numel() * t.element_size() for t in held)


def _memory(me: Any, device: str) -> str:
    one = _world(1, me.peak_memory, device, backend="nccl")[0]
    two = max(_world(2, me.peak_memory, device, backend="gloo"))
    line = f"peak per rank: 1 rank {one / 2**20:.1f} MiB, 2 ranks {two / 2**20:.1f} MiB " \
           f"({two / one:.2f}x)"
    _check(two <= 0.75 * one, line + ": expected 2 ranks to hold at most 0.75x of 1 rank")
    return line


# --- the rows -------------------------------------------------------------------------------

def _world(n: int, fn: Callable, *args: Any, backend: str) -> Any:
    from ringlet.testing.procs import raise_first, run_world

    return raise_first(run_world(n, fn, *args, backend=backend, timeout=150, op_timeout=60))


def _overhead(me: Any, max_us: float, device: str) -> str:
    theirs = _torch_baseline("all_reduce", device)
    ours = _world(1, me.collective_time, "ringlet", device, backend="nccl")[0]
    extra = (ours - theirs) * 1e6
    return _within(f"all_reduce of 1024 floats: ringlet {ours * 1e6:.1f} us, torch "
                   f"{theirs * 1e6:.1f} us, {extra:+.1f} us", extra <= max_us, f"+{max_us} us",
                   device)


def _within(line: str, ok: bool, limit: str, device: str) -> str:
    """A speed row's detail; on a GPU it fails unless ``ok`` (the rehearsal only reports)."""
    if not _on_gpu(device):
        return line + f" (rehearsal on the CPU: the limit {limit} is not checked)"
    line += f" (limit {limit})"
    _check(ok, line)
    return line


def _torch_baseline(strategy: str, device: str) -> float:
    """torch's DDP/FSDP2 step time, in a child process (torch.distributed's own default group)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-baseline", strategy]
    proc = subprocess.run(cmd + ([] if _on_gpu(device) else ["--rehearse"]),
                          check=False, capture_output=True, text=True, timeout=240)
    if proc.returncode != 0:
        raise RuntimeError(f"torch {strategy} baseline failed: {proc.stderr[-800:]}")
    return float(json.loads(proc.stdout.strip().splitlines()[-1])["seconds"])


def _speed(me: Any, strategy: str, max_ratio: float, device: str) -> str:
    theirs = _torch_baseline(strategy, device)
    ours = _world(1, me.step_time, strategy, "ringlet", device, backend="nccl")[0]
    ratio = ours / theirs
    return _within(f"ringlet {ours * 1e3:.2f} ms/step, torch {theirs * 1e3:.2f} ms/step, "
                   f"ratio {ratio:.3f}", ratio <= max_ratio, str(max_ratio), device)


def rows(me: Any, steps: int, max_ratio: float,
         device: str = GPU) -> list[tuple[str, Callable[[], Any]]]:
    """(name, check) in the order they run; a check returns a detail or raises.  ``me`` is this
    module imported as ``gpu_check`` (what run_world's children unpickle the rank bodies from);
    ``device`` is ``"cuda:0"``, or ``"cpu"`` for the rehearsal (same rows, same names)."""
    out: list[tuple[str, Callable[[], Any]]] = []
    for slow in (False, True):
        tag = " slow-kernel" if slow else ""
        out.append((f"collectives{tag} nccl 1 rank",
                    lambda s=slow: _world(1, me.collectives, s, device, backend="nccl")))
        out.append((f"collectives{tag} staged 2 ranks (gloo, shared GPU)",
                    lambda s=slow: _world(2, me.collectives, s, device, backend="gloo")))
    for strategy in ("ddp", "fully_shard", "fully_shard offload"):
        out.append((f"{strategy} {steps} steps nccl 1 rank vs single process",
                    lambda st=strategy: _world(1, me.train, st, steps, device,
                                               backend="nccl")[0][-1]))
        out.append((f"{strategy} {steps} steps staged 2 ranks vs single process",
                    lambda st=strategy: _world(2, me.train, st, steps, device,
                                               backend="gloo")[0][-1]))
    out.append((f"tensor parallel {steps} steps nccl 1 rank vs single process",
                lambda: _world(1, me.tp_train, 1, steps, device, backend="nccl")[0][-1]))
    out.append((f"tensor parallel {steps} steps staged 2 ranks vs single process",
                lambda: _world(2, me.tp_train, 1, steps, device, backend="gloo")[0][-1]))
    two_d = f"fully_shard + tensor parallel 2x2 {steps} steps staged 4 ranks vs single process"
    out.append((two_d, lambda: _world(4, me.tp_train, 2, steps, device, backend="gloo")[0][-1]))
    out.append(("fully_shard memory per rank falls with 2 ranks", lambda: _memory(me, device)))
    out.append(("adapter overhead per all_reduce vs torch's NCCL (1 rank)",
                lambda: _overhead(me, 5.0, device)))
    for strategy in ("ddp", "fully_shard"):
        out.append((f"speed {strategy} vs torch (1 rank nccl)",
                    lambda st=strategy: _speed(me, st, max_ratio, device)))
    return out


def _run(checks: list[tuple[str, Callable[[], Any]]]) -> list[tuple[str, bool, float, str]]:
    """Run each check, printing its line as it ends (and a failure's whole report, which carries
    the failing rank's traceback); returns (name, passed, seconds, detail) per row."""
    results = []
    for name, check in checks:
        t0 = time.perf_counter()
        report = ""
        try:
            detail, ok = check(), True
        except Exception as e:  # noqa: BLE001 - every failure is a row of the table
            detail, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}", False
            report = "\n".join("    | " + line for line in str(e).strip().splitlines()[-60:])
        results.append((name, ok, time.perf_counter() - t0, str(detail)))
        print(f"{'PASS' if ok else 'FAIL'}  {name}  ({results[-1][2]:.1f} s)  {detail}", flush=True)
        if report:
            print(report, flush=True)
    return results


def _parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description="GPU acceptance run of ringlet (docs/gpu.md): "
                                 "prints a PASS/FAIL table; exit 0 all passed, 1 a row failed, "
                                 f"{NO_CUDA} no CUDA device")
    ap.add_argument("--only", action="append", default=[], metavar="TEXT",
                    help="run the rows whose name contains this text (repeatable: any of them)")
    ap.add_argument("--steps", type=int, default=10, help="training steps per row (10)")
    ap.add_argument("--max-ratio", type=float, default=1.05,
                    help="step-time limit against torch's DDP/FSDP2 (1.05)")
    ap.add_argument("--rehearse", action="store_true",
                    help="run every row on the CPU instead: checks this script, not the GPU "
                    "(the speed rows report their ratio without checking it)")
    ap.add_argument("--torch-baseline", choices=("ddp", "fully_shard", "all_reduce"),
                    help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not args.rehearse and not torch.cuda.is_available():
        print("no CUDA device here: nothing checked")
        return NO_CUDA
    device = REHEARSAL if args.rehearse else GPU
    if args.torch_baseline:
        import tempfile

        os.environ["GPU_CHECK_FILE"] = os.path.join(tempfile.mkdtemp(), "store")
        torch.set_num_threads(1)         # as ringlet's side (run_world's ranks): a fair race
        seconds = (collective_time(0, 1, "torch", device) if args.torch_baseline == "all_reduce"
                   else step_time(0, 1, args.torch_baseline, "torch", device))
        print(json.dumps({"seconds": seconds}))
        return 0
    sys.path.insert(0, HERE)
    # the rank bodies pickle as gpu_check.<name>, importable in run_world's children
    import gpu_check as me

    if args.rehearse:
        print(BANNER)
    print(f"device: {_device_name(device)}, torch {torch.__version__}")
    t0 = time.perf_counter()
    checks = [(name, check) for name, check in rows(me, args.steps, args.max_ratio, device)
              if not args.only or any(text in name for text in args.only)]
    results = _run(checks)
    width = max((len(r[0]) for r in results), default=10)
    print("\n" + "\n".join(f"{n:<{width}}  {'PASS' if ok else 'FAIL'}" for n, ok, _, _ in results))
    failed = sum(not ok for _, ok, _, _ in results)
    print(f"{len(results) - failed} passed, {failed} failed ({time.perf_counter() - t0:.0f} s)")
    if args.rehearse:
        print(BANNER)
    return 1 if failed or not results else 0


if __name__ == "__main__":
    sys.exit(main())
