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
    assert bench.optimizer_of(cfg, "wide") == "sgd" and bench.optimizer_of(cfg, "mlp") == "adamw"
    assert bench.optimizer_of(bench.parse_args(["--optimizer", "sgd"]), "mlp") == "sgd"
    assert isinstance(bench._optimizer("sgd", [torch.nn.Parameter(torch.ones(1))]),
                      torch.optim.SGD)
    for bad in (["--optimizer", "lamb"], ["--models", "mlp,nope"]):
        with pytest.raises(SystemExit):             # a usage error, through bench/_common.py
            bench.parse_args(bad)


def test_paired_ratio_pairs_each_step_with_its_reference(bench) -> None:
    assert bench.paired_ratio([1.5, 2.2, 4.4], [1.2, 2.2, 4.2]) == pytest.approx(4.4 / 4.2)
    with pytest.raises(ValueError, match="expected as many reference steps as steps, got 2 for 3"):
        bench.paired_ratio([1.5, 2.2, 4.4], [1.2, 2.2])
    assert "no overlap" in bench.MAIN_MODES


def test_the_floors_serial_reduction_averages_the_gradients(bench) -> None:
    from ringlet.testing import run_threads

    def rank(r: int, n: int) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        serial = bench.SerialReduction(model)
        out = []
        for step in range(2):                       # twice: the buffers are reused
            model(torch.full((1, 3), float(r + step))).sum().backward()
            serial.reduce()
            out.append(model.weight.grad.clone())
            model.zero_grad()
        return out

    results = run_threads(rank, 2)
    for step in range(2):
        # d(sum)/dW = x per output row; ranks' x = r + step: average (0 + 1) / 2 + step
        expected = torch.full((2, 3), 0.5 + step)
        for r in range(2):
            assert torch.equal(results[r][step], expected), (r, step, results[r][step])
