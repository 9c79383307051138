"""Placements and meshes print exactly as torch's do (users compare logs; tests compare reprs):
ringlet's objects against torch's own, built the same way."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.distributed.tensor import Partial as TPartial
from torch.distributed.tensor import Replicate as TReplicate
from torch.distributed.tensor import Shard as TShard
from torch.distributed.tensor._ops._math_ops import _NormPartial as TNormPartial
from torch.distributed.tensor.placement_types import _StridedShard as TStridedShard

from ringlet.distributed.device_mesh import DeviceMesh, init_device_mesh
from ringlet.distributed.tensor import Partial, Replicate, Shard
from ringlet.dtensor.placements import _NormPartial, _StridedShard
from ringlet.testing import run_threads

PAIRS = [(Shard(0), TShard(0)), (Shard(1), TShard(1)), (Shard(-1), TShard(-1)),
         (Replicate(), TReplicate()), (Partial(), TPartial()), (Partial("avg"), TPartial("avg")),
         (Partial("max"), TPartial("max")), (Partial("min"), TPartial("min")),
         (_StridedShard(0, split_factor=2), TStridedShard(0, split_factor=2)),
         (_StridedShard(1, split_factor=4), TStridedShard(1, split_factor=4)),
         (_NormPartial(norm_type=2.0), TNormPartial(2.0)),
         (_NormPartial(norm_type=float("inf")), TNormPartial(float("inf")))]


@pytest.mark.parametrize("ours,theirs", PAIRS, ids=[repr(t) for _, t in PAIRS])
def test_placement_repr_and_str_are_torchs(ours: object, theirs: object) -> None:
    assert (repr(ours), str(ours)) == (repr(theirs), str(theirs))
    assert repr([ours]) == repr([theirs]) and repr((ours,)) == repr((theirs,))


# (how to build the root, the slices and flattenings to print too); both worlds have 8 ranks
MESHES = [
    ("init", (8,), None, []),
    ("init", (8,), ("dp",), [("dp",)]),
    ("init", (2, 4), None, []),
    ("init", (2, 4), ("dp", "tp"), [("dp",), ("tp",), "flat:dp,tp"]),
    ("init", (2, 2, 2), ("a", "b", "c"), [("a",), ("b",), ("c",), ("a", "c"), ("b", "c"),
                                          "flat:a,c", "flat:b,c", "flat:a,b"]),
    ("init", (2, 1, 4), ("x", "y", "z"), [("y",), "flat:x,z", "flat:x,y", "flat:y,z"]),
    ("init", (1, 8), ("x", "y"), [("x",), ("y",)]),
    ("ranks", [[0, 2], [1, 3]], ("x", "y"), [("x",), ("y",)]),
    ("ranks", [4, 1, 7], None, []),
]


def _reprs(mesh_class: type, init: object, plan: list) -> list[str]:
    """Rank 0's view of every mesh of ``plan``; ``init`` and ``mesh_class`` are ringlet's or
    torch's (the same code runs on both)."""
    out = []
    for kind, spec, names, parts in plan:
        root = (init("cpu", tuple(spec), mesh_dim_names=names) if kind == "init"
                else mesh_class("cpu", spec, mesh_dim_names=names))
        out += [repr(root), str(root)]
        for part in parts if root.get_coordinate() is not None else ():   # members slice
            if isinstance(part, str):
                mesh = root[tuple(part[5:].split(","))]._flatten()
            else:
                mesh = root[part]
            out.append(repr(mesh))
    return out


_TORCH = """
import json, os, sys
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
sys.path.insert(0, {tests!r})
from test_torch_reprs import MESHES, _norms, _reprs
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
from torch.distributed.tensor import Shard, distribute_tensor
plain = _reprs(DeviceMesh, init_device_mesh, MESHES) + _norms(init_device_mesh, distribute_tensor,
                                                              Shard)
os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"
print(json.dumps([plain, _reprs(DeviceMesh, init_device_mesh, MESHES[3:4])]))
"""


def _norms(init: object, distribute: object, shard: type) -> list[str]:
    """The placements of p-norms of a row-sharded DTensor (a partial norm, torch's private
    ``_NormPartial``, whose repr shows the order as the caller gave it)."""
    dt = distribute(torch.ones(8, 2), init("cpu", (8,)), [shard(0)])
    return [repr(torch.linalg.vector_norm(dt, *p).placements) for p in ((), (2,), (2.0,), (3,),
                                                                         (1,))]


def _ringlet_rank(rank: int, n: int) -> list[str]:
    from ringlet.distributed.tensor import distribute_tensor

    return _reprs(DeviceMesh, init_device_mesh, MESHES) + _norms(init_device_mesh,
                                                                 distribute_tensor, Shard)


@pytest.mark.timeout(120)
def test_mesh_repr_and_str_are_torchs(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's meshes on a fake 8-rank group (in a fresh interpreter: it initializes torch's
    default group) against ringlet's on 8 rank threads: sizes, names, device, strides."""
    tests = str(__import__("pathlib").Path(__file__).parent)
    proc = subprocess.run([sys.executable, "-c", _TORCH.format(tests=tests)], capture_output=True,
                          text=True, timeout=100, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    torch_plain, torch_detail = json.loads(proc.stdout.strip().splitlines()[-1])
    ours = run_threads(_ringlet_rank, 8, timeout=90)
    assert ours[0] == torch_plain
    assert "DeviceMesh((dp=2, tp=4), 'cpu', stride=(4, 1))" in ours[0]        # not vacuous

    def detail(rank: int, n: int) -> list[str]:
        return _reprs(DeviceMesh, init_device_mesh, MESHES[3:4])      # collective: every rank

    monkeypatch.delenv("RINGLET_DEBUG", raising=False)
    monkeypatch.setenv("TORCH_DISTRIBUTED_DEBUG", "DETAIL")     # ringlet reads it as well
    assert run_threads(detail, 8, timeout=60)[0] == torch_detail
    assert torch_detail[0].endswith(", Mesh: [[0, 1, 2, 3], [4, 5, 6, 7]])")


def test_dtensor_one_line_repr_keeps_the_short_tags() -> None:
    """ringlet's own one-line DTensor repr (no torch counterpart) still uses ``str`` tags."""
    def body(rank: int, n: int) -> str:
        from ringlet.distributed.tensor import distribute_tensor

        mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
        return repr(distribute_tensor(torch.zeros(8, 4), mesh, [Shard(0)]))

    assert run_threads(body, 2)[0] == "DTensor(f32[8@tp,4] S(0))"
