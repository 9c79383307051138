"""Collectives benchmark: ringlet (shm by default) against torch.distributed on gloo, in one run.

Usage::

    python bench/collectives.py [--ranks 2]
        [--ops all_reduce,broadcast,all_gather_into_tensor,reduce_scatter_tensor]
        [--min-bytes 8] [--max-bytes 256M] [--factor 4] [--repeats 5] [--backend shm|tcp|auto]
        [--hosts 1 [--link-rate 1gbit]] [--quick] [--load N] [--markdown out.md] [--op-timeout 120]
        [--timeout SECONDS]

``--backend tcp`` runs ringlet's tcp transport on loopback.  ``--hosts H`` (root, ``ip``) runs
``--ranks`` ranks on each of ``H`` simulated hosts (network namespaces on a bridge; see
``bench/_hosts.py``) and times three libraries in the same layout: ringlet ``auto`` (shm within a
host, tcp between), a flat ringlet ``tcp`` group of the same ranks, and gloo; its tables add
``gloo/auto`` and ``tcp/auto``.  ``--link-rate 1gbit`` gives every simulated link a finite
bandwidth (``tc tbf``); unlimited, the "network" is a memory copy on the same cores.

``--load N`` starts ``N`` unrelated busy processes (each spins on a core) for the whole run,
as data-loader workers or another job would: the "loaded machine" table.

``--ranks`` processes are started (forkserver, one torch thread each); every one joins a
ringlet default group (its TCPStore hosted by this process on port 0) and a torch gloo group
(a FileStore in a temporary folder).  Both libraries run the same collectives on the same
float32 tensors, allocated once per size and freed before the next one.

Definitions (as in nccl-tests):

- size: the per-rank message in bytes -- all_reduce/broadcast: the tensor;
  all_gather_into_tensor: the output (input = size/ranks); reduce_scatter_tensor: the input
  (output = size/ranks).  Sizes run from ``--min-bytes`` by ``--factor`` up to ``--max-bytes``
  (which is always measured); ``--quick`` measures 8 B, 4 KiB, 64 KiB, 1 MiB and 16 MiB
  (those within the bounds).
- latency: per size and library, a warm-up, then ``iters`` back-to-back calls (enough for
  ~0.2 s, at least 3) after a barrier; one repeat's time is the slowest rank's mean time per
  call; the reported latency is the median over ``--repeats`` repeats.  Repeats alternate
  which library goes first, so both share the machine's noise.
- algbw = size / latency; busbw = algbw * factor, factor = 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather/reduce_scatter, 1 for broadcast.  GB/s = 1e9 bytes/s.
- ratio = gloo latency / ringlet latency: above 1 means ringlet is faster.  Each op ends
  with the minimum ratio over sizes >= 64 KiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import _common as common
import torch

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
LIBS = ("ringlet", "gloo")
QUICK_SIZES = (8, 4 * common.KIB, 64 * common.KIB, common.MIB, 16 * common.MIB)
TARGET_S = 0.2            # one repeat's length per library and size
SUMMARY_MIN_BYTES = 64 * common.KIB


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md there)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return (n - 1) / n
    return 1.0


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

    def __post_init__(self) -> None:
        if self.hosts < 1 or self.ranks < (1 if self.hosts > 1 else 2):
            raise ValueError(f"expected --ranks >= 2 (>= 1 per host with --hosts), got {self.ranks}")
        bad = [op for op in self.ops if op not in OPS]
        if bad or not self.ops:
            raise ValueError(f"expected --ops from {','.join(OPS)}, got {','.join(self.ops)!r}")
        if not self.sizes:
            raise ValueError("expected at least one size between --min-bytes and --max-bytes")
        if self.repeats < 1:
            raise ValueError(f"expected --repeats >= 1, got {self.repeats}")
        if self.op_timeout <= 0 or self.timeout <= 0:
            raise ValueError(f"expected positive timeouts, got {self.op_timeout}, {self.timeout}")

    @property
    def libs(self) -> tuple[str, ...]:
        return ("auto", "tcp", "gloo") if self.hosts > 1 else LIBS

    @property
    def world(self) -> int:
        return self.ranks * self.hosts


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", type=common.parse_size, default=8)
    p.add_argument("--max-bytes", type=common.parse_size, default=256 * common.MIB)
    p.add_argument("--factor", type=int, default=4, help="size step (default 4x)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="shm", help="ringlet backend: shm (default), tcp, auto")
    p.add_argument("--hosts", type=int, default=1,
                   help="simulated hosts (network namespaces; root): --ranks per host, auto vs tcp vs gloo")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="with --hosts: limit every host's link (tc tbf), e.g. 1gbit (default: unlimited)")
    p.add_argument("--quick", action="store_true", help="only 8 B, 4 KiB, 64 KiB, 1 MiB, 16 MiB")
    p.add_argument("--load", type=int, default=0, metavar="N",
                   help="run N unrelated busy processes beside the ranks (a loaded machine)")
    p.add_argument("--markdown", metavar="FILE", help="also write the tables as Markdown")
    p.add_argument("--op-timeout", type=float, default=120.0, help="collective timeout, s")
    p.add_argument("--timeout", type=float, default=None,
                   help="whole-run backstop, s (default: 120 + 60 per op and size)")
    a = p.parse_args(argv)
    try:
        if a.quick:
            sizes = [s for s in QUICK_SIZES if a.min_bytes <= s <= a.max_bytes]
        else:
            sizes = common.size_sweep(a.min_bytes, a.max_bytes, a.factor)
        ops = tuple(o.strip() for o in a.ops.split(",") if o.strip())
        timeout = 120.0 + 60.0 * len(ops) * len(sizes) if a.timeout is None else a.timeout
        return Config(ranks=a.ranks, ops=ops, sizes=tuple(sizes), repeats=a.repeats,
                      backend="auto" if a.hosts > 1 else a.backend, op_timeout=a.op_timeout,
                      timeout=timeout, markdown=a.markdown, hosts=a.hosts, link_rate=a.link_rate,
                      load=a.load)
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable: p.error exits


# ---------------------------------------------------------------- in each rank


def _rank_main(rank: int, n: int, cfg: Config, gloo_init: str) -> list[dict[str, Any]]:
    """Body of each rank (ringlet's default group is already up): every op, every size."""
    import torch.distributed as tdist

    import ringlet.distributed as rdist

    tdist.init_process_group("gloo", init_method=gloo_init, rank=rank, world_size=n,
                             timeout=timedelta(seconds=cfg.op_timeout))
    libs = {"ringlet": rdist, "gloo": tdist}
    try:
        return [bench_size(cfg, op, size, rank, n, libs) for op in cfg.ops for size in cfg.sizes]
    finally:
        tdist.destroy_process_group()


def _buffers(op: str, size: int, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(the size-bytes tensor, the size/n one if the op has one); zeros stay zeros under SUM."""
    count = max(1, size // 4)
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        count = max(n, count // n * n)   # divisible by n: rounded down, as nccl-tests does
        return torch.zeros(count), torch.zeros(count // n)
    return torch.zeros(count), None


def _make_call(lib: Any, op: str, big: torch.Tensor, small: torch.Tensor | None) -> Callable[[], Any]:
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


def _time_calls(lib: Any, call: Callable[[], Any], iters: int) -> float:
    """Mean seconds per call of ``iters`` back-to-back calls, started together after a barrier."""
    lib.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        call()
    return (time.perf_counter() - t0) / iters


def _agree_iters(lib: Any, call: Callable[[], Any], size: int) -> int:
    """Warm up, estimate the time per call, and agree on ``iters`` (slowest rank's estimate)."""
    import torch.distributed as tdist

    call()   # first touch: page faults, connections, arena slots
    per_call = _time_calls(lib, call, min(100, max(3, common.MIB // size)))
    est = torch.tensor([per_call], dtype=torch.float64)
    tdist.all_reduce(est, op=tdist.ReduceOp.MAX)   # gloo is the control plane for both
    return common.iters_for(est.item(), TARGET_S)


def bench_size(cfg: Config, op: str, size: int, rank: int, n: int,
               libs: dict[str, Any]) -> dict[str, Any]:
    """Time ``op`` at ``size`` on every library of ``libs`` (name -> module with torch's API)."""
    import torch.distributed as tdist

    big, small = _buffers(op, size, n)
    names = list(cfg.libs)
    calls = {name: (libs[name], _make_call(libs[name], op, big, small)) for name in names}
    iters = {name: _agree_iters(lib, call, size) for name, (lib, call) in calls.items()}
    samples: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(cfg.repeats):
        for name in names if rep % 2 == 0 else names[::-1]:
            lib, call = calls[name]
            samples[name].append(_time_calls(lib, call, iters[name]))
    worst = torch.tensor([samples[name] for name in names], dtype=torch.float64)
    tdist.all_reduce(worst, op=tdist.ReduceOp.MAX)   # each repeat: the slowest rank
    result = {"op": op, "bytes": big.numel() * big.element_size(), "iters": iters,
              "samples": {name: worst[i].tolist() for i, name in enumerate(names)}}
    result["seconds"] = {name: common.median(result["samples"][name]) for name in names}
    if rank == 0:
        _progress(result)
    return result


def _progress(r: dict[str, Any]) -> None:
    times = "  ".join(f"{name} {sec * 1e6:10.1f} us" for name, sec in r["seconds"].items())
    print(f"  {r['op']:<23} {common.format_size(r['bytes']):>9}  {times}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------- report


def _headers(cfg: Config) -> list[str]:
    if cfg.hosts > 1:
        return ["size", "auto us", "tcp us", "gloo us", "auto busbw GB/s", "tcp busbw GB/s",
                "gloo busbw GB/s", "gloo/auto", "tcp/auto"]
    rl = f"ringlet[{cfg.backend}]"
    return ["size", f"{rl} us", "gloo us", f"{rl} busbw GB/s", "gloo busbw GB/s",
            "gloo/ringlet"]


def _row(r: dict[str, Any], n: int, libs: tuple[str, ...] = LIBS) -> list[str]:
    secs = [r["seconds"][name] for name in libs]
    factor = bus_factor(r["op"], n)
    ratios = [f"{r['seconds']['gloo'] / secs[0]:.2f}x"]
    if len(libs) > 2:   # auto, tcp, gloo: also tcp/auto
        ratios.append(f"{r['seconds']['tcp'] / secs[0]:.2f}x")
    return ([common.format_size(r["bytes"])] + [f"{t * 1e6:.1f}" for t in secs]
            + [f"{r['bytes'] / t * factor / 1e9:.3f}" for t in secs] + ratios)


def _summary(op: str, rows: list[dict[str, Any]], libs: tuple[str, ...] = LIBS) -> str:
    big = [r for r in rows if r["bytes"] >= SUMMARY_MIN_BYTES]
    floor = common.format_size(SUMMARY_MIN_BYTES)
    if not big:
        return f"{op}: no sizes >= {floor} measured"
    mine = libs[0]
    parts = []
    for other in [lib for lib in libs[1:] if lib == "gloo"] + [lib for lib in libs[1:-1]]:
        worst = min(big, key=lambda r: r["seconds"][other] / r["seconds"][mine])
        ratio = worst["seconds"][other] / worst["seconds"][mine]
        parts.append(f"min {other}/{mine} over sizes >= {floor}: {ratio:.2f}x "
                     f"(at {common.format_size(worst['bytes'])})")
    return f"{op}: " + "; ".join(parts)


def render(cfg: Config, results: list[dict[str, Any]], markdown: bool) -> str:
    """Every op's table and its summary line, as plain text or Markdown."""
    table = common.markdown_table if markdown else common.text_table
    shape = f"{cfg.hosts} hosts x {cfg.ranks} ranks" if cfg.hosts > 1 else f"{cfg.ranks} ranks"
    parts = []
    for op in cfg.ops:
        rows = [r for r in results if r["op"] == op]
        title = f"### {op}" if markdown else f"== {op} ({shape}, float32) =="
        summary = _summary(op, rows, cfg.libs)
        parts += [title, "", table(_headers(cfg), [_row(r, cfg.world, cfg.libs) for r in rows]), "",
                  f"**Summary:** {summary}" if markdown else f"summary: {summary}", ""]
    return "\n".join(parts)


def preamble(cfg: Config, info: dict[str, str], markdown: bool) -> str:
    lines = [f"command: {common.command_line()}", f"date: {info['date']}",
             f"machine: nproc {info['nproc']}; {info['cpu']}; {info['os']}",
             f"software: torch {info['torch']}, python {info['python']}",
             (f"setup: {cfg.ranks} ranks, ringlet backend {cfg.backend} vs gloo, float32, "
              f"{cfg.repeats} repeats, ~{TARGET_S} s per repeat; latency = median over repeats "
              f"of the slowest rank's mean time per call")]
    if cfg.load:
        lines.append(f"load: {cfg.load} unrelated busy process(es) spinning beside the ranks (--load)")
    if cfg.hosts > 1:
        link = f"links limited to {cfg.link_rate} (tc tbf)" if cfg.link_rate else "links unlimited"
        lines[-1] = (f"setup: {cfg.hosts} simulated hosts (network namespaces, veth + bridge; {link}) x {cfg.ranks} "
                     f"ranks; ringlet auto (shm within a host + tcp between) vs a flat ringlet tcp group vs "
                     f"gloo, float32, {cfg.repeats} repeats, ~{TARGET_S} s per repeat; latency = median "
                     "over repeats of the slowest rank's mean time per call")
    if not markdown:
        return "\n".join(lines) + "\n"
    lines[0] = f"command: `{common.command_line()}`"
    return "# ringlet collectives benchmark\n\n" + "\n".join(f"- {x}" for x in lines) + "\n"


def _child_env() -> dict[str, str]:
    # One host: gloo on loopback, as ringlet's shm is host-local (and needs no DNS).
    return {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    info = common.machine_info()
    print(preamble(cfg, info, markdown=False), flush=True)
    with tempfile.TemporaryDirectory(prefix="ringlet-bench-") as tmp, common.busy_load(cfg.load):
        try:
            if cfg.hosts > 1:
                import _hosts

                values = [_hosts.run_hosts(cfg)]
            else:
                values = common.run_ranks(cfg.ranks, _rank_main, cfg, f"file://{tmp}/gloo-store",
                                          backend=cfg.backend, timeout=cfg.timeout,
                                          op_timeout=cfg.op_timeout, env=_child_env())
        except RuntimeError as e:
            print(f"benchmark failed: {e}", file=sys.stderr)
            return 1
    common.emit(lambda md: render(cfg, values[0], markdown=md), lambda md: preamble(cfg, info, markdown=md),
                cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
