"""Where fully_shard computes and where it keeps the shards (GPUs and CPU offloading).

[Note: FSDP devices]
A group has a *compute device* -- where the all-gathered parameters, the gradients before the
reduce-scatter and the collectives live -- and a *shard home*, where the sharded parameters
(the shard buffer), their ``.grad`` and hence the optimizer state live:

- the compute device is the mesh's: ``cuda`` means the current CUDA device (as torch's
  ``fully_shard``); a CPU mesh computes on the CPU.  Without a mesh, the default mesh is a CUDA
  one when the module's parameters already are on CUDA, else a CPU one (torch picks CUDA whenever
  it is available: ringlet does not move a CPU model to a GPU behind the user's back);
- parameters and buffers not on the compute device are moved there (parameters only as their
  shards), as torch does;
- the shard home is the compute device, except with :class:`CPUOffloadPolicy` on a GPU: then
  it is the CPU, in pinned memory (``pin_memory``), and each all-gather first copies the shard
  to the GPU, each reduce-scatter's result is copied back to the CPU.  On a CPU compute device
  the policy changes nothing.

Streams: the copy to the GPU and the all-gather are queued on the current stream and the
group's side stream; see [Note: CUDA streams] in ``ringlet/c10d/_cuda.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ringlet.parallel.fsdp.policies import CPUOffloadPolicy, OffloadPolicy

__all__ = ["ShardHome", "compute_device", "default_mesh_type", "move_buffers"]


def default_mesh_type(modules: Iterable[nn.Module]) -> str:
    """``"cuda"`` if any parameter of ``modules`` is a CUDA tensor, else ``"cpu"``."""
    for m in modules:
        for p in m.parameters():
            if p.device.type == "cuda":
                return "cuda"
    return "cpu"


def compute_device(mesh: Any) -> torch.device:
    """The device a group computes on: the mesh's (``cuda``: the current CUDA device)."""
    kind = getattr(mesh, "device_type", "cpu")
    if kind == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(kind)


def move_buffers(modules: Iterable[nn.Module], device: torch.device) -> None:
    """Move the (materialised) buffers of ``modules`` to a non-CPU compute device."""
    if device.type == "cpu":
        return
    for m in modules:
        for sub in m.modules():
            for name, b in sub._buffers.items():
                if b is not None and b.device != device and b.device.type != "meta":
                    sub._buffers[name] = b.to(device)


class ShardHome:
    """Where the shards of a group computing on ``device`` live under ``offload``."""

    def __init__(self, device: torch.device, offload: OffloadPolicy | None) -> None:
        self.device = device
        self.offload = isinstance(offload, CPUOffloadPolicy) and device.type != "cpu"
        self.pin = self.offload and bool(getattr(offload, "pin_memory", False))
        self.policy = offload

    @property
    def home(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    def zeros(self, numel: int, dtype: torch.dtype, meta: bool) -> torch.Tensor:
        """A fresh shard buffer (on the meta device for meta parameters)."""
        if meta:
            return torch.zeros(numel, dtype=dtype, device="meta")
        return torch.zeros(numel, dtype=dtype, device=self.home, pin_memory=self.pin)

    def place(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` (a shard buffer or sharded gradient) moved to the shard home if offloading."""
        if not self.offload or t.device.type in ("cpu", "meta"):
            return t
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        return out.copy_(t)

    def rebind(self, t: torch.Tensor) -> ShardHome:
        """After ``module._apply`` moved the shards to ``t.device``: the new placement."""
        if t.device.type == "meta" or (self.offload and t.device.type == "cpu"):
            return self
        return ShardHome(t.device, self.policy)

    def __repr__(self) -> str:
        where = f"offloaded to {'pinned ' if self.pin else ''}CPU" if self.offload else "on device"
        return f"ShardHome(compute {self.device}, shards {where})"
