"""The main job's strategies spelled with torch's own stack, for ``bench/train_gpt_torch.py``.

``examples/gpt/strategies.py`` lays the model out with ringlet's public API; this module does
the same layouts with ``torch.distributed`` (DeviceMesh, ``torch.nn.parallel`` DDP, FSDP2's
``fully_shard``, ``torch.distributed.tensor.parallel``) on the torch default group (gloo), and
returns the trainer's own :class:`~gpt.strategies.Parallel` so that ``gpt.trainer.train_step``
runs a torch step exactly as it runs a ringlet one.  Only benchmark code imports it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from gpt.model import GPT, GPTConfig
from gpt.strategies import Layout, Parallel
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from torch.nn.parallel import DistributedDataParallel

__all__ = ["TorchParallel", "build_model", "make_optimizer", "parallelize"]

_SHARDED = ("fsdp", "hsdp", "fsdp+tp")


class TorchParallel(Parallel):
    """:class:`Parallel` whose gradient-sync switch and loss context are torch's."""

    @property
    def raw(self) -> nn.Module:
        return self.model.module if isinstance(self.model, DistributedDataParallel) else self.model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        if isinstance(self.model, DistributedDataParallel):
            with self.model.no_sync():
                yield
        elif self.layout.strategy in _SHARDED:
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            yield

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()


def build_model(seed: int, block_size: int, n_layer: int, n_head: int, n_embd: int) -> GPT:
    """The trainer's model with the trainer's initial weights (``torch.manual_seed(seed)``)."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(block_size=block_size, n_layer=n_layer, n_head=n_head, n_embd=n_embd))


def make_optimizer(model: nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """The trainer's AdamW: weight decay on matrices only."""
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def parallelize(model: GPT, layout: Layout, bf16: bool = False) -> TorchParallel:
    """``layout``'s strategy applied with torch's stack, as ``gpt.strategies.parallelize`` does
    with ringlet's (same meshes, same plans, same wrapping order)."""
    shape, names = layout.mesh_shape()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    s = layout.strategy
    if "tp" in names:
        _tensor_parallel(model, mesh["tp"])
    wrapped: nn.Module = model
    if s in ("ddp", "ddp+tp"):
        wrapped = DistributedDataParallel(model, device_mesh=mesh["dp"])
    elif s in _SHARDED:
        dp_mesh = mesh if s == "hsdp" else mesh["dp"]
        kw = ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)} if bf16 else {})
        for block in model.blocks:
            fully_shard(block, mesh=dp_mesh, **kw)
        fully_shard(model, mesh=dp_mesh, **kw)
    coord = mesh.get_coordinate()
    if coord is None:
        raise AssertionError("this rank is not in the mesh it built")
    dp_axes = [i for i, n in enumerate(names) if n != "tp"]
    dp_rank = sum(coord[i] * math.prod(shape[j] for j in dp_axes if j > i) for i in dp_axes)
    return TorchParallel(wrapped, layout, dp_rank, bf16)


def _tensor_parallel(model: GPT, tp_mesh: DeviceMesh) -> None:
    """The trainer's Megatron-style plan: q/k/v and fc by columns, proj by rows, embedding and
    head by vocabulary (logits stay a DTensor for ``loss_parallel``)."""
    plan = {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        "head": ColwiseParallel(use_local_output=False),
    })
