"""SyncBatchNorm over per-rank slices equals torch's BatchNorm over the whole batch.

Compared: outputs, input gradients, weight/bias gradients (summed over ranks, as DDP
would), running statistics and num_batches_tracked, for 1-d/2-d/3-d inputs, uneven
and empty per-rank batches, and every constructor option.  torch's own SyncBatchNorm
refuses CPU tensors, so the single-process BatchNorm is the oracle.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from _dp_workers import sbn_parity

import ringlet.distributed as dist
from ringlet.nn import SyncBatchNorm
from ringlet.testing import run_threads


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["0d", "1d", "2d", "3d"])
def test_parity_with_batchnorm_on_the_full_batch(kind: str) -> None:
    run_threads(sbn_parity, 2, kind, [4, 4], {})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sizes", [[3, 5], [0, 6], [2, 3, 1]],
                         ids=["uneven", "empty-rank", "three-ranks"])
def test_uneven_and_empty_batches(sizes: list[int]) -> None:
    run_threads(sbn_parity, len(sizes), "2d", sizes, {})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [{"momentum": None}, {"affine": False},
                                    {"track_running_stats": False},
                                    {"eps": 1e-2, "momentum": 0.5}], ids=["cumulative",
                                                                          "no-affine", "no-stats",
                                                                            "eps-momentum"])
def test_constructor_options(kwargs: dict[str, Any]) -> None:
    run_threads(sbn_parity, 2, "1d", [3, 4], kwargs)


def _convert(rank: int, world_size: int) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6),
                                torch.nn.Sequential(torch.nn.Unflatten(1, (6, 1, 1)),
                                                    torch.nn.BatchNorm2d(6)))
    model[2][1].eval()
    model[1].weight.requires_grad_(False)
    model(torch.randn(5, 4))    # some running statistics to carry over
    before = {k: v.clone() for k, v in model.state_dict().items()}
    old_weight = model[1].weight
    g = dist.new_group([0, 1])
    converted = SyncBatchNorm.convert_sync_batchnorm(model, process_group=g)
    assert converted is model
    assert isinstance(model[1], SyncBatchNorm) and isinstance(model[2][1], SyncBatchNorm)
    assert model[1].process_group is g and model[2][1].process_group is g
    assert model[1].weight is old_weight and not model[1].weight.requires_grad
    assert model[1].training and not model[2][1].training
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    lone = SyncBatchNorm.convert_sync_batchnorm(torch.nn.BatchNorm3d(2))
    assert type(lone) is SyncBatchNorm and lone.process_group is None
    twin = copy.deepcopy(model)
    assert twin[1].process_group is g and twin[1].weight is not model[1].weight
    out = twin(torch.randn(4, 4))
    assert out.shape == (4, 6, 1, 1)


@pytest.mark.timeout(30)
def test_convert_sync_batchnorm() -> None:
    run_threads(_convert, 2)


@pytest.mark.timeout(30)
def test_without_a_group_it_is_batchnorm() -> None:
    sbn, ref = SyncBatchNorm(3), torch.nn.BatchNorm2d(3)
    x = torch.randn(4, 3, 2, 2)
    torch.testing.assert_close(sbn(x), ref(x))
    torch.testing.assert_close(sbn.running_var, ref.running_var)
    with pytest.raises(ValueError, match="expected at least 2-D input"):
        sbn(torch.randn(3))
    with pytest.raises(ValueError, match="non-zero number of input channels"):
        SyncBatchNorm(0)(torch.randn(2, 0))


def _single_value(rank: int, world_size: int) -> str:
    sbn = SyncBatchNorm(2)
    try:
        sbn(torch.randn(1 if rank == 0 else 0, 2))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(30)
def test_one_value_per_channel_across_the_group_is_refused_on_every_rank() -> None:
    for msg in run_threads(_single_value, 2):
        assert "expected more than 1 value per channel across the group" in msg and "[1, 0]" in msg
