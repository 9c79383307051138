"""The dispatch cache ([Note: dispatch cache]), DTensor factories, from_local(grad_placements=),
and the attention / complex-view rules (rank threads)."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn.functional as F

import ringlet.distributed.tensor as dt
from ringlet.distributed.device_mesh import init_device_mesh
from ringlet.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from ringlet.distributed.tensor.debug import CommDebugMode
from ringlet.dtensor._spec import decisions_of
from ringlet.testing import run_threads

pytestmark = pytest.mark.timeout(60)
R, S0, S1 = Replicate(), Shard(0), Shard(1)


def _twice(fn):
    """Run ``fn`` twice: the first call decides through the rule, the second replays the
    decision."""
    first, second = fn(), fn()
    return first, second


def _cache(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(5, 4, generator=g), torch.randn(5, 4, generator=g)
    da, db, dr = (distribute_tensor(a, mesh, [S0]), distribute_tensor(b, mesh, [S1]),
                  distribute_tensor(b, mesh, [R]))
    out: dict = {}
    cases = {
        # db is resharded to S(0) each time
        "add with a move": (lambda: da + db, a + b),
        "mm": (lambda: da @ dr.t(), a @ b.t()),
        "kwargs": (lambda: torch.sum(da, dim=1, keepdim=True), a.sum(1, keepdim=True)),
        "cast": (lambda: da.to(torch.float64), a.double()),
        "list in": (lambda: torch.cat([da, da], dim=1), torch.cat([a, a], 1)),
        "list out": (lambda: torch.stack(da.split(2, dim=1)), torch.stack(a.split(2, 1))),
        "scalar tensor": (lambda: da * torch.tensor(2.0), a * 2),
        "view": (lambda: da.view(5, 2, 2), a.view(5, 2, 2)),
    }
    for name, (fn, want) in cases.items():
        first, second = _twice(fn)
        out[name] = (first._spec is second._spec or repr(first) == repr(second),
                     torch.allclose(second.full_tensor().to(want.dtype), want, atol=1e-6),
                     repr(second))
    before = len(decisions_of(mesh))
    fn = cases["add with a move"][0]
    with CommDebugMode() as comm:
        fn()
    out["replay"] = (len(decisions_of(mesh)) == before, comm.get_comm_counts())
    c = da.clone()
    # in place returns self, both paths
    assert c.mul_(2) is c and c.mul_(2) is c
    out["inplace"] = torch.allclose(c.full_tensor(), a * 4)
    # the replicate fallback takes its shapes from each call: nonzero's size depends on the data
    out["nonzero"] = [tuple(torch.nonzero(distribute_tensor(v, mesh, [R])).shape)
                      for v in (torch.tensor([0.0, 1.0, 2.0]), torch.tensor([3.0, 0.0, 0.0]))]
    # nothing cached holds a tensor
    tmp = distribute_tensor(torch.randn(6, 4, generator=g), mesh, [S0])
    ref = weakref.ref(tmp._local_tensor)
    (tmp * 3).sum().view(1)
    del tmp
    gc.collect()
    out["no tensors kept"] = ref() is None
    return out


def test_cached_decisions_replay_the_rule() -> None:
    r = run_threads(_cache, 2)[0]
    for name in ("add with a move", "mm", "kwargs", "cast", "list in", "list out",
                 "scalar tensor", "view"):
        same_spec, close, _ = r[name]
        assert same_spec and close, (name, r[name])
    assert r["add with a move"][2] == "DTensor(f32[5@tp,4] S(0))"
    assert r["replay"] == (True, {"all_to_all": 1})
    assert r["inplace"] and r["no tensors kept"]
    assert r["nonzero"] == [(2, 1), (1, 1)]


def _factories(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}
    for name, make, want in [
        ("ones", lambda pl: dt.ones(5, 3, device_mesh=mesh, placements=pl), torch.ones(5, 3)),
        ("zeros", lambda pl: dt.zeros((5, 3), device_mesh=mesh, placements=pl, dtype=torch.float64),
         torch.zeros(5, 3, dtype=torch.float64)),
        ("full", lambda pl: dt.full([5, 3], 7.0, device_mesh=mesh, placements=pl),
         torch.full((5, 3), 7.0)),
        ("empty", lambda pl: dt.empty(5, 3, device_mesh=mesh, placements=pl).fill_(1.0),
         torch.ones(5, 3)),
    ]:
        got = [make(pl) for pl in ([S0], [S1], [R], [Partial()])]
        out[name] = ([repr(x) for x in got[:2]],
                     all(torch.equal(x.full_tensor(), want) for x in got))
    return out


def test_factories() -> None:
    r = run_threads(_factories, 2)[0]
    assert r["ones"] == (["DTensor(f32[5@tp,3] S(0))", "DTensor(f32[5,3@tp] S(1))"], True)
    assert (r["zeros"][0] == ["DTensor(f64[5@tp,3] S(0))", "DTensor(f64[5,3@tp] S(1))"]
            and r["zeros"][1])
    assert r["full"][1] and r["empty"][1]


def _random(rank: int, n: int, lock) -> tuple:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = []
    for fn in (dt.rand, dt.randn):
        # rank threads share the default generator: seed and draw one rank at a time
        with lock:
            torch.manual_seed(11)
            x = fn(5, 3, device_mesh=mesh, placements=[S0], requires_grad=True)
            torch.manual_seed(11)
            whole = getattr(torch, fn.__name__)(5, 3)
        out.append((x.requires_grad, torch.equal(x.to_local(), S0.local_chunk(whole, n, rank))))
    return tuple(out)


def test_rand_and_randn_draw_the_single_process_tensor() -> None:
    import threading

    assert run_threads(_random, 2, threading.Lock()) == [((True, True), (True, True))] * 2


def _grad_placements(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    out = {}
    for label, grad_pls in (("default", None), ("partial", [Partial()])):
        local = torch.ones(3, requires_grad=True)
        x = DTensor.from_local(local, mesh, [R], grad_placements=grad_pls)
        y = x.to_local(grad_placements=[Partial()])          # each rank's gradient is a partial sum
        loss = (y * (rank + 1)).sum()
        with CommDebugMode() as comm:
            loss.backward()
        out[label] = (local.grad.tolist(), comm.get_comm_counts())
    return out


def test_from_local_grad_placements() -> None:
    for rank, r in enumerate(run_threads(_grad_placements, 2)):
        # Partial gradient reduced: 1 + 2
        assert r["default"] == ([3.0] * 3, {"all_reduce": 1})
        # kept partial, no communication
        assert r["partial"] == ([rank + 1.0] * 3, {})


def _attention(rank: int, n: int) -> dict:
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    out = {}
    for dim in (0, 1, 2):              # batch, heads (kept); sequence (gathered first)
        q, k, v = (torch.randn(2, 4, 6, 8, generator=g, requires_grad=True) for _ in range(3))
        dq, dk, dv = (distribute_tensor(t.detach(), mesh, [Shard(dim)]).requires_grad_()
                      for t in (q, k, v))
        o = F.scaled_dot_product_attention(dq, dk, dv, is_causal=True)
        o.sum().backward()
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        out[dim] = (repr(o), torch.allclose(o.full_tensor(),
                                            F.scaled_dot_product_attention(q, k, v, is_causal=True),
                                            atol=1e-5),
                    all(torch.allclose(d.grad.full_tensor(), t.grad, atol=1e-5)
                        for d, t in ((dq, q), (dk, k), (dv, v))))
    x = torch.randn(2, 6, 4, 2, generator=g)
    c = torch.view_as_complex(distribute_tensor(x, mesh, [S1]))
    back = torch.view_as_real(c * c)
    out["complex"] = (repr(c), repr(back), torch.allclose(back.full_tensor(), torch.view_as_real(
        torch.view_as_complex(x) ** 2), atol=1e-5))
    return out


def test_attention_and_complex_views() -> None:
    r = run_threads(_attention, 2)[0]
    assert r[0] == ("DTensor(f32[2@tp,4,6,8] S(0))", True, True)
    assert r[1] == ("DTensor(f32[2,4@tp,6,8] S(1))", True, True)
    assert r[2] == ("DTensor(f32[2,4,6,8] R)", True, True)
    assert r["complex"] == ("DTensor(c64[2,6@tp,4] S(1))", "DTensor(f32[2,6@tp,4,2] S(1))", True)
