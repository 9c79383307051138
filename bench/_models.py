"""Models shared by ringlet's training benchmarks: a wide MLP and a small GPT.

- :func:`mlp`: 4 x ``Linear(2500, 2500)`` with ReLU between them (25 M parameters, 100 MB of
  float32 gradients: communication-heavy for its compute).
- :func:`wide_mlp`: ``Linear(2048, 4096)``, ``Linear(4096, 2048)``, ``Linear(2048, 4096)`` with
  ReLU between them (25.2 M parameters, nearly all in three 32 MiB weight gradients: few, large
  gradients, the last of which is ready only when backward ends).
- :class:`GPT`: token + position embeddings, ``layers`` pre-LN transformer blocks (causal
  ``scaled_dot_product_attention``, 4x GELU MLP), a final LayerNorm and an untied output head;
  the defaults (d=384, 6 heads, 4 layers, seq 128, vocab 4096) have 10.3 M parameters.

Both come with a batch maker and a loss, so a benchmark step is ``loss(model, batch)``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPT", "gpt_batch", "gpt_loss", "mlp", "mlp_batch", "mlp_loss", "wide_batch", "wide_mlp"]

WIDE = (2048, 4096, 2048, 4096)


def mlp(width: int = 2500, layers: int = 4) -> nn.Module:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def mlp_batch(batch: int, width: int = 2500, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, width, generator=g), torch.randn(batch, width, generator=g)


def wide_mlp(widths: tuple[int, ...] = WIDE) -> nn.Module:
    """``Linear(widths[k], widths[k + 1])`` layers with ReLU between them."""
    if len(widths) < 2:
        raise ValueError(f"wide_mlp: expected at least 2 widths, got {widths}")
    mods: list[nn.Module] = []
    for k, (a, b) in enumerate(itertools.pairwise(widths)):
        mods += [nn.Linear(a, b)] + ([nn.ReLU()] if k < len(widths) - 2 else [])
    return nn.Sequential(*mods)


def wide_batch(batch: int, widths: tuple[int, ...] = WIDE,
               seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets for :func:`wide_mlp` (its loss is :func:`mlp_loss`)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, widths[0], generator=g), torch.randn(batch, widths[-1], generator=g)


def mlp_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)); x + mlp(ln2(x))."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        if d % heads:
            raise ValueError(f"expected d divisible by heads, got d={d}, heads={heads}")
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)                  # each (b, heads, t, d/heads)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, vocab: int = 4096, d: int = 384, heads: int = 6, layers: int = 4,
                 seq: int = 128) -> None:
        super().__init__()
        self.seq = seq
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


def gpt_batch(batch: int, seq: int = 128, vocab: int = 4096, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (batch, seq + 1), generator=g)


def gpt_loss(model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
