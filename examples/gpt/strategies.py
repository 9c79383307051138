"""How the model is spread over the ranks: one function per strategy, all from public APIs.

=========  ==========================  =================================================
strategy   mesh (2 ranks / 4 ranks)    what each rank holds and what travels per step
=========  ==========================  =================================================
ddp        dp=2 / dp=4                 a full replica; gradients all-reduced in buckets
fsdp       dp=2 / dp=4                 1/N of params, grads, Adam state; params
                                       all-gathered per block, grads reduce-scattered
hsdp       replicate x shard = 2x1 /   sharded within a shard group, replicated across;
           2x2                         + an all-reduce of the grad shards across groups
tp         tp=2 / tp=4                 1/N of every block's weights (heads and MLP
                                       columns); an all-reduce per attention and MLP
fsdp+tp    dp x tp = 1x2 / 2x2         TP inside, fully_shard over the dp axis
ddp+tp     dp x tp = 1x2 / 2x2         TP inside, DDP over the dp axis
=========  ==========================  =================================================

The same names as torch's: this file reads the same with ``torch.distributed`` in place of
``ringlet.distributed`` (and ``torch.nn.parallel`` for ``ringlet.nn.parallel``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ringlet.distributed import init_device_mesh
from ringlet.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from ringlet.distributed.tensor import Replicate
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    loss_parallel,
    parallelize_module,
)
from ringlet.nn.parallel import DistributedDataParallel as DDP

STRATEGIES = ("ddp", "fsdp", "hsdp", "tp", "fsdp+tp", "ddp+tp")


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How ``world_size`` ranks are arranged: data-parallel replicas x shards x tensor-parallel."""

    strategy: str
    replicate: int = 1     # HSDP: groups that each hold a full copy
    shard: int = 1         # data-parallel ranks that share one copy (FSDP) or hold one each (DDP)
    tp: int = 1            # tensor-parallel degree

    @property
    def dp(self) -> int:
        """Data-parallel degree: how many ways each global batch is split."""
        return self.replicate * self.shard

    def mesh_shape(self) -> tuple[tuple[int, ...], tuple[str, ...]]:
        if self.strategy == "hsdp":
            return (self.replicate, self.shard), ("replicate", "shard")
        if self.strategy in ("fsdp+tp", "ddp+tp"):
            return (self.shard, self.tp), ("dp", "tp")
        if self.strategy == "tp":
            return (self.tp,), ("tp",)
        return (self.shard,), ("dp",)

    def shards_nothing(self) -> str | None:
        """One line when a sharding strategy's layout leaves nothing to shard, else None."""
        if self.strategy not in ("fsdp", "hsdp", "fsdp+tp") or self.shard > 1:
            return None
        ranks = self.replicate * self.shard * self.tp
        if self.strategy == "hsdp":
            return (f"note: hsdp on {ranks} ranks shards nothing (replicate={self.replicate} x "
                    "shard=1: every rank holds the whole model, as with ddp); shard over all "
                    f"with --replicate 1, or use 4 ranks for replicate=2 x shard=2")
        if self.strategy == "fsdp+tp":
            return (f"note: fsdp+tp on {ranks} ranks shards nothing over dp (dp=1: tensor "
                    "parallelism alone splits the model); use 4 ranks for dp=2 x tp=2")
        return "note: fsdp on 1 rank shards nothing (start 2 or more ranks)"

    def __str__(self) -> str:
        shape, names = self.mesh_shape()
        return " x ".join(f"{n}={s}" for n, s in zip(names, shape, strict=True))


def default_layout(strategy: str, world_size: int, tp: int | None = None,
                   replicate: int | None = None) -> Layout:
    """The layout a strategy uses on ``world_size`` ranks unless ``--tp``/``--replicate`` say
    otherwise.

    HSDP replicates over 2 groups (and shards within each); the 2-d strategies use tensor
    parallelism of degree 2 (it needs the fastest links, so it is kept small) and data
    parallelism over the rest.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"--strategy: expected one of {', '.join(STRATEGIES)}, got {strategy!r}")
    if strategy in ("ddp", "fsdp"):
        return Layout(strategy=strategy, shard=world_size)
    if strategy == "tp":
        return Layout(strategy=strategy, tp=world_size)
    if strategy == "hsdp":
        r = replicate or (2 if world_size % 2 == 0 else 1)
        _check_divides("--replicate", r, world_size)
        return Layout(strategy=strategy, replicate=r, shard=world_size // r)
    t = tp or (2 if world_size % 2 == 0 else 1)
    _check_divides("--tp", t, world_size)
    return Layout(strategy=strategy, shard=world_size // t, tp=t)


def _check_divides(flag: str, n: int, world_size: int) -> None:
    if n < 1 or world_size % n:
        raise ValueError(f"{flag}: expected a divisor of the world size {world_size}, got {n}")


@dataclass
class Parallel:
    """A model spread over the ranks, and what the training loop needs to know about it."""

    model: nn.Module          # what to call: the wrapped / sharded model
    layout: Layout
    dp_rank: int              # which share of each global batch this rank trains on
    bf16: bool

    @property
    def raw(self) -> nn.Module:
        """The user's module (DDP wraps it; fully_shard and TP change it in place)."""
        return self.model.module if isinstance(self.model, DDP) else self.model

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes in here accumulate gradients without communicating (gradient
        accumulation)."""
        if isinstance(self.model, DDP):
            with self.model.no_sync():
                yield
        elif self.layout.strategy in ("fsdp", "hsdp", "fsdp+tp"):
            self.model.set_requires_gradient_sync(False)
            try:
                yield
            finally:
                self.model.set_requires_gradient_sync(True)
        else:
            yield     # tensor parallelism alone has no gradient all-reduce to skip

    def loss_parallel(self) -> contextlib.AbstractContextManager:
        """Around the loss and its backward: cross-entropy on vocabulary-sharded logits (TP)."""
        return loss_parallel() if self.layout.tp > 1 else contextlib.nullcontext()

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 compute: fully_shard does it with a MixedPrecisionPolicy, the others with
        autocast."""
        if not self.bf16 or self.layout.strategy in ("fsdp", "hsdp", "fsdp+tp"):
            return contextlib.nullcontext()
        return torch.autocast("cpu", dtype=torch.bfloat16)


def parallelize(model: nn.Module, layout: Layout, bf16: bool = False) -> Parallel:
    """Apply ``layout``'s strategy to ``model`` (the same full model on every rank)."""
    shape, names = layout.mesh_shape()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    s = layout.strategy
    if "tp" in names:
        _tensor_parallel(model, mesh["tp"])
    if s in ("ddp", "ddp+tp"):
        model = DDP(model, device_mesh=mesh["dp"])
    elif s in ("fsdp", "hsdp", "fsdp+tp"):
        dp_mesh = mesh if s == "hsdp" else mesh["dp"]
        mp = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if bf16 else None)
        kw = {"mp_policy": mp} if mp is not None else {}
        for block in model.blocks:              # one all-gather / reduce-scatter per block ...
            fully_shard(block, mesh=dp_mesh, **kw)
        fully_shard(model, mesh=dp_mesh, **kw)  # ... and the root takes embeddings and head
    coord = mesh.get_coordinate()
    dp_axes = [i for i, n in enumerate(names) if n != "tp"]
    dp_rank = sum(coord[i] * math.prod(shape[j] for j in dp_axes if j > i) for i in dp_axes)
    return Parallel(model, layout, dp_rank, bf16)


def _tensor_parallel(model: nn.Module, tp_mesh: object) -> None:
    """Megatron-style: q/k/v and the MLP's first layer split by columns, their outputs by rows.

    Each rank computes its own heads and its own slice of the MLP's hidden layer; one
    all-reduce after the attention output projection and one after the MLP put the residual
    stream back together.  The token embedding and the head are split by vocabulary; position
    embeddings and norms stay replicated (plain tensors, the same on every rank).
    """
    tp = tp_mesh.size()
    if model.cfg.n_head % tp:
        raise ValueError(f"--tp: expected a divisor of the number of heads {model.cfg.n_head}, got "
                         f"{tp}")
    plan = {
        "attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
        "attn.proj": RowwiseParallel(),
        "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel(),
    }
    for block in model.blocks:
        parallelize_module(block, tp_mesh, plan)
    parallelize_module(model, tp_mesh, {
        # Each rank holds a slice of the vocabulary's rows; one all-reduce assembles the output.
        "tok_emb": RowwiseParallel(input_layouts=Replicate()),
        # Logits stay split by vocabulary (a DTensor): loss_parallel() computes the loss on them.
        "head": ColwiseParallel(use_local_output=False),
    })
