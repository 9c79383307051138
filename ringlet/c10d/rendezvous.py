"""Rendezvous: turn ``init_method``/env/``store`` into a store, a rank and a world size, then
check that every rank agrees before any transport is built.

Checks (docs/reliability.md, row S5): local nonsense (rank >= world, negative, world 0)
raises ``ValueError`` at once; a rank claimed twice, or ranks that disagree on
world size, backend or ringlet version, fail every rank with a message naming
the field and the ranks; ranks that never arrive are named after the timeout.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
import warnings
from datetime import timedelta
from typing import Any
from urllib.parse import parse_qs, urlparse

from ringlet import _env
from ringlet._version import __version__
from ringlet.errors import DistStoreError

__all__ = ["check_ranks", "host_key", "rendezvous", "store_from_init_method"]

RINGLET_VERSION = __version__


def host_key() -> str:
    """Identifies a host: hostname + network namespace + boot id (simulated hosts differ)."""
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()[:8]
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{netns}/{boot}"


def check_ranks(rank: int, world_size: int) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError("init_process_group: world_size: expected a "
                         f"positive int, got {world_size!r}")
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError("init_process_group: rank: expected 0 "
                         f"<= rank < world_size={world_size}, got {rank!r}")


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    if raw is None:
        raise ValueError(f"init_process_group: environment variable {name} expected (env:// "
                         "rendezvous; set it, or launch with ringlet-run), but it is not set")
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"init_process_group: {name}: expected an int, got {raw!r}") from None


def _check_launcher_agrees(rank: int, world_size: int) -> None:
    """Under a launcher (ringlet-run or torchrun), ``world_size``/``rank`` given explicitly must
    be the launcher's: it started ``WORLD_SIZE`` processes, so a larger world would wait the whole
    timeout for ranks that never come."""
    if not (_env.agent_store() or os.environ.get("TORCHELASTIC_RUN_ID")):
        return
    for arg, name, given in (("world_size", "WORLD_SIZE", world_size), ("rank", "RANK", rank)):
        raw = os.environ.get(name)
        if given >= 0 and raw is not None and raw.strip() != str(given):
            raise ValueError(
                f"init_process_group: {arg}: expected {raw} ({name}, set by the launcher that "
                f"started this process), got {given}; leave {arg} out to take the launcher's, or "
                "launch as many processes as the script expects (--nproc-per-node)")


def store_from_init_method(init_method: str | None, rank: int, world_size: int,
                           timeout: timedelta) -> tuple[Any, int, int]:
    """Build the store for ``init_method`` (env://, tcp://host:port, file://path)."""
    from ringlet.store import FileStore, TCPStore

    url = urlparse(init_method or "env://")
    query = {k: v[-1] for k, v in parse_qs(url.query).items()}
    if "rank" in query:
        rank = int(query["rank"])
    if "world_size" in query:
        world_size = int(query["world_size"])
    if url.scheme == "env":
        _check_launcher_agrees(rank, world_size)
        if rank < 0:
            rank = _env_int("RANK")
        if world_size < 0:
            world_size = _env_int("WORLD_SIZE")
        host = os.environ.get("MASTER_ADDR") or "127.0.0.1"
        port = _env_int("MASTER_PORT")
    elif url.scheme == "tcp":
        if not url.hostname or url.port is None:
            raise ValueError("init_process_group: init_method: expected "
                             f"tcp://host:port, got {init_method!r}")
        host, port = url.hostname, url.port
    elif url.scheme == "file":
        check_ranks(rank, world_size)
        path = url.path or url.netloc
        return FileStore(path, world_size), rank, world_size
    else:
        raise ValueError(f"init_process_group: init_method: expected env://, tcp:// or file://, "
                         f"got {init_method!r}")
    check_ranks(rank, world_size)
    as_client = _env.agent_store()
    store = TCPStore(host, port, world_size, is_master=(rank == 0 and not as_client),
                     timeout=timeout, wait_for_workers=False)
    return store, rank, world_size


def rendezvous(store: Any, rank: int, world_size: int, backend: str, timeout: float) -> list[str]:
    """Every rank announces itself; returns each rank's host key.  See the module docstring."""
    if rank == 0:
        warn_nccl_without_cuda(backend)
    me = {"host": host_key(), "hostname": socket.gethostname(), "pid": os.getpid(),
          "world_size": world_size, "backend": backend, "version": RINGLET_VERSION,
          "nonce": secrets.token_hex(8)}
    mine = json.dumps(me, sort_keys=True).encode()
    got = store.compare_set(f"rdzv/rank/{rank}", b"", mine)
    if got != mine:
        other = json.loads(got)
        msg = (f"init_process_group: rank {rank} was claimed twice: by pid {other['pid']} on "
               f"{other['hostname']} and by pid {me['pid']} on {me['hostname']} (two "
               "processes with the same RANK?)")
        store.set("rdzv/error", msg)
        raise ValueError(msg)
    deadline = time.monotonic() + timeout
    infos: dict[int, dict[str, Any]] = {rank: me}
    delay = 0.002
    while len(infos) < world_size:
        if store.check(["rdzv/error"]):
            raise ValueError(store.get("rdzv/error").decode())
        for r in range(world_size):
            if r not in infos and store.check([f"rdzv/rank/{r}"]):
                infos[r] = json.loads(store.get(f"rdzv/rank/{r}"))
                _compare(store, rank, me, r, infos[r])
        if len(infos) == world_size:
            break
        if time.monotonic() > deadline:
            missing = [r for r in range(world_size) if r not in infos]
            raise DistStoreError(f"init_process_group: rank {rank}: {len(infos)}/{world_size} "
                                 f"ranks joined within {timeout:.1f} s, missing ranks {missing}",
                                 rank=rank, missing=missing)
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
    return [infos[r]["host"] for r in range(world_size)]


_told_nccl = False


def warn_nccl_without_cuda(backend: str) -> None:
    """Once per process (rank 0): NCCL was asked for on a machine without CUDA.  ringlet's
    ``nccl`` also serves CPU tensors (on its own transport), so such a job runs -- entirely on the
    CPU, which a user who expected GPUs should hear about."""
    global _told_nccl
    if _told_nccl or "nccl" not in backend:
        return
    import torch

    if torch.cuda.is_available():
        return
    _told_nccl = True
    warnings.warn(
        f"init_process_group: backend {backend!r} sends CUDA tensors to NCCL, but this machine "
        "has no usable CUDA device (torch.cuda.is_available() is False): every tensor is a CPU "
        "tensor and the job runs on ringlet's CPU transport, not on GPUs; pass backend='gloo' "
        "for CPU training, or check the CUDA driver and CUDA_VISIBLE_DEVICES", stacklevel=4)


def _compare(store: Any, rank: int, me: dict[str, Any], r: int, other: dict[str, Any]) -> None:
    for field in ("world_size", "backend", "version"):
        if other[field] != me[field]:
            msg = (f"init_process_group: ranks disagree on {field}: rank {rank} has {me[field]!r}, "
                   f"rank {r} has {other[field]!r}")
            store.set("rdzv/error", msg)
            raise ValueError(msg)
