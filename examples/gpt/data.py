"""Text every machine has, as bytes: the Python standard library's own sources.

The default corpus is the ``*.py`` files at the top of the standard library folder
(``os.path.dirname(os.__file__)``), read in sorted order until a byte budget is reached, so
every rank (and every run on the same Python) reads exactly the same bytes without
downloading anything.  ``--data FILE`` trains on your own text instead.

Tokens are bytes (vocabulary 256): no tokenizer to train or ship, any file works, and the
sample at the end decodes back to text.  The last ``val_fraction`` of the bytes is held out
for evaluation: with the standard library that means whole modules the model never saw.
"""

from __future__ import annotations

import glob
import os
from dataclasses import dataclass

import torch


def stdlib_text(budget: int) -> tuple[bytes, str]:
    """Up to ``budget`` bytes of the standard library's sources and a description of them."""
    root = os.path.dirname(os.__file__)
    chunks, total, used = [], 0, 0
    for path in sorted(glob.glob(os.path.join(root, "*.py"))):
        with open(path, "rb") as f:
            data = f.read()
        chunks.append(data[:budget - total])
        total += len(chunks[-1])
        used += 1
        if total >= budget:
            break
    return b"".join(chunks), f"{used} files of the Python standard library ({root})"


def read_corpus(path: str | None, budget: int) -> tuple[bytes, str]:
    """The training text: ``path``'s first ``budget`` bytes, or the standard library's."""
    if path is None:
        return stdlib_text(budget)
    with open(path, "rb") as f:
        data = f.read(budget)
    return data, f"{path}"


@dataclass
class TextData:
    """A corpus split into train and validation bytes, with deterministic batches."""

    train: torch.Tensor        # uint8 token ids
    val: torch.Tensor
    block_size: int
    description: str

    @classmethod
    def load(cls, path: str | None, block_size: int, budget: int = 2 << 20,
             val_fraction: float = 0.1) -> TextData:
        data, description = read_corpus(path, budget)
        tokens = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        n_val = int(len(tokens) * val_fraction)
        if len(tokens) - n_val <= block_size + 1 or n_val <= block_size + 1:
            raise ValueError("--data: expected at least "
                             f"{int(2 * (block_size + 2) / val_fraction)} bytes (block size "
                             f"{block_size}, {val_fraction:.0%} held out), got {len(tokens)}")
        return cls(tokens[:-n_val], tokens[-n_val:], block_size, description)

    def batch(self, split: str, key: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``rows`` random windows of ``split`` chosen by ``key`` alone: inputs and next-byte
        targets.

        Every rank computes the same global batch for a key and takes its own rows, so the
        data a step sees does not depend on the strategy or the number of ranks, and a
        resumed run sees exactly what an uninterrupted one would.
        """
        text = self.train if split == "train" else self.val
        g = torch.Generator().manual_seed(key)
        starts = torch.randint(0, len(text) - self.block_size - 1, (rows,), generator=g)
        window = text[starts[:, None] + torch.arange(self.block_size + 1)].long()
        return window[:, :-1], window[:, 1:]
