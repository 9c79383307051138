"""ringlet.distributed.nn(.functional): collectives with gradients, as torch.distributed.nn.

Three tiers: every function's forward values and gradients against values worked out by hand
(ranks as threads, world sizes 2 and 3; roots are the last rank, so not the default 0); torch's
own torch.distributed.nn.functional side by side on gloo in the same processes (the oracle);
and a CLIP-style contrastive loss whose gradients equal one process over the whole batch.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from _nn_functional_workers import CASES, K, pieces, side_by_side, split, w_of, x_of

import ringlet.distributed as dist
import ringlet.distributed.nn as dnn
import ringlet.distributed.nn.functional as F
from ringlet.errors import CollectiveTimeoutError
from ringlet.testing import run_threads
from ringlet.testing.procs import raise_first, run_world

_SCALE = {"SUM": lambda n: 1.0, "AVG": lambda n: 1.0 / n}


def _expected(name: str, rank: int, n: int, op: str) -> dict[str, Any]:
    """What each case of _nn_functional_workers must return on ``rank`` (roots: rank n-1)."""
    root, c = n - 1, _SCALE[op](n)
    xs = [x_of(r) for r in range(n)]
    zeros = torch.zeros(K)
    if name == "broadcast":
        grad = sum(w_of(r) for r in range(n)) if rank == root else zeros
        return {"y": xs[root], "grad": grad, "x": xs[rank]}
    if name == "gather":
        y = torch.stack(xs) if rank == root else torch.zeros(n, K)
        return {"y": y, "grad": w_of(root, rank)}
    if name == "scatter":
        grads = [w_of(i) if rank == root else zeros for i in range(n)]
        return {"y": x_of(rank) + 100 * root, "grad": torch.stack(grads)}
    if name == "reduce":
        y = c * sum(xs) if rank == root else None
        return {"y": y, "grad": c * w_of(root), "x": xs[rank]}
    if name == "reduce_scatter":
        y = c * sum(pieces(k, n)[rank].detach() for k in range(n))
        return {"y": y, "grad": torch.stack([c * w_of(i) for i in range(n)]),
                "view_of_output": True}
    if name == "all_gather":
        return {"y": torch.stack(xs), "grad": sum(w_of(r, rank) for r in range(n)),
                "tuple": True}
    if name == "all_to_all":
        return {"y": torch.stack([x_of(rank) + 100 * k for k in range(n)]),
                "grad": torch.stack([w_of(i, rank) for i in range(n)]), "same_objects": True}
    if name == "all_to_all_single":
        return _expected_a2a_single(rank, n)
    if name == "all_reduce":
        return {"y": c * sum(xs), "grad": c * sum(w_of(r) for r in range(n)), "x": xs[rank]}
    raise AssertionError(name)


def _expected_a2a_single(rank: int, n: int) -> dict[str, Any]:
    """Route every rank's rows (and the loss weights back) as the uneven splits say."""
    def rows(r: int) -> list[torch.Tensor]:
        x = torch.arange(2.0 * sum(split(r, j) for j in range(n))).view(-1, 2) + 100 * r
        return list(x.split([split(r, j) for j in range(n)]))

    def weights(r: int) -> list[torch.Tensor]:
        total = sum(split(i, r) for i in range(n))
        w = torch.arange(1.0, 2 * total + 1).view(-1, 2) * (r + 1)
        return list(w.split([split(i, r) for i in range(n)]))
    y = torch.cat([rows(i)[rank] for i in range(n)])
    grad = torch.cat([weights(j)[rank] for j in range(n)])
    return {"y": y, "grad": grad, "view_of_output": True}


def _check(name: str, op: str) -> Any:
    def body(rank: int, n: int) -> None:
        got = CASES[name](F, dist, rank, n, op)
        want = _expected(name, rank, n, op)
        assert got.keys() == want.keys(), (sorted(got), sorted(want))
        for key, w in want.items():
            if isinstance(w, torch.Tensor):
                torch.testing.assert_close(got[key], w, rtol=0, atol=0,
                                           msg=lambda m, k=key: f"rank {rank} {name} {k}: {m}")
            else:
                assert got[key] == w, (rank, name, key, got[key], w)
    return body


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("name", list(CASES))
def test_forward_and_gradients(name: str, n: int) -> None:
    run_threads(_check(name, "SUM"), n)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["reduce", "reduce_scatter", "all_reduce"])
def test_avg_scales_the_gradient(name: str) -> None:
    run_threads(_check(name, "AVG"), 3)


@pytest.mark.timeout(90)
def test_side_by_side_with_torch_on_gloo(tmp_gloo: str) -> None:
    assert raise_first(run_world(2, side_by_side, tmp_gloo, timeout=60)) == [10, 10]


def test_public_names_match_torch() -> None:
    import inspect

    import torch.distributed.nn as tnn
    import torch.distributed.nn.functional as tf
    names = ["all_gather", "all_reduce", "all_to_all", "all_to_all_single", "broadcast", "gather",
             "reduce", "reduce_scatter", "scatter"]
    for name in names:
        assert getattr(dnn, name) is getattr(F, name)
        assert hasattr(tnn, name)
        theirs = list(inspect.signature(getattr(tf, name)).parameters)
        assert list(inspect.signature(getattr(F, name)).parameters) == theirs, name
    assert dnn.functional is F and sorted(dnn.__all__) == sorted([*names, "functional"])
    assert list(inspect.signature(F._all_gather_base).parameters) == \
        list(inspect.signature(tf._all_gather_base).parameters)


def _refuse_nonlinear(rank: int, n: int) -> None:
    x = x_of(rank).requires_grad_()
    calls = [("all_reduce", "MAX", lambda op: F.all_reduce(x, op=op)),
             ("reduce", "MIN", lambda op: F.reduce(x, dst=0, op=op)),
             ("reduce_scatter", "PRODUCT", lambda op: F.reduce_scatter(torch.zeros(K), [x] * n,
                                                                       op=op))]
    for name, op, call in calls:
        y = call(getattr(dist.ReduceOp, op))       # the forward runs
        if name == "all_reduce":
            assert torch.equal(y.detach(), x_of(n - 1))
        with pytest.raises(ValueError, match=rf"\[rank {rank}\] {name}: op: expected "
                           rf"ReduceOp.SUM, AVG or PREMUL_SUM to differentiate, got ReduceOp.{op}"):
            y.sum().backward()
    # PREMUL_SUM is linear: the gradient is scaled by its factor
    premul = dist._make_nccl_premul_sum(2.0)
    y = F.all_reduce(x, op=premul)
    (y * w_of(rank)).sum().backward()
    assert torch.equal(y.detach(), 2 * sum(x_of(r) for r in range(n)))
    assert torch.equal(x.grad, 2 * sum(w_of(r) for r in range(n)))
    assert F.all_reduce(torch.ones(1)).item() == n      # the group is still usable


def test_nonlinear_reductions_refuse_in_backward_premul_sum_scales() -> None:
    run_threads(_refuse_nonlinear, 2)


def _double_backward(rank: int, n: int) -> None:
    x = x_of(rank).requires_grad_()
    ys = F.all_gather(x)
    loss = sum((y * y).sum() for y in ys)           # every rank: the sum of all |x_k|^2
    (g,) = torch.autograd.grad(loss, x, create_graph=True)
    assert torch.equal(g.detach(), 2 * n * x_of(rank))      # summed over the n ranks
    # g (= 2n x) reached this rank through a reduce-scatter of every rank's 2 * ys: its
    # backward is an all-gather, and d(|2n x|^2)/dx = 8 n^2 x
    (g * g).sum().backward()
    assert torch.equal(x.grad, 8 * n * n * x_of(rank))


def test_double_backward_through_the_collectives() -> None:
    run_threads(_double_backward, 3)


def _errors(rank: int, n: int) -> None:
    one = torch.ones(2)
    cases = [
        (lambda: F.all_reduce([1.0]), TypeError, "all_reduce: tensor: expected"),
        (lambda: F.all_reduce(one, op="max"), TypeError, "all_reduce: op: expected a ReduceOp"),
        (lambda: F.broadcast(one, src=5), ValueError, "broadcast: src: expected a global rank"),
        (lambda: F.gather(one, dst=-1), ValueError, "gather: dst: expected a global rank"),
        (lambda: F.scatter(None), TypeError, "scatter: tensors: expected a list of 2 tensors"),
        (lambda: F.scatter([one]), ValueError, "scatter: tensors: expected 2"),
        (lambda: F.scatter([one, torch.ones(3)]), ValueError,
         r"scatter: tensors\[1\]: expected shape \(2,\)"),
        (lambda: F.reduce_scatter(one, [torch.ones(3)] * n), ValueError,
         r"reduce_scatter: input_list\[0\]: expected 2 elements"),
        (lambda: F.all_to_all([one] * n, one), TypeError,
         "all_to_all: input_tensor_list: expected a list"),
        (lambda: F.all_to_all_single(torch.ones(3), torch.ones(3)), ValueError,
         "all_to_all_single: input_split_sizes"),
        (lambda: F.all_gather(one.expand(2, 2), group="world"), TypeError, "all_gather: group"),
    ]
    for call, exc, match in cases:
        with pytest.raises(exc, match=rf"\[rank {rank}\] {match}"):
            call()
    lone = dist.new_group([0])
    if rank == 1:
        with pytest.raises(ValueError, match=r"\[rank 1\] all_gather: group: expected a group "
                           "this rank belongs to, got one without global rank 1"):
            F.all_gather(one, group=lone)
    else:
        (y,) = F.all_gather(one.requires_grad_(), group=lone)
        y.sum().backward()
        assert torch.equal(one.grad, torch.ones(2))
    assert F.all_reduce(torch.ones(1)).item() == n      # nothing was sent: the group works


def test_errors_name_the_function_and_the_argument() -> None:
    run_threads(_errors, 2)


def _subgroup_and_no_grad(rank: int, n: int) -> None:
    pair = dist.new_group([0, 2])
    x = x_of(rank).requires_grad_()
    if rank != 1:
        ys = F.all_gather(x, group=pair)
        assert torch.equal(torch.stack(ys).detach(), torch.stack([x_of(0), x_of(2)]))
        sum((y * w_of(rank, k)).sum() for k, y in enumerate(ys)).backward()
        want = sum(w_of(r, [0, 2].index(rank)) for r in (0, 2))
        assert torch.equal(x.grad, want)         # summed over the pair only
    y = F.all_reduce(x_of(rank))                 # no input requires grad: a plain result
    assert not y.requires_grad and torch.equal(y, sum(x_of(r) for r in range(n)))
    with torch.no_grad():
        ys = F.all_gather(x)
    assert not any(t.requires_grad for t in ys)


def test_subgroups_and_inputs_without_grad() -> None:
    run_threads(_subgroup_and_no_grad, 3)


def _skipped_backward(rank: int, n: int) -> float:
    y = F.all_reduce(torch.ones(2, requires_grad=True))
    t0 = time.monotonic()
    if rank == 0:       # rank 1 never runs the backward's all_reduce
        with pytest.raises(CollectiveTimeoutError, match="all_reduce"):
            y.sum().backward()
    else:
        time.sleep(1.5)     # alive, but elsewhere
    return time.monotonic() - t0


@pytest.mark.timeout(30)
def test_a_rank_that_skips_the_backward_is_an_error_at_the_deadline_not_a_hang() -> None:
    waited = run_threads(_skipped_backward, 2, op_timeout=1.0)[0]
    assert 0.9 <= waited < 1.5 + 3, waited


# -- a CLIP-style contrastive loss (open_clip's gather_with_grad, local_loss=True) ----------------
_B, _IN, _D = 3, 5, 4       # rows per rank, input and embedding widths


def _towers() -> tuple[torch.nn.Module, torch.nn.Module]:
    gen = torch.Generator().manual_seed(1)      # per call: rank threads share no random state
    towers = torch.nn.Linear(_IN, _D), torch.nn.Linear(_IN, _D)
    with torch.no_grad():
        for p in [*towers[0].parameters(), *towers[1].parameters()]:
            p.copy_(torch.randn(p.shape, generator=gen))
    return towers


def _clip_loss(img: torch.Tensor, txt: torch.Tensor, all_img: torch.Tensor,
               all_txt: torch.Tensor, first: int) -> torch.Tensor:
    """This rank's rows against every rank's columns; labels are the rows' global indices."""
    labels = torch.arange(first, first + img.shape[0])
    ce = torch.nn.functional.cross_entropy
    return (ce(10 * img @ all_txt.T, labels) + ce(10 * txt @ all_img.T, labels)) / 2


def _local_features(rank: int, n: int) -> tuple[Any, ...]:
    """The whole batch, this rank's towers and its rows' normalized features."""
    gen = torch.Generator().manual_seed(0)
    images, texts = torch.randn(n * _B, _IN, generator=gen), torch.randn(n * _B, _IN, generator=gen)
    towers = _towers()
    rows = slice(rank * _B, (rank + 1) * _B)
    norm = torch.nn.functional.normalize
    return images, texts, towers, norm(towers[0](images[rows])), norm(towers[1](texts[rows]))


def _whole_batch(images: torch.Tensor, texts: torch.Tensor) -> tuple[Any, ...]:
    """One process over the whole batch: (loss, towers with their gradients)."""
    towers = _towers()
    norm = torch.nn.functional.normalize
    all_img, all_txt = norm(towers[0](images)), norm(towers[1](texts))
    loss = _clip_loss(all_img, all_txt, all_img, all_txt, 0)
    loss.backward()
    return loss.detach(), towers


def _grads(towers: tuple[torch.nn.Module, torch.nn.Module]) -> list[torch.Tensor]:
    return [p.grad for t in towers for p in t.parameters()]


def _clip(rank: int, n: int) -> None:
    images, texts, towers, img, txt = _local_features(rank, n)
    loss = _clip_loss(img, txt, torch.cat(F.all_gather(img)), torch.cat(F.all_gather(txt)),
                      rank * _B)
    loss.backward()
    for g in _grads(towers):                 # what DDP does with the parameters' gradients
        dist.all_reduce(g, op=dist.ReduceOp.AVG)
    mean_loss = loss.detach().clone()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    ref_loss, ref_towers = _whole_batch(images, texts)
    torch.testing.assert_close(mean_loss, ref_loss, rtol=1e-6, atol=1e-6)
    for g, want in zip(_grads(towers), _grads(ref_towers)):
        torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [2, 3])
def test_contrastive_loss_gradients_equal_one_process_over_the_whole_batch(n: int) -> None:
    run_threads(_clip, n)


def _clip_without_grad_through_the_gather(rank: int, n: int) -> bool:
    """The control: gathering with the plain collective (no gradient to the peers' features)
    gives other gradients, so the test above can fail."""
    images, texts, towers, img, txt = _local_features(rank, n)
    gathered = []
    for local in (img, txt):
        outs = [torch.empty_like(local) for _ in range(n)]
        dist.all_gather(outs, local.detach())
        outs[rank] = local                  # open_clip's gather_features without grad
        gathered.append(torch.cat(outs))
    _clip_loss(img, txt, *gathered, rank * _B).backward()
    grad = towers[0].weight.grad.clone()
    dist.all_reduce(grad, op=dist.ReduceOp.AVG)
    _, ref_towers = _whole_batch(images, texts)
    return torch.allclose(grad, ref_towers[0].weight.grad, rtol=1e-5, atol=1e-6)


def test_contrastive_loss_control_without_gradients_through_the_gather_differs() -> None:
    assert run_threads(_clip_without_grad_through_the_gather, 2) == [False, False]


def _edges(rank: int, n: int) -> None:
    loss = torch.tensor(2.0 * (rank + 1), requires_grad=True)     # a 0-d loss, averaged
    avg = F.all_reduce(loss, op=dist.ReduceOp.AVG)
    avg.backward()
    assert avg.item() == n + 1 and loss.grad.item() == 1.0
    x = (torch.arange(6.0).view(2, 3) + rank).t().requires_grad_()   # a transposed view
    ys = F.all_gather(x)
    sum(y.sum() for y in ys).backward()
    assert all(y.is_contiguous() and torch.equal(y, ys[0] + r) for r, y in enumerate(ys))
    assert torch.equal(x.grad, torch.full((3, 2), float(n)))
    empty = torch.zeros(0, requires_grad=True)
    torch.cat(F.all_gather(empty)).sum().backward()
    assert empty.grad.shape == (0,)
    for out in (torch.zeros(2 * n), torch.zeros(n, 2)):       # concatenated and stacked
        x = torch.ones(2, requires_grad=True)
        with pytest.warns(FutureWarning, match="_all_gather_base is deprecated"):
            y = F._all_gather_base(out, x)
        assert y.data_ptr() == out.data_ptr() and torch.equal(out, torch.ones_like(out))
        (y * torch.arange(2.0 * n).view_as(y)).sum().backward()
        assert torch.equal(x.grad, n * torch.arange(2.0 * rank, 2.0 * rank + 2))
    x = torch.ones(2, requires_grad=True)       # a retained graph runs its collectives again
    ys = F.all_to_all([torch.zeros(2) for _ in range(n)], [x * (k + 1) for k in range(n)])
    total = sum(y.sum() for y in ys)
    total.backward(retain_graph=True)
    total.backward()
    assert torch.equal(x.grad, torch.full((2,), 2.0 * sum(range(1, n + 1))))


def test_scalars_views_empty_tensors_all_gather_base_and_retained_graphs() -> None:
    run_threads(_edges, 2)
