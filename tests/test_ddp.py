"""DDP parity with single-process training on the global batch, under each option (ranks as
threads)."""

from __future__ import annotations

from typing import Any

import _ddp_workers as W
import pytest
import torch

from ringlet.testing import run_threads

TOL = 1e-9          # float64 models: differences come from summation order only


def _run(model: str, loss: str, ddp_kw: dict[str, Any], world_size: int = 2,
         **kw: Any) -> list[dict[str, Any]]:
    return run_threads(W.parity, world_size, model, loss, ddp_kw, **kw)


def _assert_parity(results: list[dict[str, Any]], tol: float = TOL) -> None:
    for r, res in enumerate(results):
        assert res["loss"] < tol, f"rank {r}: loss differs by {res['loss']}"
        assert res["param"] < tol, f"rank {r}: parameters differ by {res['param']}"
    assert results[0]["buffer"] < tol, f"rank 0: buffers differ by {results[0]['buffer']}"


SMALL = 0.0005      # MiB: forces several buckets on the test models


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ddp_kw", [
    {},
    {"bucket_cap_mb": SMALL},
    {"bucket_cap_mb": SMALL, "gradient_as_bucket_view": True},
    {"bucket_cap_mb": SMALL, "static_graph": True},
    {"bucket_cap_mb": SMALL, "find_unused_parameters": True},
    {"bucket_cap_mb": 0},
], ids=["default", "buckets", "bucket_view", "static_graph", "find_unused", "bucket_per_param"])
def test_mlp_parity(ddp_kw: dict[str, Any]) -> None:
    results = _run("mlp", "mlp", ddp_kw)
    _assert_parity(results)
    if ddp_kw.get("bucket_cap_mb") is not None:
        assert len(results[0]["buckets"]) > 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("view", [False, True])
def test_non_contiguous_parameter(view: bool) -> None:
    # the transposed weight is big enough for a solo bucket, but its gradient cannot be reduced in
    # place
    _assert_parity(_run("strided", "mlp",
                        {"bucket_cap_mb": SMALL, "gradient_as_bucket_view": view}))


@pytest.mark.timeout(60)
def test_solo_buckets_reduce_gradients_in_place() -> None:
    def body(rank: int, n: int) -> list[bool]:
        ddp = W.DDP(W.mlp(), bucket_cap_mb=SMALL)
        ptrs: dict[int, int] = {}
        for i, p in enumerate(ddp.module.parameters()):
            p.register_post_accumulate_grad_hook(
                lambda q, i=i: ptrs.__setitem__(i, q.grad.data_ptr()))
        W.mlp_loss(ddp, rank, 0).backward()
        solo = {b.plan.indices[0] for b in ddp.reducer.layout.buckets if b.plan.solo}
        return [ptrs[i] == p.grad.data_ptr() for i, p in enumerate(ddp.module.parameters())
                if i in solo]
    for same in run_threads(body, 2):
        assert same == [True, True, True]    # one-parameter buckets: .grad itself was all-reduced


@pytest.mark.timeout(60)
def test_mlp_float32_parity_three_ranks() -> None:
    _assert_parity(_run("mlp32", "mlp", {"bucket_cap_mb": SMALL}, world_size=3), tol=1e-5)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ddp_kw", [
    {"bucket_cap_mb": SMALL},
    {"bucket_cap_mb": SMALL, "gradient_as_bucket_view": True, "static_graph": True},
], ids=["buckets", "view_static"])
def test_transformer_parity(ddp_kw: dict[str, Any]) -> None:
    _assert_parity(_run("gpt", "gpt", ddp_kw))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("view", [False, True])
def test_rank_dependent_unused_parameters_get_averaged_gradients(view: bool) -> None:
    results = _run("branchy", "branchy", {"find_unused_parameters": True, "bucket_cap_mb": SMALL,
                                          "gradient_as_bucket_view": view})
    _assert_parity(results)
    for res in results:      # unused everywhere: untouched, like torch
        assert res["grads_none"] == ["never.weight", "never.bias"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ddp_kw", [{}, {"gradient_as_bucket_view": True}])
def test_broadcast_buffers_batchnorm_two_forwards(ddp_kw: dict[str, Any]) -> None:
    _assert_parity(_run("bn", "two_forward", ddp_kw))


@pytest.mark.timeout(60)
def test_frozen_parameters_are_excluded() -> None:
    results = _run("frozen", "mlp", {"bucket_cap_mb": SMALL})
    _assert_parity(results)
    indices = sorted(i for plan in results[0]["buckets"] for i in plan.indices)
    assert indices == [0, 1, 2, 3]          # 4 trainable tensors; the frozen layer is not bucketed
    assert results[0]["grads_none"] == ["0.weight", "0.bias"]


@pytest.mark.timeout(60)
def test_tied_parameters_counted_once() -> None:
    results = _run("gpt_tied", "gpt", {"bucket_cap_mb": SMALL})
    _assert_parity(results)
    n_trained = sum(len(plan.indices) for plan in results[0]["buckets"])
    assert n_trained == len(list(W.gpt(tie=True).parameters()))


@pytest.mark.timeout(60)
def test_mixed_dtypes_get_buckets_per_dtype() -> None:
    results = _run("mixed", "mlp", {})
    _assert_parity(results, tol=1e-5)
    assert sorted(str(p.dtype) for p in results[0]["buckets"]) == ["torch.float32", "torch.float64"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model,ddp_kw", [
    ("ckpt_reentrant", {"bucket_cap_mb": SMALL}),
    ("ckpt_reentrant", {"bucket_cap_mb": SMALL, "static_graph": True}),
    ("ckpt_plain", {"bucket_cap_mb": SMALL}),
    ("ckpt_plain", {"bucket_cap_mb": SMALL, "find_unused_parameters": True}),
])
def test_activation_checkpointing(model: str, ddp_kw: dict[str, Any]) -> None:
    _assert_parity(_run(model, "gpt", ddp_kw, steps=8))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ddp_kw",
                         [{}, {"broadcast_buffers": True, "find_unused_parameters": True}])
def test_eval_forward_under_no_grad_on_rank0_only(ddp_kw: dict[str, Any]) -> None:
    _assert_parity(_run("bn", "mlp", ddp_kw, eval_every=3))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["dict", "tuple", "dataclass"])
def test_structured_outputs(model: str) -> None:
    _assert_parity(_run(model, "struct", {"find_unused_parameters": True}))


def _avg_hook(pg: Any, bucket: Any) -> torch.futures.Future:
    import ringlet.distributed as dist

    buf = bucket.buffer()
    fut = dist.all_reduce(buf, group=pg, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0].div_(pg.size()))


@pytest.mark.timeout(60)
def test_comm_hook_parity() -> None:
    _assert_parity(_run("mlp", "mlp", {"bucket_cap_mb": SMALL}, hook=_avg_hook))


def _builtin_hook_run(rank: int, n: int, which: str) -> dict[str, Any]:
    from ringlet.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

    if which == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1,
                                            start_powerSGD_iter=2)
        return W.parity(rank, n, "mlp32", "mlp", {"bucket_cap_mb": SMALL}, steps=6,
                        hook=powerSGD_hook.powerSGD_hook, hook_state=state)
    hook = ({"allreduce": default_hooks.allreduce_hook,
             "fp16": default_hooks.fp16_compress_hook}[which])
    return W.parity(rank, n, "mlp32", "mlp", {"bucket_cap_mb": SMALL}, steps=6, hook=hook)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("which,tol", [("allreduce", 1e-6), ("fp16", 1e-2), ("powersgd", 0.5)])
def test_builtin_comm_hooks(which: str, tol: float) -> None:
    # compression changes the numbers a little (fp16) or a lot (rank-1 PowerSGD): bounded, not equal
    _assert_parity(run_threads(_builtin_hook_run, 2, which), tol=tol)


@pytest.mark.timeout(60)
def test_all_reduces_per_iteration() -> None:
    results = _run("mlp", "mlp", {"bucket_cap_mb": SMALL}, steps=5)
    counts, nb = results[0]["counts"], len(results[0]["buckets"])
    assert counts["all_reduce"] == 5 * nb, counts          # one per bucket per step, nothing else
    assert counts["all_gather"] == 5                       # the used-map, once per step
    assert counts["broadcast"] == 1                        # the bucket order, once (rebuild)
    assert set(counts) == {"all_reduce", "all_gather", "broadcast"}, counts
