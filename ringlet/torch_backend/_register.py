"""Registering ``"ringlet"`` with torch (done by ``import ringlet``; cheap: nothing of ringlet's
c10d is imported until torch creates a group)."""

from __future__ import annotations

from typing import Any

__all__ = ["create", "register"]


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

    if not tdist.is_available() or "ringlet" in tdist.Backend.backend_list:
        return
    tdist.Backend.register_backend("ringlet", create, extended_api=True, devices=["cpu", "cuda"])
