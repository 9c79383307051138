"""Checkpoint benchmark: ringlet's sharded save/load against torch.distributed.checkpoint (gloo).

Usage::

    MALLOC_MMAP_THRESHOLD_=131072 python bench/checkpoint.py [--ranks 2] [--mib 100] [--rounds 3]
        [--repeats 2] [--no-sync] [--markdown out.md]

(the malloc setting returns freed memory to the OS, so that resident memory tracks allocations)

State: ``--mib`` MiB of float32 in 8 MiB tensors ``[1024, 2048]`` (plus a 2 MiB one), each a
DTensor sharded on dim 0 over the ranks (what fully_shard holds), and a replicated step
counter.  Each mode runs in its own world of ``--ranks`` processes (forkserver, one torch thread
each): ``ringlet`` saves and loads with ``ringlet.distributed.checkpoint`` over ringlet's shm
group; ``torch`` builds the same state with torch's DTensor and uses
``torch.distributed.checkpoint`` over gloo.  Both write to a fresh directory under the system
temp dir with their defaults (fsync on; ``--no-sync`` turns it off for both).

Each mode runs in ``--repeats`` worlds, the order of the modes alternating between repeats (the
disk's write-back state is noise both should share).  Per round: barrier, ``save`` (timed), barrier,
``load`` into zero-filled DTensors of the same layout (timed), check that every element came back.
A time is the slowest rank's; the result is the median over all rounds of all worlds.  Throughput
per rank = the bytes a rank holds / time.

Peak extra memory: in a separate, untimed round, a thread samples the process's anonymous
resident memory (``RssAnon`` in /proc/self/status) every millisecond during ``save`` and
``load``; reported is the peak minus the value just before the call (max over ranks).  The
largest tensor's shard is printed next to it (the target: extra save memory <= that).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from typing import Any

import _common as common
import torch

MODES = ("ringlet", "torch")


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class _Peak:
    """Sample RssAnon every millisecond while the block runs; ``extra`` = peak - start."""

    def __enter__(self) -> _Peak:  # noqa: PYI034 - no typing.Self (Python 3.10)
        self.start = self.peak = _rss_anon()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_anon())

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join(5)
        self.peak = max(self.peak, _rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _shapes(mib: int) -> list[tuple[int, int]]:
    n8, rest = divmod(mib, 8)
    return [(1024, 2048)] * n8 + ([(rest * 128, 2048)] if rest else [])


def _world(rank: int, n: int, mode: str, mib: int, rounds: int, sync: bool,
           root: str) -> dict[str, Any]:
    if mode == "torch":
        import torch.distributed as tdist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        tdist.init_process_group("gloo", init_method=f"file://{root}/rdzv", rank=rank, world_size=n)
        barrier = tdist.barrier
    else:
        import ringlet.distributed as rdist
        import ringlet.distributed.checkpoint as dcp
        from ringlet.distributed.checkpoint import FileSystemReader, FileSystemWriter
        from ringlet.distributed.tensor import Shard, distribute_tensor, init_device_mesh

        barrier = rdist.barrier
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(0)
    fulls = [torch.randn(s, generator=g) for s in _shapes(mib)]

    def state(zero: bool) -> dict[str, Any]:
        return {"model": {f"layer{i}.weight": distribute_tensor(torch.zeros_like(f) if zero else f,
                                                                mesh, [Shard(0)])
                          for i, f in enumerate(fulls)}, "step": torch.tensor(7 if not zero else 0)}

    src = state(False)
    held = sum(t.to_local().nbytes for t in src["model"].values())
    largest_shard = max(t.to_local().nbytes for t in src["model"].values())
    out: dict[str, Any] = {"save": [], "load": [], "held": held, "largest_shard": largest_shard}
    for r in range(rounds + 1):
        path = os.path.join(root, f"{mode}-{r}")
        dst = state(True)
        barrier()
        with _Peak() as ps:
            t0 = time.perf_counter()
            dcp.save(src, storage_writer=FileSystemWriter(path, sync_files=sync))
            t_save = time.perf_counter() - t0
        barrier()
        with _Peak() as pl:
            t0 = time.perf_counter()
            dcp.load(dst, storage_reader=FileSystemReader(path))
            t_load = time.perf_counter() - t0
        ok = all(torch.equal(a.to_local(), b.to_local())
                 for a, b in zip(src["model"].values(), dst["model"].values(), strict=True))
        if not ok or int(dst["step"]) != 7:
            raise AssertionError(f"{mode}: the loaded state differs from the saved one")
        if r == rounds:          # the last round samples memory (not timed)
            out["save_extra"], out["load_extra"] = ps.extra, pl.extra
        else:
            out["save"].append(t_save)
            out["load"].append(t_load)
        barrier()
        if rank == 0:
            shutil.rmtree(path, ignore_errors=True)
    if mode == "torch":
        tdist.destroy_process_group()
    return out


def _run_world(mode: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix=f"ringlet-bench-ckpt-{mode}-")
    try:
        return common.run_ranks(args.ranks, _world, mode, args.mib, args.rounds,
                                not args.no_sync, root,
                                backend="shm", timeout=600.0, op_timeout=300.0)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _summary(worlds: list[list[dict[str, Any]]]) -> dict[str, Any]:
    """Median over every round of every world of the slowest rank's time; max of the memory
    peaks."""
    save = common.median([max(p["save"][i] for p in w) for w in worlds
                          for i in range(len(w[0]["save"]))])
    load = common.median([max(p["load"][i] for p in w) for w in worlds
                          for i in range(len(w[0]["load"]))])
    held = worlds[0][0]["held"]
    return {"save_s": save, "load_s": load, "save_mbs": held / save / 1e6,
            "load_mbs": held / load / 1e6,
            "save_extra": max(p["save_extra"] for w in worlds for p in w),
            "load_extra": max(p["load_extra"] for w in worlds for p in w),
            "largest_shard": worlds[0][0]["largest_shard"], "held": held}


def main() -> int:
    p = common.parser(__doc__)
    p.add_argument("--mib", type=int, default=100, help="state size in MiB (float32)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per world")
    p.add_argument("--repeats", type=int, default=2, help="worlds per mode, in alternating order")
    p.add_argument("--no-sync", action="store_true", help="no fsync (both libraries)")
    args = p.parse_args()
    worlds: dict[str, list[Any]] = {m: [] for m in MODES}
    # alternate the order: the disk's state is shared noise
    for rep in range(args.repeats):
        for mode in (MODES if rep % 2 == 0 else MODES[::-1]):
            worlds[mode].append(_run_world(mode, args))
    res = {m: _summary(w) for m, w in worlds.items()}
    r, t = res["ringlet"], res["torch"]
    mib = 1 << 20

    def render(md: bool) -> str:
        headers = ["", "ringlet", "torch DCP", "ringlet / torch"]
        rows = [["save, MB/s per rank", f"{r['save_mbs']:.0f}", f"{t['save_mbs']:.0f}",
                 f"{r['save_mbs'] / t['save_mbs']:.2f}x"],
                ["load, MB/s per rank", f"{r['load_mbs']:.0f}", f"{t['load_mbs']:.0f}",
                 f"{r['load_mbs'] / t['load_mbs']:.2f}x"],
                ["save, s", f"{r['save_s']:.3f}", f"{t['save_s']:.3f}", ""],
                ["load, s", f"{r['load_s']:.3f}", f"{t['load_s']:.3f}", ""],
                ["extra memory during save, MiB", f"{r['save_extra'] / mib:.1f}",
                 f"{t['save_extra'] / mib:.1f}", ""],
                ["extra memory during load, MiB", f"{r['load_extra'] / mib:.1f}",
                 f"{t['load_extra'] / mib:.1f}", ""],
                ["largest tensor's shard, MiB", f"{r['largest_shard'] / mib:.1f}", "", ""]]
        return (common.markdown_table if md else common.text_table)(headers, rows)

    line = common.provenance(f"{args.ranks} ranks, {r['held'] / mib:.0f} MiB held per rank, "
                             f"fsync {'off' if args.no_sync else 'on'}")
    print(line)
    common.emit(render, lambda md: line, args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
