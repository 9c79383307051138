"""Argument checks shared by the collectives: raised before anything is sent (RELIABILITY C7),
worded "expected ..., got ...", naming the op and the argument."""

from __future__ import annotations

from typing import Any

import torch

from ringlet.transport.base import DTYPE_CODES

__all__ = ["Staged", "blocks", "root", "same_dtype", "tensor", "tensor_list", "writable"]

_SUPPORTED = frozenset(DTYPE_CODES)


def tensor(t: Any, op: str, arg: str, devices: tuple[str, ...] = ("cpu",)) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg}: expected a torch.Tensor, got {type(t).__name__}")
    if t.layout is not torch.strided:
        raise ValueError(f"{op}: {arg}: expected a dense (strided) tensor, got layout {t.layout}")
    kind = "cpu" if t.is_cpu else t.device.type
    if kind not in devices:
        raise ValueError(f"{op}: {arg}: expected a tensor on {' or '.join(devices)} (what this group's "
                         f"transport serves), got device {t.device}")
    if t.dtype not in _SUPPORTED:
        raise TypeError(f"{op}: {arg}: unsupported dtype {t.dtype}")
    return t


def tensor_list(ts: Any, op: str, arg: str, length: int | None = None,
                devices: tuple[str, ...] = ("cpu",)) -> list[torch.Tensor]:
    if not isinstance(ts, (list, tuple)):
        raise TypeError(f"{op}: {arg}: expected a list of tensors, got {type(ts).__name__}")
    if length is not None and len(ts) != length:
        raise ValueError(f"{op}: {arg}: expected {length} tensors (one per rank of the group), got {len(ts)}")
    if not ts:
        raise ValueError(f"{op}: {arg}: expected a non-empty list of tensors")
    out = [tensor(t, op, f"{arg}[{i}]", devices) for i, t in enumerate(ts)]
    return out


def same_dtype(op: str, want: torch.dtype, ts: list[torch.Tensor], arg: str) -> None:
    for i, t in enumerate(ts):
        if t.dtype != want:
            raise TypeError(f"{op}: {arg}[{i}]: expected dtype {want} (like the input), got {t.dtype}")


def blocks(big: torch.Tensor, big_arg: str, small: torch.Tensor, small_arg: str, n: int, op: str) -> None:
    """``big`` must hold ``n`` blocks shaped like ``small`` (all_gather_into_tensor, reduce_scatter_tensor)."""
    if big.dtype != small.dtype:
        raise TypeError(f"{op}: {big_arg}: expected dtype {small.dtype} (like {small_arg}), got {big.dtype}")
    if big.numel() != n * small.numel():
        raise ValueError(f"{op}: {big_arg}: expected {n} x {small.numel()} = {n * small.numel()} elements "
                         f"(world size x {small_arg}), got {big.numel()}")


def root(r: Any, size: int, op: str, arg: str) -> int:
    if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < size:
        raise ValueError(f"{op}: {arg}: expected a rank in [0, {size}), got {r!r}")
    return r


def writable(t: torch.Tensor, op: str, arg: str) -> None:
    for size, stride in zip(t.shape, t.stride()):
        if stride == 0 and size > 1:
            raise ValueError(f"{op}: {arg}: expected a tensor whose elements do not overlap (an expanded "
                             "view cannot receive results); pass a tensor with its own storage")


class Staged:
    """A contiguous stand-in for a user tensor; ``finish()`` copies results back into a strided view."""

    __slots__ = ("buf", "user")

    def __init__(self, user: torch.Tensor) -> None:
        self.user = user
        self.buf = user if user.is_contiguous() else user.contiguous()

    def finish(self) -> None:
        if self.buf is not self.user:
            self.user.copy_(self.buf)
