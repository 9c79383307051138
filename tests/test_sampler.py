"""DistributedSampler yields exactly torch's index sequences (torch's sampler is the oracle)."""

from __future__ import annotations

import itertools

import pytest
import torch.utils.data.distributed as tdata

from ringlet.testing import run_threads
from ringlet.utils.data.distributed import DistributedSampler


class _Data:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n


@pytest.mark.timeout(60)
def test_same_indices_as_torch_for_many_arguments() -> None:
    checked = 0
    for length, replicas, shuffle, drop_last, seed in itertools.product(
            [0, 1, 2, 5, 7, 10, 16, 17, 23], [1, 2, 3, 4, 5], [True, False], [True, False], [0, 3]):
        data = _Data(length)
        for rank in range(replicas):
            ours = DistributedSampler(data, num_replicas=replicas, rank=rank,
                                      shuffle=shuffle, seed=seed, drop_last=drop_last)
            theirs = tdata.DistributedSampler(data, num_replicas=replicas, rank=rank,
                                              shuffle=shuffle, seed=seed, drop_last=drop_last)
            for epoch in (0, 1, 7):
                ours.set_epoch(epoch)
                theirs.set_epoch(epoch)
                args = (length, replicas, rank, shuffle, drop_last, seed, epoch)
                assert list(ours) == list(theirs), args
                assert len(ours) == len(theirs), args
                checked += 1
            assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)
    assert checked > 1000


@pytest.mark.timeout(30)
def test_ranks_cover_the_dataset_and_epochs_reshuffle() -> None:
    data = _Data(10)
    parts = [list(DistributedSampler(data, num_replicas=3, rank=r, seed=5)) for r in range(3)]
    flat = sorted(i for p in parts for i in p)
    assert set(flat) == set(range(10)) and len(flat) == 12       # padded with 2 repeats
    s = DistributedSampler(data, num_replicas=3, rank=0, seed=5)
    first = list(s)
    s.set_epoch(1)
    assert list(s) != first
    s.set_epoch(0)
    assert list(s) == first
    assert list(DistributedSampler(data, num_replicas=2, rank=1, shuffle=False)) == [1, 3, 5, 7, 9]


@pytest.mark.timeout(30)
def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match=r"expected rank in \[0, 1\], got 2"):
        DistributedSampler(_Data(4), num_replicas=2, rank=2)
    with pytest.raises(ValueError, match="got -1"):
        DistributedSampler(_Data(4), num_replicas=2, rank=-1)
    with pytest.raises(ValueError, match="num_replicas >= 1"):
        DistributedSampler(_Data(4), num_replicas=0, rank=0)
    with pytest.raises(RuntimeError, match="init_process_group"):
        DistributedSampler(_Data(4))


def _defaults(rank: int, world_size: int) -> tuple[int, int, list[int]]:
    s = DistributedSampler(_Data(11), seed=1)
    return s.num_replicas, s.rank, list(s)


@pytest.mark.timeout(30)
def test_defaults_come_from_the_default_group() -> None:
    got = run_threads(_defaults, 3)
    for rank, (replicas, r, indices) in enumerate(got):
        assert (replicas, r) == (3, rank)
        assert indices == list(tdata.DistributedSampler(_Data(11), num_replicas=3,
                                                        rank=rank, seed=1))
