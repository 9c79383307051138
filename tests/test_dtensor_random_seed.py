"""torch's private DTensor seeding helper (issue 26): ``manual_seed(seed, mesh)`` seeds what
DTensor draws (a factory's draw equals one process's after the same seed), refuses a rank outside
the mesh and bad arguments; ``is_rng_supported_mesh`` holds for a CPU mesh (2 rank threads)."""

from __future__ import annotations

import pytest
import torch

from ringlet.distributed.device_mesh import DeviceMesh
from ringlet.distributed.tensor import Shard, randn
from ringlet.distributed.tensor._random import is_rng_supported_mesh, manual_seed
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _seed(rank: int, world: int) -> object:
    only0 = DeviceMesh("cpu", [0])
    if rank == 1:               # outside the mesh: refused; rank 1 draws nothing meanwhile
        with pytest.raises(RuntimeError, match=r"expected rank 1 to be part of"):
            manual_seed(3, only0)
        return None
    assert is_rng_supported_mesh(only0)
    with pytest.raises(TypeError, match="seed: expected an int"):
        manual_seed("3", only0)
    with pytest.raises(TypeError, match="device_mesh: expected a DeviceMesh"):
        manual_seed(3, None)
    torch.manual_seed(99)
    manual_seed(1234, only0)
    return randn(6, 2, device_mesh=only0, placements=[Shard(0)]).to_local()


def test_manual_seed_seeds_dtensor_draws() -> None:
    got, outside = run_threads(_seed, 2)
    assert outside is None
    torch.manual_seed(1234)
    assert torch.equal(got, torch.randn(6, 2))
