"""``bench/collectives.py --hosts H``: the benchmark across simulated hosts (network namespaces).

The parent builds ``H`` hosts on one bridge (``tests/netns.py``'s ``SimNet``: 10.77.0.1..H, needs
root and ``ip``) and starts ``--ranks`` processes per host with ``ip netns exec``; each runs
:func:`worker` below, which measures with ``_collective_timing`` as the ranks of one host do (so
this module and ``collectives.py`` do not import each other).  Rank 0 hosts ringlet's TCPStore
on host 0's address; every rank joins ringlet's default group (``auto``: shm within a host, tcp
between hosts), a flat ``tcp`` group of the same ranks, and torch's gloo (its FileStore in the
run's folder; gloo on the host's veth).  Rank 0 writes the results as JSON for the parent, which
kills and reaps every process and removes the namespaces whatever happens.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def _simnet() -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    import netns

    return netns


def run_hosts(cfg: Any) -> list[dict[str, Any]]:
    """Run the benchmark on ``cfg.hosts`` simulated hosts; returns rank 0's results."""
    netns = _simnet()
    problem = netns.netns_problem()
    if problem:
        raise RuntimeError(f"--hosts needs network namespaces: {problem}")
    world = cfg.hosts * cfg.ranks
    with (tempfile.TemporaryDirectory(prefix="ringlet-bench-hosts-") as out,
          netns.SimNet(cfg.hosts) as net):
        (Path(out) / "cfg.json").write_text(json.dumps(dataclasses.asdict(cfg)))
        if cfg.link_rate:
            for i in range(cfg.hosts):
                net.shape(i, cfg.link_rate)
        for rank in range(world):
            host = rank // cfg.ranks
            env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), str(HERE)]),
                       OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME=net.veth(host))
            net.start(host, [sys.executable, str(HERE / "_hosts.py"), str(rank), str(world), out,
                             net.addrs[0]], env=env, log=os.path.join(out, f"log{rank}"))
        codes = net.wait_all(cfg.timeout)
        result = Path(out) / "result.json"
        if codes != [0] * world or not result.exists():
            logs = "\n".join(f"--- rank {r}\n{(Path(out) / f'log{r}').read_text()[-2000:]}"
                             for r in range(world))
            raise RuntimeError(f"ranks ended with {codes}:\n{logs}")
        return list(json.loads(result.read_text()))


def _store(rank: int, out: str, master: str) -> Any:
    from ringlet.store import TCPStore

    port_file = Path(out) / "port"
    if rank == 0:
        store = TCPStore(master, 0, None, is_master=True, timeout=timedelta(seconds=120),
                         wait_for_workers=False)
        (Path(out) / "port.tmp").write_text(str(store.port))
        os.replace(Path(out) / "port.tmp", port_file)
        return store
    deadline = time.monotonic() + 120
    while not port_file.exists():
        if time.monotonic() > deadline:
            raise TimeoutError("rank 0 never published the store's port")
        time.sleep(0.02)
    return TCPStore(master, int(port_file.read_text()), None, timeout=timedelta(seconds=120))


class _Grouped:
    """``ringlet.distributed`` with ``group=`` bound: the flat tcp group behind the same API."""

    def __init__(self, lib: Any, group: Any) -> None:
        self._lib, self._group = lib, group

    def __getattr__(self, name: str) -> Any:
        fn = getattr(self._lib, name)
        return lambda *a, **k: fn(*a, group=self._group, **k)


def worker(rank: int, world: int, out: str, master: str) -> None:
    import _collective_timing as timing
    import torch
    import torch.distributed as tdist

    import ringlet.distributed as rdist

    torch.set_num_threads(1)
    raw = json.loads((Path(out) / "cfg.json").read_text())
    cfg = timing.Config(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    td = timedelta(seconds=cfg.op_timeout)
    store = _store(rank, out, master)
    rdist.init_process_group("auto", store=store, rank=rank, world_size=world, timeout=td)
    flat = rdist.new_group(backend="tcp")
    tdist.init_process_group("gloo", init_method=f"file://{out}/gloo", rank=rank,
                             world_size=world, timeout=td)
    libs = {"auto": rdist, "tcp": _Grouped(rdist, flat), "gloo": tdist}
    try:
        results = [timing.bench_size(cfg, op, size, rank, world, libs)
                   for op in cfg.ops for size in cfg.sizes]
        if rank == 0:
            (Path(out) / "result.json").write_text(json.dumps(results))
        rdist.barrier()
    finally:
        tdist.destroy_process_group()
        rdist.destroy_process_group()
        if rank == 0:
            time.sleep(0.5)     # let the others leave before the store goes
        store.close()


if __name__ == "__main__":
    worker(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
