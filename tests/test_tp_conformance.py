"""What torch's tensor-parallel tests expect (issue 26), checked on ringlet's own terms:
``with mesh:`` as the default mesh, torch's exception types for mismatched PrepareModuleInput
layouts, and a warning (not an error) for a plan key that matches no submodule (rank threads)."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import (
    DTensor,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
    ones,
)
from ringlet.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    parallelize_module,
)
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)


def _mesh_context(rank: int, world: int) -> dict[str, object]:
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "tp"))
    tp = mesh2["tp"]
    x = torch.arange(8.0).view(4, 2)
    out: dict[str, object] = {}
    with mesh2 as entered:
        out["entered"] = entered is mesh2
        dt = distribute_tensor(x, placements=[Replicate(), Shard(0)])
        out["distribute_tensor"] = (dt.device_mesh is mesh2, dt.to_local().tolist())
        out["factory"] = ones(4, placements=[Replicate(), Shard(0)]).device_mesh is mesh2
        out["from_local"] = DTensor.from_local(x, placements=[Replicate(), Replicate()]
                                               ).device_mesh is mesh2
        with tp:                                                   # nests; inner wins
            model = parallelize_module(nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2)),
                                       parallelize_plan={"0": ColwiseParallel(),
                                                         "1": RowwiseParallel()})
            out["parallelize_module"] = [p.device_mesh is tp for p in model.parameters()]
            lin = distribute_module(nn.Linear(2, 2))
            out["distribute_module"] = [p.device_mesh is tp for p in lin.parameters()]
        out["restored"] = distribute_tensor(x, placements=[Replicate(), Shard(0)]
                                            ).device_mesh is mesh2
    out["outside"] = distribute_tensor(x, placements=[Shard(0)]).device_mesh.mesh_dim_names
    with pytest.raises(AssertionError, match="not the innermost active mesh"):
        tp.__exit__(None, None, None)
    return out


def test_with_device_mesh_sets_the_default_mesh() -> None:
    for rank, r in enumerate(run_threads(_mesh_context, 2)):
        assert r["entered"] and r["factory"] and r["from_local"] and r["restored"], r
        assert r["distribute_tensor"] == (True, [[0.0, 1.0], [2.0, 3.0]] if rank == 0
                                          else [[4.0, 5.0], [6.0, 7.0]]), r
        assert r["parallelize_module"] == [True] * 4 and r["distribute_module"] == [True] * 2, r
        assert r["outside"] is None, r       # no active mesh: the whole world, as before


def test_prepare_module_input_length_mismatch_is_an_assertion_error() -> None:
    with pytest.raises(AssertionError, match="should have same length"):
        PrepareModuleInput(input_layouts=(Shard(0), None), desired_input_layouts=(Replicate(),))
    with pytest.raises(AssertionError, match="should have same length"):
        PrepareModuleInput(input_layouts=(Shard(0),), desired_input_layouts=None)


def _unmatched_plan(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    model = nn.Sequential(nn.Linear(2, 4), nn.Linear(4, 2))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parallelize_module(model, mesh, {"0": ColwiseParallel(), "gate": RowwiseParallel(),
                                         "1": RowwiseParallel()})
    out: dict[str, object] = {
        "warnings": [(w.category.__name__, str(w.message), w.filename) for w in caught],
        "applied": [isinstance(p, DTensor) for p in model.parameters()],
    }
    try:
        parallelize_module(nn.Sequential(nn.Linear(2, 4)), mesh, {"gate": ColwiseParallel()},
                           strict_plan=True)
    except ValueError as e:
        out["strict"] = str(e)
    return out


def test_plan_key_matching_no_submodule_warns_and_strict_plan_raises() -> None:
    # one rank: warnings.catch_warnings swaps process-wide state, which rank threads would share
    for r in run_threads(_unmatched_plan, 1):
        (category, message, filename), = r["warnings"]
        assert category == "UserWarning" and filename == __file__, r   # points at the caller
        assert "plan entry 'gate'" in message and "skipping this plan entry" in message, r
        assert r["applied"] == [True] * 4, r            # the other entries still apply
        assert "plan entry 'gate'" in r["strict"] and "matches no submodule" in r["strict"], r
