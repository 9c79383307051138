"""DDP on GPUs: where the module lives, ``device_ids``/``output_device``.

Moving the inputs to the module's device is ``ringlet/parallel/_device_moves.py``'s (shared with
fully_shard).

torch's rules, which ringlet keeps:

- a CPU module (or one spread over several devices) takes ``device_ids=None`` and
  ``output_device=None``; anything else is a ``ValueError``;
- a single-device CUDA module may name its device in ``device_ids=[i]`` (one entry at most);
  ``output_device`` then defaults to ``i``; with ``device_ids`` set, ``forward`` moves its tensor
  arguments to ``cuda:i`` first;
- buckets live on the module's device.

The stream ordering of the bucket all-reduces -- each reads its gradients only after the kernels
that produced them, the end of backward waits for each before ``.grad`` is read or the bucket
refilled, backward's next kernels overlap the collective -- is the process-group layer's
([Note: CUDA streams] in ``ringlet/c10d/_cuda.py``): a bucket's ``all_reduce(async_op=True)``
issued from the gradient hook is ordered after the hook's current stream, and the end of
backward's ``work.wait()`` orders the caller's stream after it.  So nothing here touches streams,
and CPU modules take none of these paths (``DevicePlan.device`` is the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from ringlet.c10d.group import ProcessGroup

__all__ = ["DevicePlan", "aux_device", "plan_devices"]


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """Where a DDP module runs: its parameters' ``device`` (None: several devices), torch's
    ``device_ids`` (None or ``[index]``) and ``output_device`` (None or an index)."""

    device: torch.device | None
    device_ids: list[int] | None
    output_device: int | None


def _index(d: Any, what: str) -> int:
    if isinstance(d, torch.device):
        if d.index is None:
            raise ValueError(f"DistributedDataParallel: {what}: expected a device with an index, "
                             f"got {d}")
        return d.index
    if isinstance(d, str):
        return _index(torch.device(d), what)
    if isinstance(d, int) and not isinstance(d, bool):
        return d
    raise TypeError(f"DistributedDataParallel: {what}: expected a device index or torch.device, "
                    f"got {d!r}")


def plan_devices(param_devices: Iterable[torch.device], device_ids: Any,
                 output_device: Any) -> DevicePlan:
    """Check ``device_ids``/``output_device`` against the parameters' devices (pure).

    Raises:
        ValueError: more than one device id, ids for a CPU or multi-device module, or an id
            that is not the module's device.
    """
    devices = set(param_devices)
    device = next(iter(devices)) if len(devices) == 1 else None
    if device_ids is not None and len(device_ids) > 1:
        raise ValueError("device_ids can only be None or contain a single element.")
    if not device_ids or device is None or device.type == "cpu":
        if device_ids or output_device is not None:
            raise ValueError("DistributedDataParallel: device_ids and output_device arguments only "
                             "work with single-device/multiple-device GPU modules or CPU modules; "
                             f"expected None for this module, but got device_ids {device_ids}, "
                             f"output_device {output_device}, and module parameters "
                             f"{sorted(map(str, devices))}.")
        return DevicePlan(device, None, None)
    ids = [_index(d, "device_ids") for d in device_ids]
    if device.index is not None and ids[0] != device.index:
        raise ValueError(f"DistributedDataParallel: device_ids: expected [{device.index}] (the "
                         f"module's parameters are on {device}), got {list(device_ids)}; move the "
                         f"module with module.to({device.type}:{ids[0]}) or pass "
                         f"device_ids=[{device.index}]")
    out = ids[0] if output_device is None else _index(output_device, "output_device")
    return DevicePlan(device, ids, out)


def aux_device(pg: ProcessGroup, device: torch.device | None) -> torch.device:
    """Where DDP's small bookkeeping tensors go (used-map, bucket order): the CPU when the group
    serves CPU tensors (every backend but a bare ``torch:nccl``), else the module's device."""
    if "cpu" in pg.transport.devices or device is None:
        return torch.device("cpu")
    return device
