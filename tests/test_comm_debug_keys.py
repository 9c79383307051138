"""CommDebugMode counts keyed by torch's functional-collective ops (issue 26): every collective
DTensor issues is found under ``torch.ops.c10d_functional.<op>`` (and the always-defined
``torch.ops._c10d_functional.<op>``), names still work, a collective that did not run counts 0,
and the counts survive pickling (rank processes return them)."""

from __future__ import annotations

import pickle

import pytest
import torch

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)

OPS = ["all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single",
       "broadcast"]


def _counts(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (world,))
    x = torch.arange(16.0).view(4, 4)
    out: dict[str, object] = {}
    s0 = distribute_tensor(x, mesh, [Shard(0)])
    part = DTensor.from_local(x, mesh, [Partial()])
    moves = {
        "all_gather_into_tensor": lambda: s0.redistribute(mesh, [Replicate()]),
        "reduce_scatter_tensor": lambda: part.redistribute(mesh, [Shard(0)]),
        "all_reduce": lambda: part.redistribute(mesh, [Replicate()]),
        "all_to_all_single": lambda: s0.redistribute(mesh, [Shard(1)]),
        "broadcast": lambda: DTensor.from_local(x, mesh, [Replicate()], run_check=True),
    }
    for op, move in moves.items():
        with CommDebugMode() as comm:
            move()
        out[op] = comm.get_comm_counts()
    return out


def test_counts_are_keyed_by_torchs_functional_collective_ops() -> None:
    import torch.distributed._functional_collectives  # defines torch.ops.c10d_functional

    funcol, native = torch.ops.c10d_functional, torch.ops._c10d_functional
    for r in run_threads(_counts, 2):
        for op in OPS:
            counts = r[op]
            # run_check: an all-gather of the shapes, then the broadcast
            want = {op: 1} if op != "broadcast" else {"all_gather_into_tensor": 1, op: 1}
            assert set(counts) == {getattr(funcol, o) for o in want}, (op, counts)  # torch's keys
            assert counts == want and counts == {getattr(funcol, o): n for o, n in want.items()}
            assert counts[getattr(funcol, op)] == 1 and counts[getattr(native, op)] == 1
            assert counts[getattr(funcol, op).default] == 1 and getattr(funcol, op) in counts
            assert counts[op] == 1 and counts.get(getattr(funcol, op)) == 1
            assert all(counts[getattr(funcol, o)] == 0 for o in OPS if o not in want), counts
            assert counts[torch.ops.aten.add] == 0 and counts != {op: 2}
            back = pickle.loads(pickle.dumps(counts))
            assert back == counts and back[getattr(funcol, op)] == 1
    short = run_threads(_counts, 2)[0]["all_gather_into_tensor"]
    assert short["all_gather"] == 1 and short == {"all_gather": 1}   # ringlet's short names
