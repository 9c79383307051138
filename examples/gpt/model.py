"""A small GPT: token + position embeddings, pre-norm transformer blocks, a linear head.

Written the way tensor parallelism wants it: queries, keys and values are three separate
``nn.Linear`` layers (each can be split column-wise, by heads), attention infers the number
of heads from the width it receives (so a rank that holds half the heads just works), and
every linear layer has ``bias=False``.  The last point also keeps runs reproducible across
strategies: a key bias has a gradient that is zero in exact arithmetic (softmax ignores a
shift shared by all scores), and Adam would turn its rounding noise, which depends on the
order of sums and so on the strategy, into full-size updates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of the model (byte-level: 256 tokens)."""

    vocab_size: int = 256
    block_size: int = 64     # context length in tokens
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128

    def __post_init__(self) -> None:
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_embd must divide by n_head, got {self.n_embd} and "
                             f"{self.n_head}")


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.head_dim = cfg.n_embd // cfg.n_head
        self.q = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.k = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.v = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank sees only its own heads' columns.
        q, k, v = (lin(x).view(b, t, -1, self.head_dim).transpose(1, 2)
                   for lin in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """``GPT(cfg)(idx)`` maps token ids ``[batch, time]`` to logits ``[batch, time, vocab]``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        # GPT-2's initialisation: N(0, 0.02), residual projections scaled by 1/sqrt(2 * layers)
        # so the residual stream's variance does not grow with depth.
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = (0.02 / math.sqrt(2 * self.cfg.n_layer)
                       if name.endswith("proj.weight") else 0.02)
                nn.init.normal_(p, mean=0.0, std=std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def count_parameters(cfg: GPTConfig) -> int:
    """Parameters of ``GPT(cfg)``, computed from the shape (no model needed)."""
    d, layers = cfg.n_embd, cfg.n_layer
    per_block = 4 * d * d + 8 * d * d + 4 * d          # attention, MLP, two LayerNorms
    return cfg.vocab_size * d * 2 + cfg.block_size * d + layers * per_block + 2 * d


@torch.no_grad()
def generate(model: nn.Module, prompt: torch.Tensor, new_tokens: int, block_size: int,
             temperature: float = 0.8, top_k: int = 20, seed: int = 0) -> torch.Tensor:
    """Sample ``new_tokens`` after ``prompt`` (1-d token ids); returns the new tokens.

    Every rank must call this with the same arguments: sharded models (FSDP, TP) need every
    rank in each forward, and the fixed ``seed`` makes every rank draw the same tokens.
    """
    g = torch.Generator().manual_seed(seed)
    idx = prompt[None, :]
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])
        if hasattr(logits, "full_tensor"):    # tensor parallel: a DTensor split by vocabulary
            logits = logits.full_tensor()
        logits = logits[0, -1].float() / temperature
        top = torch.topk(logits, min(top_k, logits.numel()))
        probs = F.softmax(top.values, dim=-1)
        nxt = top.indices[torch.multinomial(probs, 1, generator=g)]
        idx = torch.cat([idx, nxt[None, :]], dim=1)
    return idx[0, prompt.numel():]
