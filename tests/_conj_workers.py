"""Rank bodies for the lazy conjugate / negative tests: a Llama-style attention whose rotary
embedding multiplies complex numbers (``torch.view_as_complex(xq) * freqs_cis``), parallelized
column-wise (wq, wk, wv) and row-wise (wo), against the same model in one process.

The backward of a complex product multiplies by the conjugate of the other factor, so every
query/key weight gradient goes through ``aten._conj``.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.fsdp import fully_shard
from ringlet.distributed.tensor import DTensor, Replicate
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)


def freqs_cis(seq: int, head_dim: int, base: float = 10000.0) -> torch.Tensor:
    """Unit complex numbers ``exp(i * t * base^(-2j/head_dim))``, shape ``[seq, head_dim/2]``."""
    inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
    return torch.polar(torch.ones_like(angles), angles)


def rotate(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on pairs of the head dim; x: ``[b, t, heads, head_dim]``."""
    pairs = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    if isinstance(x, DTensor):      # q/k kept as DTensors: the table joins them replicated
        freqs = DTensor.from_local(freqs, x.device_mesh, [Replicate()] * x.device_mesh.ndim)
    return torch.view_as_real(pairs * freqs[None, :, None, :]).flatten(3).type_as(x)


class RotaryAttention(nn.Module):
    """Causal self-attention with complex rotary embeddings (Llama's layout)."""

    def __init__(self, d: int = 16, heads: int = 4, seq: int = 6) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(d, d, bias=False) for _ in range(4))
        self.register_buffer("freqs", freqs_cis(seq, self.head_dim), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.shape[0], x.shape[1]
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        q, k = rotate(q, self.freqs[:t]), rotate(k, self.freqs[:t])
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, t, -1))


class Model(nn.Module):
    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.attention = RotaryAttention(d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.attention(x))


def reference(seed: int = 0) -> Model:
    """The model with values from a private generator (rank threads share torch's default)."""
    model = Model()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=g))
    return model


def plan(local_output: bool) -> dict[str, Any]:
    """Megatron's attention plan; ``local_output=False`` keeps q/k/v DTensors, so the rotary
    embedding (and its conjugates in backward) runs on DTensors sharded by heads."""
    return {
        "attention": PrepareModuleInput(input_layouts=(Replicate(),),
                                        desired_input_layouts=(Replicate(),)),
        "attention.wq": ColwiseParallel(use_local_output=local_output),
        "attention.wk": ColwiseParallel(use_local_output=local_output),
        "attention.wv": ColwiseParallel(use_local_output=local_output),
        "attention.wo": RowwiseParallel(),
    }


def inputs(seed: int = 1, batch: int = 2, seq: int = 6, d: int = 16) -> torch.Tensor:
    return torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(seed))


def _full(t: Any) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def grad_diffs(model: nn.Module, ref: nn.Module) -> dict[str, float]:
    """Largest |difference| of every parameter's gradient (gathered) from the reference's."""
    refs = dict(ref.named_parameters())
    return {name: float((_full(p.grad) - refs[name].grad).abs().max())
            for name, p in model.named_parameters()}


def rotary_tp(rank: int, n: int, local_output: bool, steps: int = 2) -> dict[str, Any]:
    """TP on a 1-d mesh of ``n``: every parameter gradient vs one process, ``steps`` SGD steps."""
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = reference()
    model = parallelize_module(copy.deepcopy(ref), mesh, plan(local_output))
    return _train(model, ref, steps)


def rotary_2d(rank: int, n: int, dp: int, steps: int = 2) -> dict[str, Any]:
    """fully_shard over "dp" of TP over "tp" (mesh ``(dp, n // dp)``), the batch split by dp."""
    mesh = init_device_mesh("cpu", (dp, n // dp), mesh_dim_names=("dp", "tp"))
    ref = reference()
    model = parallelize_module(copy.deepcopy(ref), mesh["tp"], plan(False))
    fully_shard(model, mesh=mesh["dp"])
    return _train(model, ref, steps, split=(mesh["dp"].get_local_rank(), dp))


def _train(model: nn.Module, ref: nn.Module, steps: int,
           split: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    out: dict[str, Any] = {"out": [], "grads": []}
    for step in range(steps):
        x = inputs(seed=step + 1)
        part = x.chunk(split[1])[split[0]]
        y = model(part)
        ry = ref(x)
        # each dp rank's mean; fully_shard averages gradients over dp: the whole batch's mean
        _full(y).pow(2).mean().backward()
        ry.pow(2).mean().backward()
        out["out"].append(float((_full(y) - ry.chunk(split[1])[split[0]]).detach().abs().max()))
        out["grads"].append(grad_diffs(model, ref))
        opt.step()
        ropt.step()
        opt.zero_grad()
        ropt.zero_grad()
    return out


def rotary_without_grad(rank: int, n: int) -> list[float]:
    """The TP rotary attention under ``inference_mode`` and ``no_grad`` (twice each: uncached,
    then cached decisions) against one process: largest output differences."""
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    ref = reference()
    model = parallelize_module(copy.deepcopy(ref), mesh, plan(False))
    x = inputs()
    diffs = []
    for mode in (torch.inference_mode, torch.no_grad, torch.inference_mode):
        with mode():
            diffs.append(float((_full(model(x)) - ref(x)).abs().max()))
    return diffs
