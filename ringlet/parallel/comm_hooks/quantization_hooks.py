"""DDP hooks that send gradients quantized to 8 bits (torch's ``quantization_hooks``).

Each rank maps its bucket to ``uint8`` with an affine scale and zero point of its own
(``q = round(x / scale) + zero_point``, ``scale = (max - min) / 255`` over the values, the
range always containing 0), all-gathers everyone's scales and quantized bytes, dequantizes each
rank's part with that rank's scale and averages.  Per tensor: one scale for the whole bucket.
Per channel: the bucket is cut into rows of ``bucket_size`` elements (the last one padded), each
with its own scale, which keeps small gradients next to large ones from losing all precision.

The result is an approximation (8 bits per element on the wire instead of 32); use it where
bandwidth, not accuracy, bounds training.

Example::

    model.register_comm_hook(None, quantization_pertensor_hook)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ringlet.c10d import all_gather
from ringlet.parallel.comm_hooks.default_hooks import GradBucketLike, hook_group

if TYPE_CHECKING:
    from ringlet.c10d.group import GroupArg

__all__ = ["quantization_perchannel_hook", "quantization_pertensor_hook"]

_LEVELS = 255


def _qparams(rows: torch.Tensor) -> torch.Tensor:
    """``(scale, zero_point)`` per row of a 2-d float tensor, as a (rows, 2) float64 tensor."""
    lo = rows.min(dim=1).values.clamp(max=0).double()
    hi = rows.max(dim=1).values.clamp(min=0).double()
    scale = ((hi - lo) / _LEVELS).clamp(min=1e-12)
    zero = (-lo / scale).round().clamp(0, _LEVELS)
    return torch.stack([scale, zero], dim=1)


def _quantize(rows: torch.Tensor, qp: torch.Tensor) -> torch.Tensor:
    scale, zero = qp[:, :1], qp[:, 1:]
    return (rows.double() / scale + zero).round().clamp(0, _LEVELS).to(torch.uint8)


def _dequantize(q: torch.Tensor, qp: torch.Tensor) -> torch.Tensor:
    return (q.double() - qp[:, 1:]) * qp[:, :1]


def _quantized_average(process_group: GroupArg, bucket: GradBucketLike, row: int | None,
                       name: str) -> torch.futures.Future:
    pg = hook_group(process_group, name)
    buffer = bucket.buffer()
    n = buffer.numel()
    width = max(1, n if row is None else row)
    rows_n = -(-n // width)
    rows = buffer.new_zeros(rows_n * width)
    rows[:n] = buffer
    rows = rows.view(rows_n, width)
    qp = _qparams(rows)
    all_qp = [torch.empty_like(qp) for _ in range(pg.size())]
    all_gather(all_qp, qp, group=pg)
    q = _quantize(rows, qp)
    all_q = [torch.empty_like(q) for _ in range(pg.size())]
    work = all_gather(all_q, q, group=pg, async_op=True)
    if work is None:      # pragma: no cover - hook_group already refused non-members
        raise AssertionError("all_gather returned no Work for a member group")

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        fut.wait()
        parts = [_dequantize(qr, p) for qr, p in zip(all_q, all_qp)]
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        buffer.copy_((total / pg.size()).reshape(-1)[:n])
        return buffer
    return work.get_future().then(finish)


def quantization_pertensor_hook(process_group: GroupArg,
                                bucket: GradBucketLike) -> torch.futures.Future:
    """Average the bucket sending 8-bit values with one scale per rank (see
    the module docstring)."""
    return _quantized_average(process_group, bucket, None, "quantization_pertensor_hook")


def quantization_perchannel_hook(process_group: GroupArg, bucket: GradBucketLike,
                                 bucket_size: int = 512
                                 ) -> torch.futures.Future:
    """Average the bucket sending 8-bit values with one scale per ``bucket_size`` elements."""
    if bucket_size < 1:
        raise ValueError("quantization_perchannel_hook: expected "
                         f"bucket_size >= 1, got {bucket_size}")
    return _quantized_average(process_group, bucket, bucket_size, "quantization_perchannel_hook")
