"""DDP's surface and error texts: construction checks (D1), unused parameters (D2), uneven inputs
(D3 without Join), no_sync, comm hook buckets, bucket rebuild, and torch's module API."""

from __future__ import annotations

import copy
from typing import Any

import _ddp_workers as W
import pytest
import torch
from torch import nn

import ringlet.distributed as dist
from ringlet.parallel.ddp import DistributedDataParallel as DDP
from ringlet.parallel.ddp import GradBucket
from ringlet.testing import run_threads


def _message(fn: Any) -> str:
    try:
        fn()
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.timeout(30)
def test_different_models_fail_on_every_rank_naming_the_difference() -> None:
    def body(rank: int, n: int) -> str:
        model = W.mlp(width=12 if rank == 0 else 10)
        return _message(lambda: DDP(model))
    msgs = run_threads(body, 2)
    for m in msgs:
        assert m.startswith("RuntimeError: DistributedDataParallel"), m
        assert ("rank 1: first difference at entry 0: parameter '0.weight' [10, 6] float64, "
                "rank 0 has parameter '0.weight' [12, 6] float64" in m), m

    def extra(rank: int, n: int) -> str:
        model = W.mlp()
        if rank == 2:
            model.append(nn.Linear(3, 3).double())
        return _message(lambda: DDP(model))
    msgs = run_threads(extra, 3)
    assert all("rank 2: 8 parameters vs 6; first difference at entry 6: parameter '5.weight' [3, "
               "3] float64, rank 0 has nothing" in m for m in msgs), msgs


@pytest.mark.timeout(30)
def test_init_sync_broadcasts_rank0_values() -> None:
    def body(rank: int, n: int, init_sync: bool) -> list[torch.Tensor]:
        model = W.bn_net(seed=rank)
        model[1].running_mean.fill_(rank)
        DDP(model, init_sync=init_sync)
        return [t.clone() for t in model.state_dict().values()]
    a, b = run_threads(body, 2, True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    a, b = run_threads(body, 2, False)
    assert not torch.equal(a[0], b[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rank_dependent", [False, True])
def test_unused_parameter_without_find_unused_is_a_clear_error(rank_dependent: bool) -> None:
    def body(rank: int, n: int) -> list[str]:
        ddp = DDP(W.branchy())
        msgs = []
        for step in range(2):
            which = ("a" if rank == 0 else "b") if rank_dependent else "a"
            msgs.append(_message(lambda: ddp(W.data(rank, step, (4, 6)), which).sum().backward()))
        return msgs
    for rank, msgs in enumerate(run_threads(body, 2)):
        for it, m in enumerate(msgs, 1):
            assert m.startswith(f"RuntimeError: DistributedDataParallel (rank {rank}): expected "
                                "every parameter that requires grad to receive a gradient in "
                                f"iteration {it}"), m
            assert "find_unused_parameters=True" in m
            if rank_dependent:
                assert "rank 0: 'b.weight', 'b.bias', 'never.weight', 'never.bias'" in m, m
                assert "rank 1: 'a.weight', 'a.bias', 'never.weight', 'never.bias'" in m, m
            else:
                assert ("rank 0: 'b.weight', 'b.bias', 'never.weight', 'never.bias'; rank 1: "
                        "'b.weight'" in m), m


@pytest.mark.timeout(30)
def test_uneven_inputs_without_join_name_the_ddp_iteration() -> None:
    def body(rank: int, n: int) -> str:
        ddp = DDP(W.mlp())

        def loop() -> None:
            for step in range(3 if rank == 0 else 5):
                W.mlp_loss(ddp, rank, step).backward()
            if rank == 0:
                dist.barrier()       # rank 0 moves on; rank 1 is in iteration 4's backward
        return _message(loop)
    msgs = run_threads(body, 2, op_timeout=2.0, timeout=30)
    assert "barrier" in msgs[0], msgs[0]
    assert "DistributedDataParallel (rank 1) iteration 4, gradient all-reduce: " in msgs[1], msgs[1]
    assert "uneven inputs" in msgs[1] and "join()" in msgs[1], msgs[1]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("view", [False, True])
def test_no_sync_accumulates_then_syncs(view: bool) -> None:
    def body(rank: int, n: int) -> dict[str, Any]:
        net, ref = W.mlp(), W.mlp()
        ddp = DDP(net, gradient_as_bucket_view=view, bucket_cap_mb=0.0005)
        pg = ddp.process_group
        pg.reset_counts()
        for micro in range(2):
            with ddp.no_sync():
                assert ddp.require_backward_grad_sync is False
                W.mlp_loss(ddp, rank, micro).backward()
        no_sync_counts = pg.counts()
        W.mlp_loss(ddp, rank, 2).backward()
        for micro in range(3):
            (sum(W.mlp_loss(ref, r, micro) for r in range(n)) / n).backward()
        diff = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(net.parameters(), ref.parameters()))
        return {"diff": diff, "counts": no_sync_counts}
    for res in run_threads(body, 2):
        assert res["diff"] < 1e-12
        assert res["counts"] == {}, res["counts"]


@pytest.mark.timeout(30)
def test_require_backward_grad_sync_set_before_each_micro_step() -> None:
    # nanoGPT's accumulation: the flag is assigned directly before every forward (True only on
    # the last micro step), never through no_sync(); two iterations, so a flag left True by the
    # first iteration's last micro step must not leak into the next iteration's first.
    def body(rank: int, n: int) -> dict[str, Any]:
        net, ref = W.mlp(), W.mlp()
        ddp = DDP(net)
        pg = ddp.process_group
        counts, diffs = [], []
        for it in range(2):
            for micro in range(3):
                ddp.require_backward_grad_sync = micro == 2
                pg.reset_counts()
                W.mlp_loss(ddp, rank, 3 * it + micro).backward()
                counts.append(pg.counts())
                (sum(W.mlp_loss(ref, r, 3 * it + micro) for r in range(n)) / n).backward()
            diffs.append(max((p.grad - q.grad).abs().max().item()
                             for p, q in zip(net.parameters(), ref.parameters())))
            for p in [*net.parameters(), *ref.parameters()]:
                p.grad = None
        return {"diffs": diffs, "counts": counts}
    for res in run_threads(body, 2):
        assert max(res["diffs"]) < 1e-12, res["diffs"]
        # (the second iteration's first forward broadcasts rank 0's bucket order once, as torch's
        # rebuild after the first iteration does; no gradient is reduced before the last step)
        syncs = [c.get("all_reduce", 0) for c in res["counts"]]
        assert syncs[0] == syncs[1] == syncs[3] == syncs[4] == 0 < syncs[2] and syncs[5] > 0, res


@pytest.mark.timeout(30)
def test_comm_hook_sees_grad_buckets_with_local_gradients() -> None:
    def body(rank: int, n: int) -> list[dict[str, Any]]:
        net = W.mlp()
        local = copy.deepcopy(net)
        W.mlp_loss(local, rank, 0).backward()
        seen: list[dict[str, Any]] = []

        def hook(state: Any, bucket: GradBucket) -> torch.futures.Future:
            grads = [g.clone() for g in bucket.gradients()]
            mine = [p.grad for p in local.parameters()]
            ids = [next(k for k, p in enumerate(net.parameters()) if p is q)
                   for q in bucket.parameters()]
            seen.append({"index": bucket.index(), "last": bucket.is_last(), "ids": ids,
                         "match": all(torch.equal(g, mine[i]) for g, i in zip(grads, ids)),
                         "flat": bucket.buffer().numel() == sum(g.numel() for g in grads)})
            state["calls"] += 1
            return (dist.all_reduce(bucket.buffer(), op=dist.ReduceOp.AVG,
                                    async_op=True).get_future())

        ddp = DDP(net, bucket_cap_mb=0.0005)
        state = {"calls": 0}
        ddp.register_comm_hook(state, hook)
        with pytest.raises(RuntimeError, match="already registered"):
            ddp.register_comm_hook(state, hook)
        W.mlp_loss(ddp, rank, 0).backward()
        return seen
    seen = run_threads(body, 2)[0]
    assert [s["index"] for s in seen] == list(range(len(seen))) and len(seen) > 1
    assert [s["last"] for s in seen] == [False] * (len(seen) - 1) + [True]
    assert all(s["match"] and s["flat"] for s in seen)
    assert sorted(i for s in seen for i in s["ids"]) == list(range(6))
    assert [s["ids"] for s in seen] == [[5, 4, 3], [2], [1], [0]]   # reverse registration order


class Reordered(nn.Module):
    """Registered a, b, c but applied c, b, a: backward produces a's gradients first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(self.b(self.c(x)))


@pytest.mark.timeout(30)
def test_buckets_rebuilt_once_in_observed_order() -> None:
    def body(rank: int, n: int) -> list[list[tuple[int, ...]]]:
        ddp = DDP(W.init_(Reordered().double(), 0), bucket_cap_mb=0.0003)
        plans = [[b.indices for b in ddp.reducer.layout.plans]]
        for step in range(3):
            ddp(W.data(rank, step, (2, 6))).sum().backward()
            plans.append([b.indices for b in ddp.reducer.layout.plans])
        return plans
    a, b = run_threads(body, 2)
    assert a == b
    assert a[0] == a[1] == [(5, 4), (3, 2), (1, 0)]            # default: reverse registration
    assert a[2] == a[3] == [(1, 0), (3, 2), (5, 4)]            # rebuilt at the 2nd forward: a first


@pytest.mark.timeout(30)
def test_module_api_like_torch() -> None:
    class Mesh:
        ndim = 1

        def get_group(self) -> Any:
            return dist.group.WORLD

    def body(rank: int, n: int) -> dict[str, Any]:
        net = W.mlp()
        ddp = DDP(net, device_mesh=Mesh())
        out: dict[str, Any] = {"module": ddp.module is net, "keys": list(ddp.state_dict())[:2],
                               "group": ddp.process_group is dist.group.WORLD._default_pg()
                               if hasattr(dist.group.WORLD, "_default_pg") else True}
        out["getattr"] = _message(lambda: ddp.no_such_thing)
        out["device_ids"] = _message(lambda: DDP(W.mlp(), device_ids=[0]))
        out["mp"] = _message(lambda: DDP(W.mlp(), mixed_precision=object()))
        out["both"] = _message(lambda: DDP(W.mlp(), process_group=dist.group.WORLD,
                                           device_mesh=Mesh()))
        out["frozen"] = _message(lambda: DDP(W.mlp().requires_grad_(False)))
        out["cap"] = _message(lambda: DDP(W.mlp(), bucket_cap_mb=-1))
        return out
    res = run_threads(body, 2)[0]
    assert res["module"] and res["keys"] == ["module.0.weight", "module.0.bias"]
    assert res["getattr"].startswith("AttributeError")
    assert res["device_ids"].startswith("ValueError: DistributedDataParallel: device_ids")
    assert res["mp"].startswith("NotImplementedError: DistributedDataParallel: mixed_precision")
    assert res["both"] == ("ValueError: DistributedDataParallel: Cannot specify both process_group "
                           "and device_mesh arguments (expected one of them, got both)")
    assert res["frozen"].startswith("RuntimeError: DistributedDataParallel is not needed")
    assert "expected bucket_cap_mb >= 0" in res["cap"]


@pytest.mark.timeout(30)
def test_public_mirror_paths() -> None:
    import ringlet.nn.parallel as rnp
    from ringlet.nn.parallel import DistributedDataParallel
    from ringlet.nn.parallel.distributed import DistributedDataParallel as D2
    from ringlet.parallel import DistributedDataParallel as D3

    assert DistributedDataParallel is D2 is D3 is DDP
    assert "DistributedDataParallel" in rnp.__all__


class Reused(nn.Module):
    """One layer applied in two reentrant checkpoints: its gradient hook fires twice per
    backward."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.shared, self.out = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        h = torch.tanh(self.inp(x))
        h = checkpoint(self.shared, h, use_reentrant=True)
        h = checkpoint(self.shared, torch.tanh(h), use_reentrant=True)
        return self.out(h)


@pytest.mark.timeout(30)
def test_parameter_reused_in_reentrant_checkpoints_needs_static_graph() -> None:
    def body(rank: int, n: int, static: bool) -> Any:
        net, ref = W.init_(Reused().double(), 0), W.init_(Reused().double(), 0)
        ddp = DDP(net, bucket_cap_mb=0, static_graph=static)     # a bucket per parameter
        for step in range(4):
            msg = _message(lambda: ddp(W.data(rank, step, (4, 6))).square().mean().backward())
            if msg != "no error":
                return msg
            (sum(ref(W.data(r, step, (4, 6))).square().mean() for r in range(n)) / n).backward()
        return max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(net.parameters(), ref.parameters()))
    for diff in run_threads(body, 2, True):
        assert diff < 1e-9
    for msg in run_threads(body, 2, False):
        assert "parameter 'shared.bias' received a gradient after its bucket" in msg, msg
        assert "static_graph=True" in msg


@pytest.mark.timeout(30)
def test_forward_without_backward_then_no_sync_does_not_reduce() -> None:
    def body(rank: int, n: int) -> dict[str, Any]:
        net, ref = W.mlp(), W.mlp()
        ddp = DDP(net)
        W.mlp_loss(ddp, rank, 0)                      # grad enabled, never backpropagated
        ddp.process_group.reset_counts()
        with ddp.no_sync():
            W.mlp_loss(ddp, rank, 1).backward()        # must stay local
        counts = ddp.process_group.counts()
        W.mlp_loss(ddp, rank, 2).backward()
        for step in (1, 2):
            (sum(W.mlp_loss(ref, r, step) for r in range(n)) / n).backward()
        diff = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(net.parameters(), ref.parameters()))
        return {"counts": counts, "diff": diff}
    for res in run_threads(body, 2):
        assert res["counts"] == {} and res["diff"] < 1e-12, res


@pytest.mark.timeout(30)
def test_ignored_parameters_are_neither_broadcast_nor_reduced() -> None:
    def body(rank: int, n: int) -> list[float]:
        net = W.mlp(seed=rank)
        DDP._set_params_and_buffers_to_ignore_for_model(net, ["4.weight", "4.bias"])
        ddp = DDP(net)
        W.mlp_loss(ddp, rank, 0).backward()
        return [net[4].weight.sum().item(), net[4].weight.grad.sum().item(),
                net[0].weight.sum().item()]
    a, b = run_threads(body, 2)
    assert a[0] != b[0] and a[1] != b[1]               # ignored: own values, own gradient
    assert a[2] == b[2]                                 # the rest came from rank 0
