"""DDP's constructor arguments, checked and normalised (pure: no process group is touched).

- :func:`bucket_caps`: ``bucket_cap_mb`` (a number, or a list: one cap per bucket) and torch's
  newer ``bucket_cap_mb_list`` -> the cap in bytes and the per-bucket caps in bytes;
- :func:`buffer_sync`: ``broadcast_buffers`` (deprecated in torch 2.13) and its replacement
  ``forward_sync_buffers`` -> (sync buffers before each forward, sync buffers at construction);
- the refusals of what ringlet cannot honour, and the group and device checks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ringlet.c10d.world import resolve_group
from ringlet.dtensor import DTensor
from ringlet.parallel.ddp._buckets import cap_bytes_from_mb
from ringlet.parallel.ddp._cuda import DevicePlan, plan_devices

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg, ProcessGroup
    from ringlet.mesh import DeviceMesh

__all__ = ["bucket_caps", "buffer_sync", "check_devices", "pick_group", "refuse_dtensor_buffers",
           "refuse_unsupported"]

_MIB = 1 << 20


def bucket_caps(bucket_cap_mb: Any, bucket_cap_mb_list: Any) -> tuple[int, list[int]]:
    """``(cap bytes, per-bucket cap bytes)``; the list is empty unless per-bucket caps were given.

    With per-bucket caps the ``k``-th bucket holds up to ``caps[k]`` (the last cap repeats) and
    the cap is their maximum, as in torch.

    Raises:
        ValueError: a negative or non-numeric cap, an empty list, or a list given both ways.
    """
    if isinstance(bucket_cap_mb, (list, tuple)):
        if bucket_cap_mb_list is not None:
            raise ValueError("DistributedDataParallel: expected per-bucket caps in bucket_cap_mb "
                             "or in bucket_cap_mb_list, got both")
        bucket_cap_mb_list, bucket_cap_mb = bucket_cap_mb, None
    if bucket_cap_mb_list is None:
        return cap_bytes_from_mb(bucket_cap_mb), []
    caps = list(bucket_cap_mb_list)
    if not caps or not all(isinstance(c, (int, float)) and not isinstance(c, bool)
                           and c >= 0 for c in caps):
        raise ValueError("DistributedDataParallel: bucket_cap_mb_list: expected a non-empty list "
                         f"of sizes >= 0 (MiB), got {bucket_cap_mb_list!r}")
    in_bytes = [int(c * _MIB) for c in caps]
    return max(in_bytes), in_bytes


def buffer_sync(broadcast_buffers: bool | None,
                forward_sync_buffers: bool | None) -> tuple[bool, bool]:
    """``(sync buffers before forwards, sync buffers at construction)``, with torch 2.13's warnings.

    ``forward_sync_buffers`` only affects forwards; the deprecated ``broadcast_buffers=False``
    also leaves buffers out of the construction-time sync.
    """
    if broadcast_buffers is not None:
        if forward_sync_buffers is not None:
            warnings.warn("DistributedDataParallel: both broadcast_buffers and "
                          "forward_sync_buffers were given; broadcast_buffers is deprecated "
                          "and ignored", FutureWarning, stacklevel=3)
        else:
            warnings.warn("DistributedDataParallel: broadcast_buffers is deprecated, use "
                          "forward_sync_buffers (which, unlike broadcast_buffers=False, still "
                          "syncs buffers at construction)",
                          FutureWarning, stacklevel=3)
    if forward_sync_buffers is not None:
        return bool(forward_sync_buffers), True
    effective = True if broadcast_buffers is None else bool(broadcast_buffers)
    return effective, effective


def refuse_unsupported(delay: Any, param_to_hook: Any, mixed_precision: Any) -> None:
    if mixed_precision is not None:
        raise NotImplementedError("DistributedDataParallel: mixed_precision is not supported by "
                                  "ringlet; cast the model yourself or use a bf16/fp16 compression "
                                  "comm hook")
    if delay is not None or param_to_hook is not None:
        raise NotImplementedError("DistributedDataParallel: delay_all_reduce_named_params and "
                                  "param_to_hook_all_reduce are not supported by ringlet")


def refuse_dtensor_buffers(named_buffers: Sequence[tuple[str, torch.Tensor]]) -> None:
    bad = [n for n, b in named_buffers if isinstance(b, DTensor)]
    if bad:
        raise ValueError("DistributedDataParallel: expected plain tensors as buffers, got DTensor "
                         f"buffers {bad}; register them as plain tensors, or list them in "
                         "_ddp_params_and_buffers_to_ignore")


def pick_group(process_group: GroupArg, device_mesh: DeviceMesh | None) -> ProcessGroup:
    if process_group is not None and device_mesh is not None:
        raise ValueError("DistributedDataParallel: Cannot specify both process_group and "
                         "device_mesh arguments (expected one of them, got both)")
    if device_mesh is not None:
        ndim = getattr(device_mesh, "ndim", 1)
        if ndim != 1:
            raise ValueError("DistributedDataParallel: Only 1D device mesh is supported (expected "
                             f"a 1-d device_mesh such as mesh['dp'], got {ndim} dims)")
        process_group = device_mesh.get_group()
    pg = resolve_group(process_group)
    if pg is None:
        raise ValueError("DistributedDataParallel: expected a process group this rank belongs to, "
                         "got one that does not include it")
    return pg


def check_devices(named_params: Sequence[tuple[str, torch.Tensor]], device_ids: Any,
                  output_device: Any) -> DevicePlan:
    """torch's rules for ``device_ids``/``output_device`` (``ddp/_cuda.py``); one device only.

    Raises:
        ValueError: ids that do not fit the module, or parameters on several devices.
    """
    plan = plan_devices((p.device for _, p in named_params), device_ids, output_device)
    devices = sorted({str(p.device) for _, p in named_params})
    if len(devices) > 1:
        raise ValueError(f"DistributedDataParallel: expected every parameter on one device, got "
                         f"parameters on {devices}; move the module with module.to(device) first")
    return plan
