"""``DDPCommHookType`` and ``register_ddp_comm_hook``: DDP's communication
hooks by name (torch's API).

Each member's ``value`` registers its hook: ``DDPCommHookType.FP16_COMPRESS.value(model=ddp,
state=process_group)``, or :func:`register_ddp_comm_hook`.  The PowerSGD members build a
``PowerSGDState`` over ``state`` (a process group or None) with ``start_powerSGD_iter=10``.

Example::

    register_ddp_comm_hook(DDPCommHookType.BF16_COMPRESS, ddp_model)
"""

from __future__ import annotations

import enum
import functools
from collections.abc import Callable
from typing import Any

import torch

from ringlet.parallel.comm_hooks import default_hooks, quantization_hooks
from ringlet.parallel.comm_hooks.batched_powerSGD import batched_powerSGD_hook
from ringlet.parallel.comm_hooks.powerSGD_hook import PowerSGDState, powerSGD_hook

__all__ = ["DDPCommHookType", "noop_hook", "register_ddp_comm_hook"]


def noop_hook(_: Any, bucket: Any) -> torch.futures.Future:
    """No communication: each rank keeps its own gradients (to measure what communication costs)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _plain(model: Any, state: Any, comm_hook: Callable[..., Any]) -> None:
    model.register_comm_hook(state, comm_hook)


def _power_sgd(model: Any, state: Any, comm_hook: Callable[..., Any],
               matrix_approximation_rank: int) -> None:
    ps = PowerSGDState(process_group=state, matrix_approximation_rank=matrix_approximation_rank,
                       start_powerSGD_iter=10)
    model.register_comm_hook(ps, comm_hook)


def _member(fn: Callable[..., None], **kw: Any) -> Any:
    # enum.member (3.11+) keeps the partial a value where Python would make it a method; before
    # 3.11 a partial is not a descriptor, so it is a member as is.
    wrap = getattr(enum, "member", lambda v: v)
    return wrap(functools.partial(fn, **kw))


class DDPCommHookType(enum.Enum):
    """DDP's communication hooks by name; ``member.value(model=..., state=...)`` registers one."""

    ALLREDUCE = _member(_plain, comm_hook=default_hooks.allreduce_hook)
    FP16_COMPRESS = _member(_plain, comm_hook=default_hooks.fp16_compress_hook)
    BF16_COMPRESS = _member(_plain, comm_hook=default_hooks.bf16_compress_hook)
    QUANTIZE_PER_TENSOR = _member(_plain, comm_hook=quantization_hooks.quantization_pertensor_hook)
    QUANTIZE_PER_CHANNEL = _member(_plain,
                                   comm_hook=quantization_hooks.quantization_perchannel_hook)
    POWER_SGD = _member(_power_sgd, comm_hook=powerSGD_hook, matrix_approximation_rank=1)
    POWER_SGD_RANK2 = _member(_power_sgd, comm_hook=powerSGD_hook, matrix_approximation_rank=2)
    BATCHED_POWER_SGD = _member(_power_sgd, comm_hook=batched_powerSGD_hook,
                                matrix_approximation_rank=1)
    BATCHED_POWER_SGD_RANK2 = _member(_power_sgd, comm_hook=batched_powerSGD_hook,
                                      matrix_approximation_rank=2)
    NOOP = _member(_plain, comm_hook=noop_hook)


def register_ddp_comm_hook(comm_hook_type: DDPCommHookType, model: Any, state: Any = None) -> None:
    """Register the hook ``comm_hook_type`` on the DDP ``model`` (``state``:
    its process group or None).

    Raises:
        TypeError: ``comm_hook_type`` is not a :class:`DDPCommHookType`.
    """
    if not isinstance(comm_hook_type, DDPCommHookType):
        raise TypeError("register_ddp_comm_hook: expected a "
                        f"DDPCommHookType, got {comm_hook_type!r}")
    comm_hook_type.value(model=model, state=state)
