"""The measuring half of ``bench/collectives.py``: its configuration and what each rank runs.

``collectives.py`` (the command line and the report) starts the ranks on one host, and
``_hosts.py`` on simulated hosts; both run :func:`bench_size` per op and size here, so neither
imports the other.  The definitions (size, latency, busbw) are in ``collectives.py``.
"""

from __future__ import annotations

import dataclasses
import sys
import time
from collections.abc import Callable
from typing import Any

import _common as common
import _floor
import torch

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
BUFFERS = ("plain", "arena")
LIB_OF_BUFFERS = {"plain": "ringlet", "arena": "arena"}
TARGET_S = 0.2            # one repeat's length per library and size


@dataclasses.dataclass(frozen=True, kw_only=True)
class Config:
    ranks: int
    ops: tuple[str, ...]
    sizes: tuple[int, ...]      # nominal per-rank message sizes, bytes
    repeats: int
    backend: str                # ringlet's backend; gloo is always the peer
    op_timeout: float           # seconds, both libraries' collective timeout
    timeout: float              # seconds, the whole run's backstop
    markdown: str | None = None
    hosts: int = 1              # > 1: simulated hosts, --ranks per host (bench/_hosts.py)
    load: int = 0               # busy processes running beside the ranks (--load)
    link_rate: str | None = None    # --hosts: tc tbf rate of every host's link, e.g. "1gbit"
    buffers: tuple[str, ...] = BUFFERS   # ringlet's tensors: ordinary, comm_buffer, or both
    floor: bool = True              # measure the memory floor of every size

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks < (1 if self.hosts > 1 else 2):
            raise ValueError("expected --ranks >= 2 (>= 1 per host with --hosts), got "
                             f"{self.ranks}")
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"expected --ops from {','.join(OPS)}, got {','.join(self.ops)!r}")
        if not self.sizes:
            raise ValueError("expected at least one size between --min-bytes and --max-bytes")
        if self.repeats < 1:
            raise ValueError(f"expected --repeats >= 1, got {self.repeats}")
        if not self.buffers or any(b not in BUFFERS for b in self.buffers):
            raise ValueError(f"expected --buffers from {','.join(BUFFERS)}, got "
                             f"{','.join(self.buffers)!r}")
        if self.op_timeout <= 0 or self.timeout <= 0:
            raise ValueError(f"expected positive timeouts, got {self.op_timeout}, {self.timeout}")

    @property
    def libs(self) -> tuple[str, ...]:
        if self.hosts > 1:
            return ("auto", "tcp", "gloo")
        return (*[LIB_OF_BUFFERS[b] for b in self.buffers], "gloo")

    @property
    def mine(self) -> tuple[str, ...]:
        """The ringlet columns (every library but the peer, gloo)."""
        return self.libs[:-1]

    @property
    def world(self) -> int:
        return self.ranks * self.hosts


# ---------------------------------------------------------------- in each rank


def rank_main(rank: int, n: int, cfg: Config, gloo_init: str) -> list[dict[str, Any]]:
    """Body of each rank (ringlet's default group is already up): every op, every size."""
    import ringlet.distributed as rdist

    with common.gloo_group(gloo_init, rank, n, cfg.op_timeout) as tdist:
        libs = {"ringlet": rdist, "arena": rdist, "gloo": tdist}
        return [bench_size(cfg, op, size, rank, n, libs) for op in cfg.ops for size in cfg.sizes]


def _buffers(op: str, size: int, n: int, alloc: Callable[[int], torch.Tensor] = torch.zeros
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the size-bytes tensor, the size/n one if the op has one); zeros stay zeros under SUM."""
    count = max(1, size // 4)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        count = max(n, count // n * n)   # divisible by n: rounded down, as nccl-tests does
        return alloc(count), alloc(count // n)
    return alloc(count), None


def _arena_zeros(count: int) -> torch.Tensor:
    import ringlet.distributed as rdist

    return rdist.comm_buffer(count).zero_()


def _make_call(lib: Any, op: str, big: torch.Tensor,
               small: torch.Tensor | None) -> Callable[[], Any]:
    """One collective on ``lib`` (ringlet.distributed or torch.distributed: the same API)."""
    if op == "all_reduce":
        return lambda: lib.all_reduce(big)
    if op == "broadcast":
        return lambda: lib.broadcast(big, src=0)
    # torch 2.13 deprecates the *_tensor names (a FutureWarning raised on every call, which
    # would be timed); the *_single names are the same functions, in ringlet too.
    if op == "all_gather_into_tensor":
        gather = getattr(lib, "all_gather_single", lib.all_gather_into_tensor)
        return lambda: gather(big, small)
    scatter = getattr(lib, "reduce_scatter_single", lib.reduce_scatter_tensor)
    return lambda: scatter(small, big)


def _time_calls(lib: Any, call: Callable[[], Any], iters: int) -> tuple[float, float]:
    """(mean seconds per call of ``iters`` back-to-back calls started together after a barrier,
    the median of the calls timed one by one)."""
    clock = time.perf_counter
    lib.barrier()
    stamps = [0.0] * (iters + 1)
    stamps[0] = t0 = clock()
    for i in range(iters):
        call()
        stamps[i + 1] = clock()
    each = sorted(stamps[i + 1] - stamps[i] for i in range(iters))
    return (stamps[-1] - t0) / iters, each[iters // 2]


def _agree_iters(lib: Any, call: Callable[[], Any], size: int) -> int:
    """Warm up, estimate the time per call, and agree on ``iters`` (slowest rank's estimate)."""
    import torch.distributed as tdist

    call()   # first touch: page faults, connections, arena slots
    per_call, _ = _time_calls(lib, call, min(100, max(3, common.MIB // size)))
    est = torch.tensor([per_call], dtype=torch.float64)
    tdist.all_reduce(est, op=tdist.ReduceOp.MAX)   # gloo is the control plane for both
    return common.iters_for(est.item(), TARGET_S)


def bench_size(cfg: Config, op: str, size: int, rank: int, n: int,
               libs: dict[str, Any]) -> dict[str, Any]:
    """Time ``op`` at ``size`` on every library of ``libs`` (name -> module with torch's API)."""
    import torch.distributed as tdist

    names = list(cfg.libs)
    tensors = {name: _buffers(op, size, n, _arena_zeros if name == "arena" else torch.zeros)
               for name in names}
    calls = {name: (libs[name], _make_call(libs[name], op, *tensors[name])) for name in names}
    iters = {name: _agree_iters(lib, call, size) for name, (lib, call) in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in names}
    each: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(cfg.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            lib, call = calls[name]
            mean, median = _time_calls(lib, call, iters[name])
            samples[name].append(mean)
            each[name].append(median)
    worst = torch.tensor([samples[name] + each[name] for name in names], dtype=torch.float64)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)   # each repeat: the slowest rank
    big = tensors[names[0]][0]
    result = {"op": op, "bytes": big.numel() * big.element_size(), "iters": iters,
              "samples": {name: worst[i, :cfg.repeats].tolist() for i, name in enumerate(names)},
              "calls": {name: worst[i, cfg.repeats:].tolist() for i, name in enumerate(names)}}
    result["seconds"] = {name: common.median(result["samples"][name]) for name in names}
    result["call"] = {name: common.median(result["calls"][name]) for name in names}
    del tensors, calls
    if cfg.floor:
        result["floor"] = _floor.floor_seconds(op, result["bytes"], n, cfg.repeats, tdist.barrier,
                                               _slowest)
    if rank == 0:
        _progress(result)
    return result


def _slowest(samples: list[float]) -> list[float]:
    import torch.distributed as tdist

    t = torch.tensor(samples, dtype=torch.float64)
    tdist.all_reduce(t, op=tdist.ReduceOp.MAX)
    return t.tolist()


def _progress(r: dict[str, Any]) -> None:
    times = "  ".join(f"{name} {sec * 1e6:10.1f} us" for name, sec in r["seconds"].items())
    if "floor" in r:
        times += f"  floor {r['floor'] * 1e6:10.1f} us"
    print(f"  {r['op']:<23} {common.format_size(r['bytes']):>9}  {times}",
          file=sys.stderr, flush=True)
