"""Collectives benchmark: ringlet (shm by default) against torch.distributed on gloo, in one run.

Usage::

    python bench/collectives.py [--ranks 2]
        [--ops all_reduce,broadcast,all_gather_into_tensor,reduce_scatter_tensor]
        [--min-bytes 8] [--max-bytes 256M] [--factor 4] [--repeats 5] [--backend shm|tcp|auto]
        [--buffers plain,arena] [--no-floor] [--hosts 1 [--link-rate 1gbit]] [--quick] [--load N]
        [--markdown out.md] [--op-timeout 120] [--timeout SECONDS]

``--buffers`` picks ringlet's tensors: ``plain`` (ordinary tensors, copied through the arena's
slots), ``arena`` (``ringlet.distributed.comm_buffer``: in the group's shared memory, read by the
peers in place), or both (the default: two ringlet columns, ``ringlet`` and ``arena``).  gloo
always gets ordinary tensors.  Each size also gets its *memory floor* (``bench/_floor.py``: the
single-process adds and copies of the bytes the collective must move, run by every rank at once)
and every ringlet column's fraction of it (``--no-floor`` skips it).

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
- latency (*batch*): per size and library, a warm-up, then ``iters`` back-to-back calls (enough
  for ~0.2 s, at least 3) started after a barrier; one repeat's time is the slowest rank's mean
  time per call; the reported latency is the median over ``--repeats`` repeats.  Repeats
  alternate which library goes first, so both share the machine's noise.
- *call*: in the same batches, each call is timed on its own; a repeat's value is the slowest
  rank's median call, the reported one the median over repeats (no barrier start, no outliers:
  the cost of one call in a loop that issues them back to back).
- algbw = size / latency; busbw = algbw * factor, factor = 2(n-1)/n for all_reduce,
  (n-1)/n for all_gather/reduce_scatter, 1 for broadcast.  GB/s = 1e9 bytes/s.
- ratio = gloo latency / ringlet latency: above 1 means ringlet is faster.  Each op ends
  with the minimum ratio over sizes >= 64 KiB, and the lowest fraction of the floor at >= 1 MiB.
- floor busbw = busbw at the memory floor's time; "% floor" = floor time / latency.
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
import _floor
import torch

OPS = ("all_reduce", "broadcast", "all_gather_into_tensor", "reduce_scatter_tensor")
BUFFERS = ("plain", "arena")
LIB_OF_BUFFERS = {"plain": "ringlet", "arena": "arena"}
LIBS = ("ringlet", "gloo")
FLOOR_MIN_BYTES = common.MIB    # the summary's fraction of the floor: sizes from here up
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


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--ops", default=",".join(OPS))
    p.add_argument("--min-bytes", type=common.parse_size, default=8)
    p.add_argument("--max-bytes", type=common.parse_size, default=256 * common.MIB)
    p.add_argument("--factor", type=int, default=4, help="size step (default 4x)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--backend", default="shm", help="ringlet backend: shm (default), tcp, auto")
    p.add_argument("--buffers", default=",".join(BUFFERS),
                   help="ringlet's tensors: plain (ordinary), arena (comm_buffer), or both "
                        "(default)")
    p.add_argument("--no-floor", action="store_true", help="skip the memory floor measurement")
    p.add_argument("--hosts", type=int, default=1,
                   help="simulated hosts (network namespaces; root): --ranks per host, auto vs tcp "
                        "vs gloo")
    p.add_argument("--link-rate", default=None, metavar="RATE",
                   help="with --hosts: limit every host's link (tc tbf), e.g. 1gbit (default: "
                        "unlimited)")
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
                      load=a.load,
                      buffers=tuple(b.strip() for b in a.buffers.split(",") if b.strip()),
                      floor=not a.no_floor)
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
    libs = {"ringlet": rdist, "arena": rdist, "gloo": tdist}
    try:
        return [bench_size(cfg, op, size, rank, n, libs) for op in cfg.ops for size in cfg.sizes]
    finally:
        tdist.destroy_process_group()


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


# ---------------------------------------------------------------- report


def _label(cfg: Config, lib: str) -> str:
    if lib == "ringlet":
        return f"ringlet[{cfg.backend}]"
    return "arena" if lib == "arena" else lib


def _headers(cfg: Config, floor: bool) -> list[str]:
    libs, mine = cfg.libs, cfg.mine
    cols = ["size"] + [f"{_label(cfg, x)} us" for x in libs]
    cols += [f"{_label(cfg, x)} busbw GB/s" for x in libs]
    if floor:
        cols += ["floor busbw GB/s"] + [f"{_label(cfg, x)} % floor" for x in mine]
    cols += [f"gloo/{_label(cfg, x)}" for x in mine]
    return cols + (["tcp/auto"] if "tcp" in mine else [])


def _row(r: dict[str, Any], cfg: Config, floor: bool) -> list[str]:
    secs = r["seconds"]
    factor = bus_factor(r["op"], cfg.world)
    row = [common.format_size(r["bytes"])] + [f"{secs[x] * 1e6:.1f}" for x in cfg.libs]
    row += [f"{r['bytes'] / secs[x] * factor / 1e9:.3f}" for x in cfg.libs]
    if floor:
        row += [f"{r['bytes'] / r['floor'] * factor / 1e9:.3f}"]
        row += [f"{100 * r['floor'] / secs[x]:.0f}%" for x in cfg.mine]
    row += [f"{secs['gloo'] / secs[x]:.2f}x" for x in cfg.mine]
    return row + ([f"{secs['tcp'] / secs['auto']:.2f}x"] if "tcp" in cfg.mine else [])


def _latency_rows(rows: list[dict[str, Any]], cfg: Config) -> tuple[list[str], list[list[str]]]:
    """Sizes below SUMMARY_MIN_BYTES: each library's batch (barrier-started) and call times."""
    head = ["size"] + [f"{_label(cfg, x)} {kind} us" for x in cfg.libs
                       for kind in ("batch", "call")]
    body = [[common.format_size(r["bytes"])]
            + [f"{r[key][x] * 1e6:.1f}" for x in cfg.libs for key in ("seconds", "call")]
            for r in rows if r["bytes"] < SUMMARY_MIN_BYTES]
    return head, body


def _summary(op: str, rows: list[dict[str, Any]], cfg: Config) -> str:
    big = [r for r in rows if r["bytes"] >= SUMMARY_MIN_BYTES]
    lo = common.format_size(SUMMARY_MIN_BYTES)
    if not big:
        return f"{op}: no sizes >= {lo} measured"
    parts = []
    pairs = [("gloo", x) for x in cfg.mine] + ([("tcp", "auto")] if "tcp" in cfg.mine else [])
    for other, mine in pairs:
        worst = min(big, key=lambda r: r["seconds"][other] / r["seconds"][mine])
        ratio = worst["seconds"][other] / worst["seconds"][mine]
        parts.append(f"min {other}/{_label(cfg, mine)} over sizes >= {lo}: {ratio:.2f}x "
                     f"(at {common.format_size(worst['bytes'])})")
    large = [r for r in rows if r["bytes"] >= FLOOR_MIN_BYTES and "floor" in r]
    for mine in cfg.mine if large else ():
        worst = min(large, key=lambda r: r["floor"] / r["seconds"][mine])
        parts.append(f"{_label(cfg, mine)} >= {100 * worst['floor'] / worst['seconds'][mine]:.0f}% "
                     f"of the memory floor at sizes >= {common.format_size(FLOOR_MIN_BYTES)} "
                     f"(lowest at {common.format_size(worst['bytes'])})")
    return f"{op}: " + "; ".join(parts)


def render(cfg: Config, results: list[dict[str, Any]], markdown: bool) -> str:
    """Every op's tables and its summary line, as plain text or Markdown."""
    table = common.markdown_table if markdown else common.text_table
    shape = f"{cfg.hosts} hosts x {cfg.ranks} ranks" if cfg.hosts > 1 else f"{cfg.ranks} ranks"
    parts = []
    for op in cfg.ops:
        rows = [r for r in results if r["op"] == op]
        floor = bool(rows) and all("floor" in r for r in rows)
        title = f"### {op}" if markdown else f"== {op} ({shape}, float32) =="
        summary = _summary(op, rows, cfg)
        parts += [title, "", table(_headers(cfg, floor), [_row(r, cfg, floor) for r in rows]), ""]
        head, body = _latency_rows(rows, cfg)
        if body:
            parts += ["Small messages: batch (barrier-started, mean) and call (median) times:", "",
                      table(head, body), ""]
        parts += [f"**Summary:** {summary}" if markdown else f"summary: {summary}", ""]
    return "\n".join(parts)


def preamble(cfg: Config, info: dict[str, str], markdown: bool) -> str:
    lines = [f"command: {common.command_line()}", f"date: {info['date']}",
             f"machine: nproc {info['nproc']}; {info['cpu']}; {info['os']}",
             f"software: torch {info['torch']}, python {info['python']}",
             (f"setup: {cfg.ranks} ranks, ringlet backend {cfg.backend} ({'/'.join(cfg.buffers)} "
              f"tensors) vs gloo, float32, "
              f"{cfg.repeats} repeats, ~{TARGET_S} s per repeat; latency = median over repeats "
              f"of the slowest rank's mean time per call")]
    if cfg.load:
        lines.append(f"load: {cfg.load} unrelated busy process(es) spinning beside the ranks "
                     "(--load)")
    if cfg.hosts > 1:
        link = f"links limited to {cfg.link_rate} (tc tbf)" if cfg.link_rate else "links unlimited"
        lines[-1] = (f"setup: {cfg.hosts} simulated hosts (network namespaces, veth + bridge; "
                     f"{link}) x {cfg.ranks} ranks; ringlet auto (shm within a host + tcp between) "
                     f"vs a flat ringlet tcp group vs gloo, float32, {cfg.repeats} repeats, "
                     f"~{TARGET_S} s per repeat; latency = median over repeats of the slowest "
                     "rank's mean time per call")
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
    common.emit(lambda md: render(cfg, values[0], markdown=md),
                lambda md: preamble(cfg, info, markdown=md), cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
