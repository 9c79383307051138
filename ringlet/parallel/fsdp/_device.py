"""Where fully_shard computes and where it keeps the shards (GPUs and CPU offloading).

[Note: FSDP devices]
A group has a *compute device* -- where the all-gathered parameters, the gradients before the
reduce-scatter and the collectives live -- and a *shard home*, where the sharded parameters
(the shard buffer), their ``.grad`` and hence the optimizer state live:

- the compute device is the mesh's: ``cuda`` means the current CUDA device (as torch's
  ``fully_shard``); a CPU mesh computes on the CPU.  Without a mesh, the default mesh is a CUDA
  one whenever CUDA is available, else a CPU one, as torch's (so a CPU model given to
  ``fully_shard`` on a GPU host trains on the GPU; pass a ``"cpu"`` mesh to keep it on the CPU);
- parameters and buffers not on the compute device are moved there (parameters only as their
  shards: ``build_group`` copies this rank's shard of each into the shard buffer), as torch
  does; buffers of submodules that an earlier ``fully_shard`` call manages stay where it put them;
- the shard home is the compute device, except with :class:`CPUOffloadPolicy` on a GPU: then
  it is the CPU, in pinned memory (``pin_memory``), and each all-gather first copies the shard
  to the GPU (``non_blocking``: pinned memory, so the copy is a DMA queued on the stream), each
  reduce-scatter's result is copied back to the CPU before it is added into ``.grad`` (below:
  the copies run while backward goes on, the host waits once at its end).  On a CPU
  compute device the policy changes nothing;
- the all-gather's output, the unsharded parameters, the reduce-scatter's input and output live
  on the compute device (``comm_buffer`` only for CPU groups with a buffer heap,
  ``_collectives.BufferPool``);
- ``module._apply`` (``to_empty``, ``cuda()``, ``to(dtype)``) moves the shards: the compute device
  follows them (:meth:`ShardHome.rebind`), except that offloaded shards go back to the CPU.

Streams ([Note: CUDA streams] in ``ringlet/c10d/_cuda.py``): the copy to the GPU is queued on
the current stream before the all-gather is issued, and the collective reads its input after
every kernel queued there (on the current stream, or on the group's side stream after it waited
for the current one), so it reads the copied shard.  fully_shard reads an asynchronous
collective's output only after ``work.wait()`` (``_collectives.finish_all_gather``,
``finish_reduce_scatter``), which orders the current stream after it.  Inside backward the
copy of a reduced shard back to (pinned) CPU memory is queued ``non_blocking`` on the current
stream with an event after it (:meth:`ShardHome.send_home`), and the host goes on queueing
backward; the result is added into ``.grad`` only when it *lands*: at the end of backward (the
final callback), before the next forward, or before anything else reads the gradients
(``state_dict``, ``to()``, ``deepcopy``), where the host waits for the events.  That is the one
host synchronisation offloading adds per backward (the first wait covers the rest: every event
is on the same stream), and since each event follows every copy of a pinned shard to the GPU
queued before it, those copies have run before the optimizer writes the shards again.  Unpinned
memory (``pin_memory=False``) copies back blocking.  Without offloading fully_shard makes no host
synchronisation, and on a CPU mesh no CUDA call at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ringlet.mesh.device_mesh import compute_device
from ringlet.parallel.fsdp.policies import CPUOffloadPolicy, OffloadPolicy

__all__ = ["ShardHome", "compute_device", "default_mesh_type", "move_buffers"]


def default_mesh_type() -> str:
    """The device type of fully_shard's default mesh: ``"cuda"`` when CUDA is available, else
    ``"cpu"`` (torch's rule; ringlet's meshes are CPU or CUDA ones)."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def move_buffers(modules: Iterable[nn.Module], device: torch.device) -> None:
    """Move the materialised buffers of ``modules`` to the compute ``device``.

    Submodules that an earlier ``fully_shard`` call manages keep theirs (that call placed
    them); meta buffers stay on meta (deferred initialisation).  A no-op when every buffer is
    already there, as on a CPU model sharded on a CPU mesh.
    """
    for m in modules:
        for sub in _unmanaged(m):
            for name, b in sub._buffers.items():
                if b is not None and b.device != device and b.device.type != "meta":
                    sub._buffers[name] = b.to(device)


def _unmanaged(module: nn.Module) -> Iterable[nn.Module]:
    """``module`` and its submodules, without those under another fully_shard module."""
    yield module
    for child in module.children():
        if "_fsdp_state" not in child.__dict__:
            yield from _unmanaged(child)


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
        """``t`` (a shard buffer or sharded gradient) moved to the shard home if offloading.

        The copy from the GPU is blocking: the host reads the result (optimizer step, gradient
        accumulation) without looking at streams.  A CPU tensor is pinned if it should be.
        """
        if not self.offload or t.device.type == "meta":
            return t
        if t.device.type == "cpu":
            return t.pin_memory() if self.pin and not t.is_pinned() else t
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        return out.copy_(t)

    def send_home(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start moving a reduced shard to the shard home; returns it there and the copy to
        wait for (``None``: already complete).  Only a CUDA tensor going to pinned memory is
        copied asynchronously: the returned CUDA event is recorded after the copy on the
        current stream, and its ``synchronize()`` is the one host wait.  Anything else is
        :meth:`place`'s blocking copy."""
        if not (self.offload and self.pin and t.device.type == "cuda"):
            return self.place(t), None
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        out.copy_(t, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return out, done

    def rebind(self, t: torch.Tensor) -> ShardHome:
        """After ``module._apply`` moved the shards to ``t.device``: the new placement."""
        if t.device.type == "meta" or (self.offload and t.device.type == "cpu"):
            return self
        return ShardHome(t.device, self.policy)

    def __repr__(self) -> str:
        where = f"offloaded to {'pinned ' if self.pin else ''}CPU" if self.offload else "on device"
        return f"ShardHome(compute {self.device}, shards {where})"
