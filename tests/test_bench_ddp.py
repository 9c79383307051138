"""bench/ddp.py's communication-heavy model (``wide``: few, large gradients) and its floor (the
no-sync step plus the copies and all-reduces run alone), without running the benchmark."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def bench() -> object:
    sys.path.insert(0, str(BENCH))
    try:
        yield importlib.import_module("ddp")
    finally:
        sys.path.remove(str(BENCH))


def test_wide_model_has_three_large_gradients_and_its_own_batch(bench) -> None:
    import _models as models

    model = models.wide_mlp((8, 16, 8, 16))
    shapes = [tuple(p.shape) for p in model.parameters()]
    assert shapes == [(16, 8), (16,), (8, 16), (8,), (16, 8), (16,)]
    x, y = models.wide_batch(3, (8, 16, 8, 16), seed=1)
    assert (x.shape, y.shape) == ((3, 8), (3, 16))
    assert models.mlp_loss(model, (x, y)).shape == ()
    big = models.wide_mlp()
    assert sum(p.numel() for p in big.parameters()) == 25_176_064
    assert [p.numel() for p in big.parameters() if p.dim() == 2] == [2048 * 4096] * 3
    with pytest.raises(ValueError, match="expected at least 2 widths"):
        models.wide_mlp((8,))
    cfg = bench.parse_args([])
    assert cfg.models == ("mlp", "wide", "gpt")
    assert bench.BATCH["wide"] == 16
    assert isinstance(bench._optimizer("wide", [torch.nn.Parameter(torch.ones(1))]),
                      torch.optim.SGD)


def test_floor_ratios_pair_each_step_with_its_floor(bench) -> None:
    ringlet = {"plain": [1.0, 2.0, 4.0], "ddp": [1.5, 2.2, 4.4]}
    floor = [1.2, 2.2, 4.2]                      # no-sync + 0.2 s of copies and all-reduces
    r = bench.floor_ratios(ringlet, floor)
    assert r["floor_s"] == pytest.approx(2.2)
    assert r["floor_vs_nosync"] == pytest.approx(1.1)          # median of 1.2, 1.1, 1.05
    assert r["ringlet_vs_floor"] == pytest.approx(4.4 / 4.2)   # median of 1.25, 1.0, 1.048
    with pytest.raises(ValueError, match="expected one floor per synchronised step, got 2 for 3"):
        bench.floor_ratios(ringlet, floor[:2])
