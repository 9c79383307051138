"""``Backend`` (names, ``register_backend``) and the ``is_*_available`` queries.

Names mean what ``init_process_group`` does with them (``ringlet.transport.selection``):
``gloo`` runs on ringlet's own transports (``auto``), ``nccl`` is torch's NCCL engine for CUDA
tensors (``cpu:gloo,cuda:nccl``), ``auto``/``shm``/``tcp``/``inproc`` are ringlet's.  A backend
registered with :meth:`Backend.register_backend` is a ringlet transport that the user wrote.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar

import torch

from ringlet.transport import selection

__all__ = ["Backend", "is_backend_available", "is_gloo_available", "is_mpi_available",
           "is_nccl_available", "is_ucc_available", "is_xccl_available"]


class Backend(str):
    """A backend name, lower case: ``Backend("GLOO") == "gloo"``; unknown names pass through.

    Example (a transport of your own, see docs/usage.md "Custom backends")::

        class MyTransport(ringlet.transport.base.Transport): ...
        dist.Backend.register_backend("mine", lambda store, rank, size, timeout: MyTransport(...))
        dist.init_process_group("mine")

    Raises:
        ValueError: ``name`` is not a string.
    """

    UNDEFINED = "undefined"
    GLOO = "gloo"
    NCCL = "nccl"
    UCC = "ucc"
    MPI = "mpi"
    XCCL = "xccl"
    AUTO = "auto"
    SHM = "shm"
    TCP = "tcp"
    INPROC = "inproc"

    backend_list: ClassVar[list[str]] = [UNDEFINED, GLOO, NCCL, XCCL, UCC, MPI, AUTO, SHM, TCP,
                                         INPROC]
    default_device_backend_map: ClassVar[dict[str, str]] = {"cpu": GLOO, "cuda": NCCL}
    backend_capability: ClassVar[dict[str, list[str]]] = {
        GLOO: ["cpu", "cuda"], NCCL: ["cuda"], AUTO: ["cpu", "cuda"], SHM: ["cpu", "cuda"],
        TCP: ["cpu", "cuda"], INPROC: ["cpu"],
    }

    def __new__(cls, name: str) -> Backend:  # noqa: PYI034 - no typing.Self (Python 3.10)
        if not isinstance(name, str):   # torch raises ValueError here, scripts catch that
            raise ValueError(f"Backend name must be a string, but got: {name!r}")  # noqa: TRY004
        return super().__new__(cls, name.strip().lower())

    @classmethod
    def register_backend(cls, name: str, func: Callable[..., Any], extended_api: bool = False,
                         devices: str | list[str] | None = None) -> None:
        """Register ``func`` as the creator of backend ``name`` (torch's signature).

        Args:
            name: the name ``init_process_group(backend=name)`` / ``new_group`` will take.
            func: ``func(store, group_rank, group_size, timeout)`` returning a
                :class:`ringlet.transport.base.Transport`; with ``extended_api=True``,
                ``func(options, None)`` where ``options`` has ``store``, ``group_rank``,
                ``group_size``, ``timeout`` and ``group_id``.
            devices: device types its tensors may live on (default ``"cpu"``).

        Raises:
            ValueError: ``name`` is taken or is a built-in name.
        """
        devs = [devices] if isinstance(devices, str) else list(devices or ["cpu"])
        selection.register_transport(name, func, devs, extended_api)
        key = name.strip().lower()
        setattr(cls, key.upper(), key)
        cls.backend_list.append(key)
        cls.backend_capability[key] = devs


def is_gloo_available() -> bool:
    """True: ``gloo`` runs on ringlet's own transports, always present."""
    return True


def is_nccl_available() -> bool:
    """Whether torch was built with NCCL (``nccl`` runs on torch's engine through the adapter)."""
    return hasattr(torch._C, "_nccl_version")


def is_mpi_available() -> bool:
    """False: there is no MPI backend; ``gloo``/``auto`` serve CPU tensors."""
    return False


def is_ucc_available() -> bool:
    """False: there is no UCC backend."""
    return False


def is_xccl_available() -> bool:
    """False: XPU collectives are not supported."""
    return False


def is_backend_available(backend: str) -> bool:
    """Whether ``init_process_group(backend)`` can work here (registered backends included)."""
    name = str(backend).strip().lower()
    checks = {"gloo": is_gloo_available, "nccl": is_nccl_available, "mpi": is_mpi_available,
              "ucc": is_ucc_available, "xccl": is_xccl_available}
    if name in checks:
        return checks[name]()
    try:
        selection.parse_backend(name)
    except ValueError:
        return False
    return True
