"""``_StridedShard``: the dp-inside-tp layout fully_shard gives tensor-parallel parameters.

Checked against plain arithmetic on the full tensor: local pieces, redistribution to and from
every placement pair on a 2x2 mesh (even and uneven sizes), ``full_tensor``, elementwise ops and
norms (what optimizers and clip_grad_norm_ run), and ops that cannot keep the layout refusing
rather than computing a wrong value.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from ringlet.dtensor._shard_math import local_shape_and_offset
from ringlet.dtensor.placements import _StridedShard
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)
R = Replicate()


def test_local_shape_and_offset_applies_strided_shards_last() -> None:
    pls = [_StridedShard(0, 2), Shard(0)]
    # 8 rows on (dp=2, tp=2): tp chunk t = rows 4t..4t+4, dp piece d of it = 2 rows
    got = {(d, t): local_shape_and_offset((8, 3), (2, 2), (d, t), pls)
           for d in range(2) for t in range(2)}
    assert got == {(0, 0): ([2, 3], [0, 0]), (1, 0): ([2, 3], [2, 0]), (0, 1): ([2, 3], [4, 0]),
                   (1, 1): ([2, 3], [6, 0])}
    # uneven: 7 rows -> tp chunks 4, 3 -> dp pieces (2, 2), (2, 1)
    assert [local_shape_and_offset((7,), (2, 2), (d, t), pls)[0][0] for t in range(2)
            for d in range(2)] == \
        [2, 2, 2, 1]
    assert repr(_StridedShard(0, 2)) == "_StridedShard(dim=0, sf=2)" and \
        str(_StridedShard(0, 2)) == "_S(0, 2)" and _StridedShard(0, 2) != Shard(0)


PLACEMENTS = [(_StridedShard(0, 2), Shard(0)), (Shard(0), Shard(0)), (R, Shard(0)),
              (Shard(0), R), (R, R),
              (Shard(1), Shard(0)), (_StridedShard(0, 2), Shard(1)), (_StridedShard(0, 2), R)]


def _expected_local(full: torch.Tensor, pls: tuple, coord: list[int]) -> torch.Tensor:
    shape, offset = local_shape_and_offset(tuple(full.shape), (2, 2), coord, pls)
    out = full
    for d, (n, o) in enumerate(zip(shape, offset)):
        out = out.narrow(d, o, n)
    return out


def _redistribute_all(rank: int, world: int, rows: int) -> list[str]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
    coord = mesh.get_coordinate()
    bad = []
    for src, dst in itertools.product(PLACEMENTS, PLACEMENTS):
        dt = distribute_tensor(full, mesh, list(src))
        if not torch.equal(dt.to_local(), _expected_local(full, src, coord)):
            bad.append(f"distribute {src}")
        out = dt.redistribute(mesh, list(dst))
        if not torch.equal(out.to_local(), _expected_local(full, dst, coord)):
            bad.append(f"{src} -> {dst}")
        if not torch.equal(out.full_tensor(), full):
            bad.append(f"full_tensor of {dst}")
    return bad


@pytest.mark.parametrize("rows", [8, 7, 3])
def test_redistribution_between_strided_and_plain_placements(rows: int) -> None:
    for bad in run_threads(_redistribute_all, 4, rows):
        assert bad == [], bad


def _optimizer_ops(rank: int, world: int) -> dict[str, object]:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    pls = [_StridedShard(0, 2), Shard(0)]
    g = torch.Generator().manual_seed(0)       # not the global RNG: rank threads share it
    full_p, full_g = torch.randn(7, 3, generator=g), torch.randn(7, 3, generator=g)
    p = torch.nn.Parameter(distribute_tensor(full_p, mesh, pls))
    p.grad = distribute_tensor(full_g, mesh, pls)
    opt = torch.optim.AdamW([p], lr=0.1, foreach=True)
    opt.step()
    ref_p = torch.nn.Parameter(full_p.clone())
    ref_p.grad = full_g.clone()
    ref_opt = torch.optim.AdamW([ref_p], lr=0.1, foreach=True)
    ref_opt.step()
    norm = torch.nn.utils.clip_grad_norm_([p], max_norm=0.5)
    ref_norm = torch.nn.utils.clip_grad_norm_([ref_p], max_norm=0.5)
    out: dict[str, object] = {
        "placements": tuple(p.placements),
        "step": (p.full_tensor() - ref_p.detach()).abs().max().item(),
        "norm": abs(float(norm.full_tensor() if isinstance(norm, DTensor)
                          else norm) - float(ref_norm)),
        "clipped": (p.grad.full_tensor() - ref_p.grad).abs().max().item(),
        "add": (torch.add(p, p.grad).full_tensor() - (ref_p + ref_p.grad)).abs().max().item(),
    }
    try:
        p.detach().t()               # an op that cannot keep the strided layout: refused, not wrong
        out["view"] = "no error"
    except (NotImplementedError, RuntimeError) as e:
        out["view"] = str(e)
    return out


def test_optimizer_and_clipping_on_strided_parameters_match_plain_tensors() -> None:
    for r in run_threads(_optimizer_ops, 4):
        assert r["placements"] == (_StridedShard(0, 2), Shard(0)), r
        assert r["step"] < 1e-6 and r["norm"] < 1e-5 and r["clipped"] < 1e-6 and r["add"] < 1e-6, r
        assert "_S(0, 2)" in str(r["view"]), r
