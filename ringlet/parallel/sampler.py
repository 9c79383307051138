"""``DistributedSampler``: each rank reads its own slice of a map-style dataset.

It yields exactly the indices torch's sampler yields for the same arguments, so a
script that moves to ringlet keeps its data order (and a resumed run its epochs):

1. the index order: ``torch.randperm(len(dataset))`` from a ``torch.Generator``
   seeded with ``seed + epoch`` when ``shuffle``, else ``0 .. len-1``;
2. every rank gets the same number of samples: ``drop_last`` cuts the tail to a
   multiple of ``num_replicas``; otherwise the list is padded with its own head
   (repeated as often as needed) up to the next multiple;
3. rank ``r`` takes positions ``r, r + num_replicas, r + 2 * num_replicas, ...``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import torch
from torch.utils.data import Sampler

from ringlet.c10d import world as _world

__all__ = ["DistributedSampler", "sample_indices"]


def _samples_per_rank(length: int, num_replicas: int, drop_last: bool) -> int:
    if drop_last and length % num_replicas != 0:
        # The largest multiple of num_replicas below length, so no rank repeats a sample.
        return math.ceil((length - num_replicas) / num_replicas)
    return math.ceil(length / num_replicas)


def sample_indices(length: int, num_replicas: int, rank: int, shuffle: bool, seed: int, epoch: int,
                   drop_last: bool) -> list[int]:
    """Pure: the indices rank ``rank`` reads in ``epoch`` (see the module docstring)."""
    per_rank = _samples_per_rank(length, num_replicas, drop_last)
    total = per_rank * num_replicas
    if shuffle:
        gen = torch.Generator()
        gen.manual_seed(seed + epoch)
        order: list[int] = torch.randperm(length, generator=gen).tolist()
    else:
        order = list(range(length))
    if drop_last:
        order = order[:total]
    elif total > len(order) and order:
        missing = total - len(order)
        order += (order * math.ceil(missing / len(order)))[:missing]
    return order[rank:total:num_replicas]


class DistributedSampler(Sampler[int]):
    """Sampler that restricts data loading to this rank's share of the dataset.

    Args:
        dataset: a map-style dataset (anything with ``len()``).
        num_replicas: number of ranks sharing the data; default: the default group's size.
        rank: this rank's position; default: its rank in the default group.
        shuffle: shuffle the indices (the same permutation on every rank).
        seed: random seed of the shuffle; must be the same on every rank.
        drop_last: drop the tail so the dataset splits evenly, instead of padding it
            with repeated indices.

    Call :meth:`set_epoch` at the start of every epoch when ``shuffle=True``, or
    every epoch yields the same order.

    Raises:
        ValueError: ``rank`` outside ``[0, num_replicas - 1]`` or ``num_replicas < 1``.
        RuntimeError: ``num_replicas``/``rank`` omitted and no default group exists.

    Example::

        sampler = DistributedSampler(dataset, shuffle=True, seed=42)
        loader = torch.utils.data.DataLoader(dataset, batch_size=32, sampler=sampler)
        for epoch in range(epochs):
            sampler.set_epoch(epoch)
            for batch in loader: ...
    """

    def __init__(self, dataset: Any, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False) -> None:
        if num_replicas is None or rank is None:
            if not _world.is_initialized():
                raise RuntimeError("DistributedSampler: expected num_replicas= and rank=, or an "
                                   "initialized default process group (call "
                                   "ringlet.distributed.init_process_group()), got neither")
            num_replicas = _world.get_world_size() if num_replicas is None else num_replicas
            rank = _world.get_rank() if rank is None else rank
        if num_replicas < 1:
            raise ValueError(f"DistributedSampler: expected num_replicas >= 1, got {num_replicas}")
        if not 0 <= rank < num_replicas:
            raise ValueError("DistributedSampler: expected rank in [0, "
                             f"{num_replicas - 1}], got {rank}")
        self.dataset = dataset
        self.num_replicas = num_replicas
        self.rank = rank
        self.epoch = 0
        self.drop_last = drop_last
        self.shuffle = shuffle
        self.seed = seed
        self.num_samples = _samples_per_rank(self._length(), num_replicas, drop_last)
        self.total_size = self.num_samples * num_replicas

    def _length(self) -> int:
        if not isinstance(self.dataset, Sized):
            raise TypeError("DistributedSampler: expected a dataset with len(), got "
                            f"{type(self.dataset).__name__}")
        return len(self.dataset)

    def __iter__(self) -> Iterator[int]:
        indices = sample_indices(self._length(), self.num_replicas, self.rank, self.shuffle,
                                 self.seed, self.epoch, self.drop_last)
        if len(indices) != self.num_samples:
            raise AssertionError(f"DistributedSampler: expected {self.num_samples} indices for "
                                 f"rank {self.rank}, got {len(indices)} (did the dataset "
                                 "change size after construction?)")
        return iter(indices)

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Set the epoch; with ``shuffle=True`` it seeds the permutation (``seed + epoch``)."""
        self.epoch = epoch

    def __repr__(self) -> str:
        return (f"DistributedSampler(rank {self.rank}/{self.num_replicas}, {self.num_samples} "
                f"samples, shuffle={self.shuffle}, seed={self.seed}, epoch={self.epoch}, "
                f"drop_last={self.drop_last})")
