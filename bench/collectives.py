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
import sys
from collections.abc import Sequence
from typing import Any

import _common as common
from _collective_timing import BUFFERS, OPS, TARGET_S, Config, rank_main

FLOOR_MIN_BYTES = common.MIB    # the summary's fraction of the floor: sizes from here up
QUICK_SIZES = (8, 4 * common.KIB, 64 * common.KIB, common.MIB, 16 * common.MIB)
SUMMARY_MIN_BYTES = 64 * common.KIB


def bus_factor(op: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (doc/PERFORMANCE.md there)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        return (n - 1) / n
    return 1.0


def parse_args(argv: Sequence[str] | None = None) -> Config:
    p = common.parser(__doc__, op_timeout=120.0)
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
    return common.parse(p, argv, _config)


def _config(a: argparse.Namespace) -> Config:
    """The run's configuration (the default backstop: 120 s + 60 s per op and size)."""
    if a.quick:
        sizes = [s for s in QUICK_SIZES if a.min_bytes <= s <= a.max_bytes]
    else:
        sizes = common.size_sweep(a.min_bytes, a.max_bytes, a.factor)
    ops = common.names(a.ops, "--ops", OPS)
    timeout = 120.0 + 60.0 * len(ops) * len(sizes) if a.timeout is None else a.timeout
    return Config(ranks=a.ranks, ops=ops, sizes=tuple(sizes), repeats=a.repeats,
                  backend="auto" if a.hosts > 1 else a.backend, op_timeout=a.op_timeout,
                  timeout=timeout, markdown=a.markdown, hosts=a.hosts, link_rate=a.link_rate,
                  load=a.load, buffers=common.names(a.buffers, "--buffers", BUFFERS),
                  floor=not a.no_floor)


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
    timing = (f"{cfg.repeats} repeats, ~{TARGET_S} s per repeat; latency = median over repeats "
              "of the slowest rank's mean time per call")
    setup = [(f"setup: {cfg.ranks} ranks, ringlet backend {cfg.backend} "
              f"({'/'.join(cfg.buffers)} tensors) vs gloo, float32, {timing}")]
    if cfg.hosts > 1:
        link = f"links limited to {cfg.link_rate} (tc tbf)" if cfg.link_rate else "links unlimited"
        setup = [(f"setup: {cfg.hosts} simulated hosts (network namespaces, veth + bridge; "
                  f"{link}) x {cfg.ranks} ranks; ringlet auto (shm within a host + tcp between) "
                  f"vs a flat ringlet tcp group vs gloo, float32, {timing}")]
    if cfg.load:
        setup.append(f"load: {cfg.load} unrelated busy process(es) spinning beside the ranks "
                     "(--load)")
    return common.preamble("ringlet collectives benchmark", setup, info, markdown)


def main(argv: Sequence[str] | None = None) -> int:
    cfg = parse_args(argv)
    info = common.machine_info()
    print(preamble(cfg, info, markdown=False), flush=True)
    with common.busy_load(cfg.load):
        if cfg.hosts > 1:
            import _hosts

            try:
                values: list[Any] | None = [_hosts.run_hosts(cfg)]
            except RuntimeError as e:
                print(f"benchmark failed: {e}", file=sys.stderr)
                values = None
        else:
            values = common.run_beside_gloo(cfg.ranks, rank_main, cfg, backend=cfg.backend,
                                            timeout=cfg.timeout, op_timeout=cfg.op_timeout)
    if values is None:
        return 1
    common.emit(lambda md: render(cfg, values[0], markdown=md),
                lambda md: preamble(cfg, info, markdown=md), cfg.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
