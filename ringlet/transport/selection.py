"""Transport selection: the backend-string grammar and the one factory that opens a group's
transport.

The process-group layer never names a concrete transport: it canonicalises the user's
``backend`` string with :func:`parse_backend` (once, at ``init_process_group``/``new_group``)
and asks :func:`open_transport` for the transport of each group it builds.  Everything that
knows which classes exist -- ``shm``, ``tcp``, ``shm+tcp`` (hierarchical), ``inproc``, torch's
engines, the per-device split, and transports that users register -- lives here.

Grammar (case-insensitive)::

    auto | shm | tcp | inproc          ringlet's own (auto: shm on one host, tcp across hosts,
                                       shm within each host + tcp among hosts otherwise)
    gloo | mpi | undefined             -> auto   (torch's CPU names run on ringlet's transports)
    nccl                               -> auto,cuda:nccl   (CUDA tensors on torch's NCCL, CPU
                                       tensors on auto: a superset of torch's "nccl")
    torch:gloo | torch:nccl            torch's own engines through the adapter
    <registered name>                  a transport registered with register_transport
    cpu:<name>,cuda:nccl               CPU tensors on <name>, CUDA tensors on torch's NCCL
    cpu:torch:gloo,cuda:torch:nccl     -> torch:gloo,nccl (both on torch's engines)

Canonical names are what :func:`open_transport` takes (``auto,cuda:nccl`` for the split).

Where CUDA is available, ringlet's own transports also serve CUDA tensors by staging them
through host memory (``staging.py``), as torch's gloo does: ``"gloo"`` accepts CUDA tensors, and
several ranks can share one GPU.  Without CUDA nothing is wrapped (no cost on CPU machines).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch

from ringlet.errors import DistBackendError
from ringlet.transport.base import Transport

__all__ = ["CUDA_NCCL", "TransportOptions", "is_registered", "open_transport", "parse_backend",
           "register_transport", "registered_names"]

CUDA_NCCL = ",cuda:nccl"     # suffix of a canonical name whose CUDA tensors go to torch's NCCL
OURS = ("auto", "shm", "tcp", "inproc")
TORCH_CPU_NAMES = ("gloo", "mpi", "undefined")


@dataclasses.dataclass(frozen=True)
class _Registered:
    name: str
    factory: Callable[..., Any]
    devices: tuple[str, ...]
    extended_api: bool


@dataclasses.dataclass
class TransportOptions:
    """What a registered ``extended_api`` factory receives (torch's
    ``_DistributedBackendOptions``)."""

    store: Any
    group_rank: int
    group_size: int
    timeout: timedelta
    group_id: str


_registry: dict[str, _Registered] = {}
_lock = threading.Lock()


def register_transport(name: str, factory: Callable[..., Any], devices: Sequence[str] = ("cpu",),
                       extended_api: bool = False) -> None:
    """Make ``backend=name`` open a transport built by ``factory`` (see :func:`open_transport`).

    ``factory(store, rank, world_size, timeout)`` -- or, with ``extended_api``,
    ``factory(TransportOptions, None)`` -- is called on every rank of each group created with
    this backend and must return a :class:`ringlet.transport.base.Transport`.

    Raises:
        ValueError: ``name`` is empty, has ``:``/``,``, or is one of ringlet's or torch's own names.
    """
    key = name.strip().lower() if isinstance(name, str) else ""
    if not key or ":" in key or "," in key:
        raise ValueError("register_backend: name: expected a plain name such as 'mytransport', got "
                         f"{name!r}")
    if key in OURS or key in TORCH_CPU_NAMES or key in ("nccl", "ucc", "xccl"):
        raise ValueError(f"register_backend: {name!r} is a built-in backend name; choose another")
    if not callable(factory):
        raise TypeError("register_backend: func: expected a callable, got "
                        f"{type(factory).__name__}")
    with _lock:
        if key in _registry:
            raise ValueError(f"register_backend: backend {key!r} is already registered")
        _registry[key] = _Registered(key, factory, tuple(devices), extended_api)


def is_registered(name: str) -> bool:
    return name.strip().lower() in _registry


def registered_names() -> list[str]:
    return sorted(_registry)


def _bad_backend(backend: Any) -> ValueError:
    names = (*OURS, "gloo", "torch:gloo", "torch:nccl", *registered_names())
    return ValueError(f"init_process_group: backend: expected one of {names} or a per-device "
                      f"string like 'cpu:gloo,cuda:nccl', got {backend!r}")


def parse_backend(backend: str | None) -> str:
    """The canonical name of a ``backend`` string (grammar in the module docstring).

    Raises:
        ValueError: an unknown name or a malformed per-device string.
    """
    name = (backend or "auto").strip().lower()
    if "," in name or name.split(":", 1)[0] in ("cpu", "cuda"):
        return _parse_per_device(name, backend)
    if name in TORCH_CPU_NAMES:
        return "auto"   # ringlet's own transports serve CPU tensors (docs/usage.md)
    if name == "nccl":
        return f"auto{CUDA_NCCL}"   # NCCL is built at the first CUDA tensor (docs/gpu.md)
    if name in ("torch:gloo", "torch:nccl") or name in OURS or name in _registry:
        return name
    raise _bad_backend(backend)


def _parse_per_device(name: str, backend: str | None) -> str:
    """``cpu:X,cuda:nccl`` and friends (see the module docstring)."""
    parts: dict[str, str] = {}
    for part in name.split(","):
        dev, sep, val = part.strip().partition(":")
        if not sep or dev not in ("cpu", "cuda") or not val:
            raise ValueError("init_process_group: backend: expected 'device:backend' entries such "
                             f"as 'cpu:torch:gloo,cuda:torch:nccl', got {backend!r}")
        parts[dev] = val
    cpu, cuda = parts.get("cpu", "auto"), parts.get("cuda")
    if cpu in ("nccl", "torch:nccl"):
        raise ValueError("init_process_group: backend: nccl serves CUDA tensors, not 'cpu' "
                         f"({backend!r})")
    if cuda is not None and cuda not in ("nccl", "torch:nccl"):
        raise ValueError("init_process_group: backend: cuda: expected 'nccl' (torch's NCCL engine, "
                         f"through ringlet's adapter), got {cuda!r} in {backend!r}")
    if cpu == "torch:gloo":
        return "torch:gloo,nccl" if cuda else "torch:gloo"
    if cpu.startswith(("cpu:", "cuda:")):
        raise ValueError("init_process_group: backend: expected 'device:backend' entries, got "
                         f"{backend!r}")
    base = parse_backend(cpu)
    return f"{base}{CUDA_NCCL}" if cuda else base


def resolve_auto(hosts: Sequence[str]) -> str:
    """What ``auto`` means for ranks on ``hosts`` (one host key per rank of the group)."""
    distinct = len(set(hosts))
    return "shm" if distinct == 1 else "tcp" if distinct == len(hosts) else "shm+tcp"


def open_transport(spec: str, store: Any, rank: int, hosts: Sequence[str], timeout: float,
                   desc: str) -> tuple[Transport, str]:
    """Open the transport of one group; every rank of the group calls this with the same ``spec``.

    Args:
        spec: a canonical name (:func:`parse_backend`).
        store: the group's own store (already prefixed).
        rank: this rank's position in the group.
        hosts: one host key per rank of the group (from the rendezvous), in group order.
        timeout: seconds every blocking step of the set-up may take.
        desc: the group's description, for error messages.

    Returns:
        (the transport, the name of what was opened, e.g. ``"shm"`` for ``auto`` on one host).
    """
    if spec.endswith(CUDA_NCCL):
        return _open_split(spec.removesuffix(CUDA_NCCL), store, rank, hosts, timeout, desc)
    transport, resolved = _open_one(spec, store, rank, hosts, timeout, desc)
    if resolved in _OWN_RESOLVED and _cuda_available():
        from ringlet.transport.split import DeviceSplitTransport
        from ringlet.transport.staging import HostStagedTransport

        main = transport
        transport = DeviceSplitTransport(main, {"cuda": lambda: HostStagedTransport(main)},
                                         f"{resolved},cuda:staged")
    return transport, resolved


_OWN_RESOLVED = ("shm", "inproc", "tcp", "shm+tcp")   # ringlet's CPU transports (staging.py)


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _open_one(spec: str, store: Any, rank: int, hosts: Sequence[str], timeout: float,
              desc: str) -> tuple[Transport, str]:
    """One transport for ``spec`` (not a per-device split), with no staging of device tensors."""
    resolved = resolve_auto(hosts) if spec == "auto" else spec
    n = len(hosts)
    if resolved == "shm":
        from ringlet.transport.shm import ShmTransport

        return ShmTransport.create(store, rank, n, timeout, desc), resolved
    if resolved == "inproc":
        from ringlet.transport.inproc import InprocTransport

        return InprocTransport.create(store, rank, n, timeout, desc), resolved
    if resolved == "tcp":
        from ringlet.transport.tcp import TcpTransport

        return TcpTransport.create(store, rank, n, timeout, desc, host_keys=list(hosts)), resolved
    if resolved == "shm+tcp":
        from ringlet.transport.hierarchical import HierarchicalTransport

        return HierarchicalTransport.create(store, rank, list(hosts), timeout, desc), resolved
    if resolved.startswith("torch:"):
        from ringlet.transport.torch_engine import TorchEngineTransport

        return TorchEngineTransport.create(store, rank, n, timeout, desc, resolved), resolved
    reg = _registry.get(resolved)
    if reg is not None:
        return _open_registered(reg, store, rank, n, timeout, desc), resolved
    raise DistBackendError(f"group {desc}: expected a known transport, got {resolved!r}")


def _open_split(base: str, store: Any, rank: int, hosts: Sequence[str], timeout: float,
                desc: str) -> tuple[Transport, str]:
    """CPU tensors on ``base``, CUDA tensors on torch's NCCL, built at their first use."""
    from ringlet.store import PrefixStore
    from ringlet.transport.split import DeviceSplitTransport

    main, resolved = _open_one(base, store, rank, hosts, timeout, desc)
    cuda_store = PrefixStore("cuda", store)
    n = len(hosts)

    def nccl() -> Transport:     # at the first CUDA tensor: no torch.distributed import before
        from ringlet.transport.torch_engine import TorchEngineTransport

        return TorchEngineTransport.create(cuda_store, rank, n, timeout, desc, "torch:nccl")
    name = f"{resolved},cuda:torch:nccl"
    return DeviceSplitTransport(main, {"cuda": nccl}, name, stream_ordered=("cuda",)), name


def _open_registered(reg: _Registered, store: Any, rank: int, n: int, timeout: float,
                     desc: str) -> Transport:
    td = timedelta(seconds=timeout)
    if reg.extended_api:
        made = reg.factory(TransportOptions(store, rank, n, td, desc), None)
    else:
        made = reg.factory(store, rank, n, td)
    if not isinstance(made, Transport):
        raise TypeError(f"backend {reg.name!r}: the registered creator returned "
                        f"{type(made).__name__}; expected a ringlet.transport.base.Transport (see "
                        "docs/usage.md, 'Custom backends')")
    if "devices" not in vars(made) and type(made).devices == Transport.devices:
        made.devices = reg.devices
    return made
