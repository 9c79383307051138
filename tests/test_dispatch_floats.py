"""The dispatch cache keys the Python floats of elementwise ops by type ([Note: dispatch cache]):
an optimizer whose step size changes every step replays its decisions instead of asking the
rules again, with the same results; masked_fill keeps its value in the key (a zero fill keeps a
Partial, any other value does not)."""

from __future__ import annotations

import pytest
import torch

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.dtensor._spec import decisions_of
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _float_keys(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(6, 4, generator=g), torch.rand(6, 4, generator=g) + 0.5
    da, db = distribute_tensor(a, mesh, [Shard(0)]), distribute_tensor(b, mesh, [Shard(0)])
    want, got = a.clone(), da.clone()
    for step in range(1, 4):          # warm-up: the decisions are recorded
        size, corr = 0.1 / step, (1 - 0.9 ** step) ** 0.5
        got.addcdiv_(got, db / corr, value=-size)
        want.addcdiv_(want, b / corr, value=-size)
    before = len(decisions_of(mesh))
    for step in range(4, 8):          # new float values every step: no new decision
        size, corr = 0.1 / step, (1 - 0.9 ** step) ** 0.5
        got.addcdiv_(got, db / corr, value=-size)
        want.addcdiv_(want, b / corr, value=-size)
    grew = len(decisions_of(mesh)) - before
    part = DTensor.from_local(a.clone(), mesh, [Partial()])
    mask = distribute_tensor(a > 0, mesh, [Replicate()])
    zero, one = part.masked_fill(mask, 0.0), part.masked_fill(mask, 1.0)
    return {"same": torch.equal(got.full_tensor(), want), "grew": grew,
            "zero": zero.placements, "one": one.placements,
            "one value": torch.equal(one.full_tensor(), (a * n).masked_fill(a > 0, 1.0))}


@pytest.mark.parametrize("n", [1, 2])
def test_changing_floats_replay_the_decision_and_masked_fill_keeps_its_value(n: int) -> None:
    for got in run_threads(_float_keys, n):
        assert got["same"], got
        assert got["grew"] == 0, got
        assert got["zero"] == (Partial(),), got
        assert got["one"] == (Replicate(),) and got["one value"], got
