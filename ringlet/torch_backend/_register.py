"""Registering ``"ringlet"`` with torch (done by ``import ringlet``; cheap: nothing of ringlet's
c10d is imported until torch creates a group)."""

from __future__ import annotations

from typing import Any

__all__ = ["create", "make_default", "register"]


def create(opts: Any, backend_options: Any = None) -> Any:
    """torch's creator for backend ``"ringlet"`` (see ``ringlet/torch_backend/_create.py``)."""
    from ringlet.torch_backend._create import create as _create

    return _create(opts, backend_options)


def register() -> None:
    """Make ``torch.distributed.init_process_group("ringlet")`` (and ``new_group(backend=
    "ringlet")``) run on ringlet's transports.  Idempotent; ``import ringlet`` calls it.

    The name is added to torch's backends for CPU and CUDA tensors; torch's defaults per device
    (``gloo`` for CPU, ``nccl`` for CUDA) are left as they are: ``"gloo"`` keeps meaning torch's
    gloo.
    """
    import torch.distributed as tdist

    from ringlet import _env

    if not tdist.is_available():
        return
    if "ringlet" not in tdist.Backend.backend_list:
        tdist.Backend.register_backend("ringlet", create, extended_api=True,
                                       devices=["cpu", "cuda"])
    if _env.torch_default():
        make_default()


def make_default() -> None:
    """Make ``"ringlet"`` torch's default CPU backend in this process, for a torch program that
    names none (``init_process_group()``); what ``ringlet-run --torch-backend`` asks of its
    workers (``RINGLET_TORCH_DEFAULT=1``).  A program naming ``"gloo"`` still gets torch's gloo.

    Under ``ringlet-run`` torch's ``env://`` rendezvous is pointed at the launcher's store (a
    ringlet store, which torch's own ``TCPStore`` client cannot speak to), so the program's
    ``init_process_group()`` joins the job unchanged, whatever backend it names.
    """
    import sys

    import torch.distributed as tdist

    from ringlet import _env

    trdzv = sys.modules["torch.distributed.rendezvous"]    # the module (a function shadows it)
    tdist.Backend.default_device_backend_map["cpu"] = "ringlet"
    if _env.agent_store():
        # torch offers no public way to replace a scheme's handler (register_rendezvous_handler
        # refuses a registered one): this process was launched asking for exactly this.
        trdzv._rendezvous_handlers["env"] = _env_rendezvous


def _env_rendezvous(url: str, timeout: Any = None, **kwargs: Any) -> Any:
    """torch's ``env://`` handler for ringlet-run's workers: (store, rank, world size) once."""
    from datetime import timedelta

    from ringlet.c10d.rendezvous import store_from_init_method
    from ringlet.torch_backend._store import torch_facing

    td = timeout if isinstance(timeout, timedelta) else timedelta(seconds=300)
    store, rank, world_size = store_from_init_method("env://", -1, -1, td)
    facing = torch_facing(store)
    # torch keeps only the C++ half of a Python store: without this reference its Python
    # methods are gone once the handler returns ("Not implemented" from torch's trampoline).
    _KEEP_ALIVE.append(facing)
    yield (facing, rank, world_size)


_KEEP_ALIVE: list[Any] = []
