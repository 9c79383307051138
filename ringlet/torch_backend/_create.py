"""The backend's creator: a ringlet group for each group torch makes with backend ``"ringlet"``.

torch calls :func:`create` once per group (the default group, every ``new_group``, every
DeviceMesh axis) on the member ranks only, with the group's own prefixed store, the rank's
position in it, the group's size, timeout and global ranks.  It runs ringlet's rendezvous on
that store (so ranks that disagree on the version are told so, and a missing rank is named),
opens ringlet's transport for the group (``auto``: shared memory among the ranks of a host,
tcp among hosts; ``RINGLET_TORCH_TRANSPORT`` picks another) and returns the torch-facing group.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

__all__ = ["create", "transport_spec"]

TRANSPORT_ENV = "RINGLET_TORCH_TRANSPORT"   # read by ringlet._env.torch_transport


def transport_spec() -> str:
    """The ringlet transport torch's groups run on (``auto`` unless ``RINGLET_TORCH_TRANSPORT``).

    Raises:
        ValueError: the variable names no transport ringlet has.
    """
    from ringlet import _env
    from ringlet.transport import selection

    raw = _env.torch_transport()
    spec = selection.parse_backend(raw)
    if spec.removesuffix(selection.CUDA_NCCL) not in ("auto", "shm", "tcp"):
        raise ValueError(f"{TRANSPORT_ENV}={raw!r}: expected one of ringlet's transports for "
                         "processes (auto, shm, tcp; or nccl: CUDA tensors on torch's NCCL), got "
                         f"{spec!r}")
    return spec


def create(opts: Any, backend_options: Any = None) -> Any:
    """torch's extended creator API: ``opts`` is torch's ``_DistributedBackendOptions``."""
    from ringlet.c10d import debug
    from ringlet.c10d.group import ProcessGroup
    from ringlet.c10d.rendezvous import rendezvous
    from ringlet.torch_backend._group import BACKEND_NAME, RingletProcessGroup
    from ringlet.torch_backend._store import TorchStore
    from ringlet.torch_backend._world import job
    from ringlet.transport import selection

    if backend_options is not None:
        raise ValueError("ringlet backend: init_process_group/new_group: pg_options: torch's "
                         "options objects cannot carry ringlet's settings, expected None, got "
                         f"{type(backend_options).__name__} (choose the transport with "
                         f"{TRANSPORT_ENV}; the timeout is init_process_group's timeout=)")
    rank, size = int(opts.group_rank), int(opts.group_size)
    timeout: timedelta = opts.timeout
    seconds = timeout.total_seconds()
    default = not list(opts.global_ranks_in_group)   # torch gives the default group no list
    ranks = list(opts.global_ranks_in_group) or list(range(size))
    name = str(opts.group_id)
    spec = transport_spec()
    store = TorchStore(opts.store, timeout)
    hosts = rendezvous(store, rank, size, f"{BACKEND_NAME}:{spec}", seconds)
    desc = f"torch group {name}" if ranks != list(range(size)) or name != "0" else "default_pg"
    transport, resolved = selection.open_transport(spec, store, rank, hosts, seconds, desc)
    if default:
        job.start(store, rank)
    reports = job.report_store(store)
    pg = ProcessGroup(name, ranks, rank, transport, seconds, BACKEND_NAME, desc,
                      transport_name=resolved,
                      hang_reporter=lambda g, err: debug.hang_report(reports, g, err),
                      detail_check=debug.detail_check if debug.detail_enabled() else None)
    job.add(pg)
    return RingletProcessGroup(opts.store, pg, default=default)
