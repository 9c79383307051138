"""DDP comm hooks on a fake GradBucket, checked against their mathematical definitions.

- all-reduce: the exact average;
- fp16/bf16: the same sum done in the low-precision dtype, within its error bound;
- PowerSGD: plain all-reduce during warm-up; exact when the average gradient has
  rank <= r; error feedback keeps ``Σ outputs = K·avg(g) − avg(residual)``.
"""

from __future__ import annotations

import pickle
from typing import Any

import pytest
import torch

import ringlet.distributed as dist
from ringlet.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from ringlet.parallel.comm_hooks.powerSGD_hook import plan_bucket
from ringlet.testing import run_threads

PowerSGDState = powerSGD_hook.PowerSGDState


class FakeBucket:
    """torch's GradBucket API over one flat buffer; gradients() are views of the buffer."""

    def __init__(self, grads: list[torch.Tensor], index: int = 0, last: bool = True) -> None:
        self._buffer = torch.cat([g.reshape(-1) for g in grads]) if grads else torch.zeros(0)
        self._shapes = [g.shape for g in grads]
        self._index, self._last = index, last

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        out, off = [], 0
        for s in self._shapes:
            out.append(self._buffer[off:off + s.numel()].view(s))
            off += s.numel()
        return out

    def parameters(self) -> list[torch.Tensor]:
        return [torch.zeros(s) for s in self._shapes]

    def is_last(self) -> bool:
        return self._last


def _grads(rank: int, shapes: list[tuple[int, ...]], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 100 + rank)
    return [torch.randn(s, generator=g) for s in shapes]


def _average(world_size: int, shapes: list[tuple[int, ...]], seed: int = 0) -> torch.Tensor:
    flat = [torch.cat([t.reshape(-1) for t in _grads(r, shapes, seed)]) for r in range(world_size)]
    return torch.stack(flat).mean(0)


# -- default hooks ---------------------------------------------------------------------------------
def _allreduce(rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor, dict[str, int]]:
    bucket = FakeBucket(_grads(rank, [(3, 4), (5,)]))
    pg = dist.group.WORLD
    pg.reset_counts()
    res = default_hooks.allreduce_hook(None, bucket).wait()
    return res, bucket.buffer(), pg.counts()


@pytest.mark.timeout(30)
def test_allreduce_hook_averages() -> None:
    avg = _average(3, [(3, 4), (5,)])
    for res, buf, counts in run_threads(_allreduce, 3):
        torch.testing.assert_close(res, avg)
        assert res.data_ptr() == buf.data_ptr()       # written into the bucket
        assert counts == {"all_reduce": 1}


def _subgroup(rank: int, world_size: int) -> Any:
    g = dist.new_group([0, 2])
    if rank == 1:
        return None
    bucket = FakeBucket([torch.full((4,), float(rank))])
    return default_hooks.allreduce_hook(g, bucket).wait()


@pytest.mark.timeout(30)
def test_allreduce_hook_on_a_subgroup() -> None:
    out = run_threads(_subgroup, 3)
    assert (out[1] is None and torch.equal(out[0], torch.ones(4))
            and torch.equal(out[2], torch.ones(4)))


def _compressed(rank: int, world_size: int,
                which: str) -> tuple[torch.Tensor, torch.dtype, torch.dtype]:
    bucket = FakeBucket(_grads(rank, [(6, 5), (7,)], seed=1))
    hooks = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook,
             "fp16_wrap": default_hooks.fp16_compress_wrapper(default_hooks.allreduce_hook),
             "bf16_wrap": default_hooks.bf16_compress_wrapper(default_hooks.allreduce_hook)}
    res = hooks[which](None, bucket).wait()
    return res, res.dtype, bucket.buffer().dtype


@pytest.mark.timeout(30)
@pytest.mark.parametrize("which", ["fp16", "bf16", "fp16_wrap", "bf16_wrap"])
def test_low_precision_hooks(which: str) -> None:
    n = 3
    dtype = torch.float16 if which.startswith("fp16") else torch.bfloat16
    shapes = [(6, 5), (7,)]
    flats = [torch.cat([t.reshape(-1) for t in _grads(r, shapes, seed=1)]) for r in range(n)]
    # The definition: cast, divide by the group size, sum in rank order, all in the low-precision
    # dtype.
    ref = flats[0].to(dtype).div_(n)
    for f in flats[1:]:
        ref = ref + f.to(dtype).div_(n)
    exact = torch.stack(flats).mean(0)
    # relative precision of the format
    unit = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    for res, res_dtype, buf_dtype in run_threads(_compressed, n, which):
        assert res_dtype == torch.float32 and buf_dtype == torch.float32
        torch.testing.assert_close(res, ref.float(), rtol=0, atol=0)
        assert (res - exact).abs().max() <= unit * 2 * flats[0].abs().max() * n
        assert not torch.equal(res, exact)         # it really went through the low-precision dtype


# -- PowerSGD ------------------------------------------------------------------------------------
# compressed, vector, too small, 3-d compressed
LOW_RANK_SHAPES = [(16, 12), (12,), (3, 4), (8, 4, 5)]


def _low_rank(rank: int, r: int) -> list[torch.Tensor]:
    """Gradients whose group average has rank <= r (a shared right factor per matrix)."""
    g = torch.Generator().manual_seed(rank)
    shared = torch.Generator().manual_seed(99)
    out = []
    for s in LOW_RANK_SHAPES:
        if len(s) >= 2:
            m = int(torch.Size(s[1:]).numel())
            v = torch.randn(r, m, generator=shared)
            out.append((torch.randn(s[0], r, generator=g) @ v).view(s))
        else:
            out.append(torch.randn(s, generator=g))
    return out


def _run_powersgd(rank: int, world_size: int, iters: int, r: int, kwargs: dict[str, Any],
                  wrap: bool = False) -> list[dict[str, Any]]:
    state = PowerSGDState(None, matrix_approximation_rank=r, **kwargs)
    hook = (default_hooks.fp16_compress_wrapper(powerSGD_hook.powerSGD_hook) if wrap
            else powerSGD_hook.powerSGD_hook)
    pg = dist.group.WORLD
    log = []
    for _ in range(iters):
        buckets = [FakeBucket(_low_rank(rank, r)[:2], index=0, last=False),
                   FakeBucket(_low_rank(rank, r)[2:], index=1, last=True)]
        pg.reset_counts()
        futs = [hook(state, b) for b in buckets]
        out = torch.cat([f.wait() for f in futs])
        log.append({"out": out, "counts": pg.counts(), "iter": state.iter})
    log[-1]["stats"] = state.compression_stats()
    return log


def _low_rank_average(n: int, r: int) -> torch.Tensor:
    return (torch.stack([torch.cat([t.reshape(-1) for t in _low_rank(k, r)])
                         for k in range(n)]).mean(0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kwargs", [
    {"start_powerSGD_iter": 2},
    {"start_powerSGD_iter": 2, "orthogonalization_epsilon": 1e-12},
    {"start_powerSGD_iter": 1, "use_error_feedback": False, "warm_start": False},
], ids=["qr", "gram-schmidt", "no-memory"])
def test_powersgd_is_exact_for_low_rank_averages(kwargs: dict[str, Any]) -> None:
    n, r = 3, 2
    avg = _low_rank_average(n, r)
    logs = run_threads(_run_powersgd, n, 4, r, kwargs)
    start = kwargs["start_powerSGD_iter"]
    for log in logs:
        for k, step in enumerate(log):
            torch.testing.assert_close(step["out"], avg, rtol=1e-4, atol=1e-4)
            assert step["iter"] == k + 1
            # warm-up: one plain all-reduce per bucket; then [uncompressed, P, Q] per bucket
            assert step["counts"] == {"all_reduce": 2 if k < start else 6}, (k, step["counts"])
        rate, before, after = log[-1]["stats"]
        per_iter = 16 * 12 + 12 + 12 + 160
        assert before == per_iter * (4 - start)
        assert after == ((16 + 12) * 2 + 12 + 12 + (8 + 20) * 2) * (4 - start)
        assert rate == pytest.approx(before / after)
    for log in logs[1:]:
        for a, b in zip(log, logs[0]):
            assert torch.equal(a["out"], b["out"])         # every rank holds the same result


@pytest.mark.timeout(60)
def test_fp16_wrapped_powersgd() -> None:
    n, r = 2, 2
    avg = _low_rank_average(n, r)
    for log in run_threads(_run_powersgd, n, 3, r, {"start_powerSGD_iter": 2}, True):
        for step in log:
            assert step["out"].dtype == torch.float32
            torch.testing.assert_close(step["out"], avg, rtol=0, atol=0.05 * avg.abs().max().item())


def _error_feedback(rank: int, world_size: int, iters: int) -> dict[str, Any]:
    state = PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    g = _grads(rank, [(10, 8), (8,)], seed=3)
    total = torch.zeros(88)
    prev_error = torch.zeros(88)
    outs = []
    for k in range(iters):
        bucket = FakeBucket(g)
        out = powerSGD_hook.powerSGD_hook(state, bucket).wait().clone()
        if k >= 2:
            # residual = (gradient + previous residual) - result, per rank
            expected = torch.cat([t.reshape(-1) for t in g]) + prev_error - out
            torch.testing.assert_close(state.error_dict[0], expected)
            prev_error = state.error_dict[0].clone()
            total += out
            outs.append(out)
    avg_error = prev_error.clone()
    dist.all_reduce(avg_error, op=dist.ReduceOp.AVG)
    return {"total": total, "avg_error": avg_error, "outs": outs}


@pytest.mark.timeout(60)
def test_powersgd_error_feedback_accumulates_the_residual() -> None:
    n, iters = 2, 6
    res = run_threads(_error_feedback, n, iters)
    avg = _average(n, [(10, 8), (8,)], seed=3)
    k = iters - 2
    for r in res:
        # Σ_k out_k = K·avg(g) − avg(e_K): nothing is lost, only delayed
        torch.testing.assert_close(r["total"] + r["avg_error"], k * avg, rtol=1e-4, atol=1e-4)
        for out in r["outs"]:
            matrix = out[:80].view(10, 8)
            assert torch.linalg.matrix_rank(matrix).item() == 1          # a rank-1 approximation
            # the vector: exact
            torch.testing.assert_close(out[80:], avg[80:], rtol=1e-5, atol=1e-5)
        # a full-rank gradient is compressed
        assert not torch.allclose(r["outs"][0][:80], avg[:80], atol=1e-3)


def _empty_and_bad(rank: int, world_size: int) -> None:
    state = PowerSGDState(None, start_powerSGD_iter=2)
    state.iter = 5
    assert powerSGD_hook.powerSGD_hook(state, FakeBucket([])).wait().numel() == 0
    bucket = FakeBucket([torch.ones(4, 4)])
    bucket.set_buffer(torch.ones(20))
    with pytest.raises(ValueError,
                       match="expected the bucket's gradients to fill its buffer of 20"):
        powerSGD_hook.powerSGD_hook(state, bucket)


@pytest.mark.timeout(30)
def test_powersgd_edge_cases() -> None:
    run_threads(_empty_and_bad, 2)
    with pytest.raises(ValueError, match="start_powerSGD_iter > 1"):
        PowerSGDState(None, start_powerSGD_iter=1)
    with pytest.raises(ValueError, match="matrix_approximation_rank >= 1"):
        PowerSGDState(None, matrix_approximation_rank=0, start_powerSGD_iter=5)
    state = PowerSGDState(object(), start_powerSGD_iter=5, random_seed=7)
    copy = pickle.loads(pickle.dumps(state))
    assert copy.process_group is None and copy.start_powerSGD_iter == 5
    assert copy.rng.random() == state.rng.random()


@pytest.mark.timeout(10)
def test_plan_bucket_is_pure() -> None:
    plan = plan_bucket([torch.Size(s) for s in [(16, 12), (12,), (3, 4), (8, 4, 5), ()]], 2, 2)
    assert plan.compressed == ((0, 16, 12, 2), (3, 8, 20, 2))
    assert plan.uncompressed == (1, 2, 4)
    assert plan.offsets == (0, 192, 204, 216, 376)
    assert (plan.p_numel, plan.q_numel) == (16 * 2 + 8 * 2, 12 * 2 + 20 * 2)


# -- end to end on ringlet's DDP ------------------------------------------------------------------
def _mlp() -> torch.nn.Module:
    """A small model with deterministic values (rank threads share torch's global RNG)."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _ddp_with_hook(rank: int, world_size: int, which: str) -> list[list[torch.Tensor]]:
    from ringlet.parallel.ddp import DistributedDataParallel

    model = _mlp()
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.0005)       # several buckets
    hooks: dict[str, tuple[Any, Any]] = {
        "allreduce": (None, default_hooks.allreduce_hook),
        "fp16": (None, default_hooks.fp16_compress_hook),
        "bf16": (None, default_hooks.bf16_compress_hook),
        "powerSGD": (PowerSGDState(None, matrix_approximation_rank=1, start_powerSGD_iter=2),
                     powerSGD_hook.powerSGD_hook),
    }
    ddp.register_comm_hook(*hooks[which])
    grads = []
    for step in range(4):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        ddp(x).sum().backward()
        grads.append([p.grad.clone() for p in ddp.parameters()])
        ddp.zero_grad()
    return grads


def _local_grads(world_size: int, step: int) -> list[torch.Tensor]:
    """The average over ranks of each rank's local gradient (what an exact all-reduce yields)."""
    model = _mlp()
    for rank in range(world_size):
        x = torch.randn(6, 8, generator=torch.Generator().manual_seed(step * 10 + rank))
        model(x).sum().backward()
    return [p.grad / world_size for p in model.parameters()]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which", ["allreduce", "fp16", "bf16", "powerSGD"])
def test_hooks_registered_on_ringlet_ddp(which: str) -> None:
    pytest.importorskip("ringlet.parallel.ddp")
    n = 2
    out = run_threads(_ddp_with_hook, n, which)
    tol = {"allreduce": 1e-6, "fp16": 1e-2, "bf16": 5e-2, "powerSGD": 1e-6}[which]
    for step in range(4):
        expected = _local_grads(n, step)
        for rank in range(1, n):
            for a, b in zip(out[0][step], out[rank][step]):
                assert torch.equal(a, b)                      # every rank holds the same gradients
        if which == "powerSGD" and step >= 2:
            weight = out[0][step][0]                          # Linear(8, 16).weight: compressed
            assert torch.linalg.matrix_rank(weight).item() == 1
            # bias: exact
            torch.testing.assert_close(out[0][step][1], expected[1], rtol=1e-5, atol=1e-5)
            continue
        for a, b in zip(out[0][step], expected):
            torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


@pytest.mark.timeout(10)
def test_wrapper_passes_a_failed_hook_future_on() -> None:
    def failing(state: Any, bucket: Any) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_exception(RuntimeError("peer died"))
        return fut
    bucket = FakeBucket([torch.ones(3)])
    with pytest.raises(RuntimeError, match="peer died"):
        default_hooks.fp16_compress_wrapper(failing)(None, bucket).wait()
